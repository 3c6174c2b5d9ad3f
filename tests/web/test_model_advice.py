"""A page request gets the model's recommended repetition guard: the settings the page has no field for
(repetition penalty, top-k) come from the model's generation_config.json, what the page sends stays."""

from __future__ import annotations

from playground.jobs import spec_from_frame

ADVISED = {
    "coder": {
        "chat": False,
        "sampling_defaults": {"repetition_penalty": 1.2, "top_k": 40, "temperature": 0.6},
    }
}


def test_the_models_repetition_guard_fills_what_the_page_cannot_send():
    spec = spec_from_frame({"prompt": "def f(", "temperature": 0.2, "top_p": 0.95}, ADVISED)
    # the page's own fields are the person's (the page showed the recommended values in them already)
    assert spec.params == {"temperature": 0.2, "top_p": 0.95, "repetition_penalty": 1.2, "top_k": 40}


def test_a_frame_that_says_keeps_its_value_and_a_model_without_advice_adds_nothing():
    spec = spec_from_frame({"prompt": "def f(", "repetition_penalty": 1.0}, ADVISED)
    assert spec.params["repetition_penalty"] == 1.0
    assert spec_from_frame({"prompt": "def f("}, {"coder": {"chat": False}}).params == {}
    bad = {"coder": {"chat": False, "sampling_defaults": {"repetition_penalty": 9.0}}}
    assert spec_from_frame({"prompt": "def f("}, bad).params == {
        "repetition_penalty": 2.0
    }  # the page's range
