"""The rule that sends a sampled request from the head screen to the whole head (inference/fast/head_choice.py)."""

import pytest

from inference.fast.head_choice import ScreenWatch


def test_no_decision_before_min_steps():
    watch = ScreenWatch(1000, share=0.25, window=4, min_steps=2)
    assert watch.keeps_screen(1000), "one flat step alone does not decide"
    assert not watch.keeps_screen(0)  # the mean of two steps, 500, passes 250


def test_a_peaked_request_keeps_the_screen_and_a_flat_one_leaves_it():
    peaked = ScreenWatch(1000, share=0.25, window=4, min_steps=4)
    assert all(
        peaked.keeps_screen(n) for n in (20, 900, 15, 10, 30, 12, 8)
    )  # one flat step among peaked ones
    flat = ScreenWatch(1000, share=0.25, window=4, min_steps=3)
    assert [flat.keeps_screen(n) for n in (300, 260, 280)] == [True, True, False]
    assert not flat.keeps_screen(0), "the decision is one-way"


def test_only_the_last_window_counts():
    watch = ScreenWatch(100, share=0.5, window=3, min_steps=3)
    assert [watch.keeps_screen(n) for n in (10, 10, 10, 100, 100)] == [True, True, True, True, False]
    # the window after the fifth step is (10, 100, 100): mean 70 > 50; after the fourth (10, 10, 100): 40


def test_the_shares_ends():
    never = ScreenWatch(10, share=1.0, window=2, min_steps=1)
    assert all(never.keeps_screen(10) for _ in range(5)), "no step reads more than the whole vocabulary"
    at_once = ScreenWatch(10, share=0.0, window=2, min_steps=1)
    assert at_once.keeps_screen(0) and not at_once.keeps_screen(1)


@pytest.mark.parametrize(
    "kwargs", [{"share": -0.1}, {"share": 1.5}, {"min_steps": 0}, {"window": 2, "min_steps": 3}]
)
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="share|min_steps"):
        ScreenWatch(100, **kwargs)
