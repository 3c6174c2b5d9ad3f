"""OpenAI request bodies -> JobSpec: what is accepted, what each refusal names."""

import pytest

from common.events import MAX_PREDICTION_CHARS, InvalidRequest, SamplingParams
from common.protocol import JobSpec
from playground.api.params import parse_request

CAP = 100
MAX_CHARS = 50

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def parse(body: dict, chat: bool):
    return parse_request(body, chat, max_new_tokens=CAP, max_prompt_chars=MAX_CHARS)


def refused_field(body: dict, chat: bool = True) -> str:
    with pytest.raises(InvalidRequest) as info:
        parse(body, chat)
    assert info.value.field in str(info.value)  # the one-line message names the field
    return info.value.field


def test_chat_request_becomes_a_chat_job_with_openai_defaults():
    request = parse(CHAT, chat=True)
    spec = request.spec
    assert (spec.model, spec.chat, spec.prompt, spec.source) == ("m", True, None, "api")
    assert spec.messages == [{"role": "user", "content": "hi"}]
    assert spec.params["temperature"] == 1.0 and spec.params["max_new_tokens"] == CAP
    assert (request.stream, request.include_usage) == (False, False)
    assert spec.sampling_params().temperature == 1.0  # what the worker rebuilds validates again


def test_completion_parameters_map_onto_sampling_params():
    body = {"model": "m", "prompt": ["def f():"], "max_tokens": 7, "temperature": 0, "top_p": 0.5,
            "seed": 3, "stop": "\n\n", "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    request = parse(body, chat=False)
    params = request.spec.sampling_params()
    assert request.spec.prompt == "def f():" and not request.spec.chat
    assert (params.max_new_tokens, params.temperature, params.top_p, params.seed) == (7, 0, 0.5, 3)
    assert params.stop == ("\n\n",)
    assert (request.stream, request.include_usage) == (True, True)


def test_seed_minus_one_is_llama_cpps_random_seed_and_other_negatives_are_seeds():
    assert parse({**CHAT, "seed": -1}, chat=True).spec.sampling_params().seed is None
    assert parse({**CHAT, "seed": -2}, chat=True).spec.sampling_params().seed == -2
    assert refused_field({**CHAT, "seed": -1.0}) == "seed"  # as 1.0 is: a seed is an integer
    assert refused_field({**CHAT, "seed": True}) == "seed"  # JSON's true is not the integer 1


def test_max_completion_tokens_wins_over_max_tokens():
    spec = parse({**CHAT, "max_tokens": 5, "max_completion_tokens": 9}, chat=True).spec
    assert spec.params["max_new_tokens"] == 9


def test_top_p_zero_as_openai_takes_it_is_a_greedy_draw():
    params = parse({**CHAT, "top_p": 0, "temperature": 0.7, "seed": 1}, chat=True).spec.sampling_params()
    assert (params.temperature, params.top_p, params.seed) == (0, 1.0, 1)
    assert refused_field({**CHAT, "top_p": 0, "temperature": "hot"}) == "temperature"  # still checked


def test_a_completion_without_max_tokens_is_sixteen_tokens_as_openais_legacy_api():
    assert parse({"model": "m", "prompt": "def f():"}, chat=False).spec.params["max_new_tokens"] == 16
    assert (
        parse({"model": "m", "prompt": "x", "max_tokens": 40}, chat=False).spec.params["max_new_tokens"] == 40
    )
    assert parse(CHAT, chat=True).spec.params["max_new_tokens"] == CAP  # a chat reply runs to the cap
    tiny_cap = parse_request(
        {"model": "m", "prompt": "x"}, False, max_new_tokens=4, max_prompt_chars=MAX_CHARS
    )
    assert tiny_cap.spec.params["max_new_tokens"] == 4  # never past the server's cap


def test_logprobs_zero_is_off_for_chat_and_a_request_for_completions():
    # chat's logprobs is a switch; the completions API's a count, whose 0 still asks for the chosen tokens'
    assert "logprobs" not in parse({**CHAT, "logprobs": 0}, chat=True).spec.params
    assert parse({"model": "m", "prompt": "x", "logprobs": 0}, chat=False).spec.params["logprobs"] == 0
    assert "logprobs" not in parse({"model": "m", "prompt": "x", "logprobs": None}, chat=False).spec.params
    assert parse({**CHAT, "logprobs": True, "top_logprobs": 5}, chat=True).spec.params["logprobs"] == 5
    assert parse({**CHAT, "logprobs": True}, chat=True).spec.params["logprobs"] == 0
    assert refused_field({**CHAT, "logprobs": 1}) == "logprobs"  # chat's is a switch
    assert refused_field({"model": "m", "prompt": "x", "logprobs": True}, chat=False) == "logprobs"


def test_suffix_makes_a_completion_fill_in_the_middle():
    spec = parse({"model": "m", "prompt": "def f(", "suffix": "):\n    pass\n"}, chat=False).spec
    assert (spec.prompt, spec.suffix) == ("def f(", "):\n    pass\n")
    assert (
        parse({"model": "m", "prompt": "", "suffix": "x"}, chat=False).spec.prompt == ""
    )  # cursor at the start
    assert refused_field({"model": "m", "prompt": "a", "suffix": 3}, chat=False) == "suffix"
    assert refused_field({"model": "m", "prompt": "a", "suffix": "\ud83d"}, chat=False) == "suffix"
    assert refused_field({**CHAT, "suffix": "x"}) == "suffix"


def test_max_tokens_over_the_servers_cap_is_clipped_to_it():
    spec = parse({**CHAT, "max_tokens": CAP + 1}, chat=True).spec
    assert spec.params["max_new_tokens"] == CAP


def test_message_parts_roles_and_stop_lists():
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    spec = parse({"model": "m", "messages": messages, "stop": ["x", "y"]}, chat=True).spec
    assert spec.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert spec.sampling_params().stop == ("x", "y")


@pytest.mark.parametrize(
    "change, field",
    [
        ({"model": None}, "model"),
        ({"messages": []}, "messages"),
        ({"messages": ["hi"]}, "messages[0]"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
        ({"model": 5}, "model"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": "many"}, "max_completion_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": -0.1}, "top_p"),
        ({"seed": 1.5}, "seed"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),  # OpenAI's limit is four
        ({"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": {"name": "user"}, "content": "x"}]}, "messages[0].role"),
        ({"n": 9}, "n"),  # past MAX_CHOICES
        ({"n": 0}, "n"),
        ({"n": True}, "n"),  # JSON's true is not the number 1
        ({"best_of": True}, "best_of"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": "\ud83d"}, "stop"),  # half a surrogate pair, as a prompt's would be
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": "y"}}, "stream_options.include_usage"),
        ({"stream": True, "stream_options": {"include_usage": True, "typo": 1}}, "stream_options.typo"),
        (
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats",
        ),
        (
            {"stream": True, "stream_options": {"include_obfuscation": 1}},
            "stream_options.include_obfuscation",
        ),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"tools": [{"type": "function"}]}, "tools"),
    ],
)
def test_bad_chat_parameters_name_their_field(change, field):
    assert refused_field({**CHAT, **change}) == field


def test_a_model_of_the_wrong_type_is_told_so_not_that_it_is_missing():
    with pytest.raises(InvalidRequest, match=r'model: must be a string, got \["default"\]'):
        parse({**CHAT, "model": ["default"]}, chat=True)
    with pytest.raises(InvalidRequest, match="model: is required"):
        parse({k: v for k, v in CHAT.items() if k != "model"}, chat=True)


def test_stream_options_that_change_nothing_are_taken():
    for options in ({"include_obfuscation": False}, {"include_usage": True, "continuous_usage_stats": False},
                    {"include_obfuscation": None}):  # fmt: skip
        request = parse({**CHAT, "stream": True, "stream_options": options}, chat=True)
        assert request.include_usage == options.get("include_usage", False)


@pytest.mark.parametrize("prompt", [None, 3, {"text": "a"}, [None], ["a", "b"]])
def test_completion_prompt_must_be_one_prompt(prompt):
    assert refused_field({"model": "m", "prompt": prompt}, chat=False) == "prompt"


@pytest.mark.parametrize("prompt", [[5, 0, 17], [[5, 0, 17]]])
def test_a_prompt_of_token_ids_is_kept_as_ids_not_text(prompt):
    spec = parse({"model": "m", "prompt": prompt, "echo": True, "logprobs": 1}, chat=False).spec
    assert (spec.prompt, spec.prompt_ids) == (None, [5, 0, 17])
    assert spec.params["prompt_logprobs"] == 1  # an echo scores the ids as it scores a text's tokens


@pytest.mark.parametrize(
    "body, chat, words",
    [
        ({"prompt": []}, False, "prompt: must not be empty"),
        ({"prompt": [[]]}, False, "prompt: must not be empty"),
        ({"prompt": [[1, 2], [3]]}, False,
         "prompt: holds 2 prompts: batching several prompts is not supported, send one prompt per request"),
        ({"prompt": ["a", "b", "c"]}, False, "prompt: holds 3 prompts: batching several prompts is not supported"),
        ({"prompt": ["a", [1]]}, False, "prompt: holds 2 prompts"),
        ({"prompt": [1, "a"]}, False, "or a list holding one of either; got 'a' in a list of token ids"),
        ({"prompt": [[1, "a"]]}, False, "got 'a' in a list of token ids"),
        ({"prompt": [7, -2]}, False, "got -2 in a list of token ids"),
        ({"prompt": [7, True]}, False, "got True in a list of token ids"),  # JSON's true is no id
        ({"prompt": [7.0]}, False, "got 7.0 in a list of token ids"),
        ({"prompt": [7, 8], "suffix": "x"}, False,
         "prompt: token ids cannot go with a suffix: fill in the middle takes the prompt as text"),
        ({"prompt": list(range(MAX_CHARS + 1))}, False,
         f"prompt: is {MAX_CHARS + 1} token ids long; the server takes at most {MAX_CHARS}"),
        ({**CHAT, "prompt": [7, 8]}, True, "prompt: is not a field of /v1/chat/completions, which takes messages"),
    ],
)  # fmt: skip
def test_token_id_prompts_that_make_no_sense_are_refused_saying_why(body, chat, words):
    with pytest.raises(InvalidRequest) as refused:
        parse({"model": "m", **body}, chat)
    assert refused.value.field == "prompt" and words in str(refused.value)


def test_body_must_be_an_object():
    assert refused_field([CHAT]) == "body"


def test_fields_that_change_nothing_and_default_values_are_accepted():
    body = {**CHAT, "user": "me", "n": 1, "presence_penalty": 0, "logprobs": False, "metadata": {}}
    assert parse(body, chat=True).spec.model == "m"
    # what the official client and the common ones send beside the parameters (all change nothing)
    sent_by_clients = {"store": True, "service_tier": "auto", "parallel_tool_calls": True, "prompt_cache_key": "k",
                       "safety_identifier": "h",
                       "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    assert parse({**CHAT, **sent_by_clients}, chat=True).include_usage


@pytest.mark.parametrize(
    "body, chat",
    [
        ({**CHAT, "max_token": 5}, True),  # misspelt: dropped, it would leave the reply at the server's cap
        ({**CHAT, "max_output_tokens": 5}, True),  # the Responses API's name
        ({**CHAT, "samplers": ["top_k", "temperature"]}, True),  # llama.cpp's sampler order
        ({**CHAT, "logits_processors": ["x"]}, True),
        ({"model": "m", "prompt": "x", "top_a": 0.2}, False),
    ],
)
def test_an_unknown_field_is_refused_naming_it_as_openai_refuses_it(body, chat):
    field = refused_field(body, chat)
    assert field not in CHAT and field not in {"model", "prompt"}


def test_a_null_field_is_absent_whatever_its_name_and_each_endpoint_takes_its_own_input():
    nulls = {"frequency_penalty": None, "logit_bias": None, "some_future_field": None, "prompt": None}
    assert parse({**CHAT, **nulls}, chat=True).spec.messages == CHAT["messages"]
    assert refused_field({**CHAT, "prompt": "hi"}) == "prompt"  # a completion's, on the chat endpoint
    assert (
        refused_field({"model": "m", "prompt": "x", "messages": CHAT["messages"]}, chat=False) == "messages"
    )


def test_prompts_over_the_servers_character_cap_are_refused():
    long_turns = [{"role": "user", "content": "x" * 30}, {"role": "assistant", "content": "y" * 30}]
    assert refused_field({"model": "m", "messages": long_turns}) == "messages"
    assert refused_field({"model": "m", "prompt": "x" * (MAX_CHARS + 1)}, chat=False) == "prompt"


@pytest.mark.parametrize(
    "body, chat, field",
    [
        ({"model": "m", "prompt": "abc\ud800def"}, False, "prompt"),
        ({"model": "m", "prompt": ""}, False, "prompt"),
        ({"model": "m", "messages": [{"role": "user", "content": "hi \ud83d"}]}, True, "messages[0].content"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
            True,
            "messages[0].content",
        ),
        ({**CHAT, "response_format": {"type": "json_object"}}, True, "response_format"),
        ({**CHAT, "logit_bias": {"50256": -100}}, True, "logit_bias"),
        ({**CHAT, "top_logprobs": 3}, True, "top_logprobs"),
        ({**CHAT, "tool_choice": "required"}, True, "tool_choice"),
        ({**CHAT, "seed": 2**63}, True, "seed"),  # OpenAI's seed is an int64
        ({**CHAT, "repetition_penalty": 1e-308}, True, "repetition_penalty"),
    ],
)
def test_text_no_tokenizer_takes_and_fields_we_cannot_honour_are_refused(body, chat, field):
    assert refused_field(body, chat) == field


def test_the_defaults_of_fields_we_cannot_honour_are_accepted():
    body = {
        **CHAT,
        "response_format": {"type": "text"},
        "tool_choice": "none",
        "logit_bias": {},
        "top_logprobs": 0,
    }
    assert parse(body, chat=True).spec.messages == CHAT["messages"]
    assert parse({"model": "m", "prompt": "ok \U0001f600"}, chat=False).spec.prompt == "ok \U0001f600"


@pytest.mark.parametrize(
    "change",
    [
        {"modalities": ["text", "audio"]},
        {"audio": {"voice": "alloy", "format": "wav"}},
        {"function_call": {"name": "get_weather"}},
        {"web_search_options": {}},
        {"reasoning_effort": "high"},
        {"verbosity": "low"},
        # vLLM's and llama.cpp's constraints, which a client written for them sends through extra_body
        {"min_tokens": 64},
        {"min_p": 0.1},
        {"skip_special_tokens": False},
        {"guided_json": {"type": "object"}},
        {"guided_choice": ["yes", "no"]},
        {"structured_outputs": {"regex": "a+"}},
        {"grammar": 'root ::= "a"'},
        {"use_beam_search": True},
        {"prompt_logprobs": 0},  # vLLM: still the prompt tokens' own log-probabilities
        # vLLM's chat template switches: another prompt than the checkpoint's template renders
        {"add_generation_prompt": False},
        {"continue_final_message": True},
        {"chat_template": "{{ messages[0].content }}"},
        {"documents": [{"title": "t", "text": "x"}]},
        {"add_special_tokens": True},  # chat's default is false: the template writes BOS itself
        {"mm_processor_kwargs": {"num_crops": 4}},
        {"return_token_ids": True},
        # llama.cpp's samplers
        {"n_probs": 3},
        {"dry_multiplier": 0.8},
        {"xtc_probability": 0.5},
        {"top_n_sigma": 1.0},
        {"dynatemp_range": 0.5},
        {"typical_p": 0.9},
        {"mirostat": 2},
        {"tfs_z": 0.95},
        {"repeat_penalty": 1.1},
        {"min_keep": 5},
        {"n_predict": 64},
    ],
)
def test_fields_that_would_change_the_reply_are_refused_not_dropped(change):
    assert refused_field({**CHAT, **change}) == next(iter(change))


def test_vllms_length_and_stop_fields_reach_the_sampling_parameters():
    body = {**CHAT, "ignore_eos": True, "stop_token_ids": [7, 9], "include_stop_str_in_output": True}
    params = parse(body, chat=True).spec.sampling_params()
    assert params.ignore_eos and params.include_stop_str_in_output and params.stop_token_ids == (7, 9)
    assert parse(CHAT, chat=True).spec.sampling_params().stop_token_ids == ()
    for bad in ({"ignore_eos": 1}, {"include_stop_str_in_output": "yes"}, {"stop_token_ids": 7},
                {"stop_token_ids": [-1]}, {"stop_token_ids": [True]}, {"stop_token_ids": list(range(65))}):  # fmt: skip
        assert refused_field({**CHAT, **bad}) == next(iter(bad))


def test_a_prediction_reaches_the_sampling_parameters_as_its_text():
    """OpenAI's Predicted Outputs: content as text, or as the list of text parts the official client types."""
    body = {**CHAT, "prediction": {"type": "content", "content": "def f():\n"}}
    assert parse(body, chat=True).spec.sampling_params().prediction == "def f():\n"
    parts = [{"type": "text", "text": "def "}, {"type": "text", "text": "f():"}]
    body = {**CHAT, "prediction": {"type": "content", "content": parts}}
    assert parse(body, chat=True).spec.sampling_params().prediction == "def f():"
    assert parse(CHAT, chat=True).spec.sampling_params().prediction == ""
    for bad in ("text", {"content": "x"}, {"type": "file", "content": "x"}, {"type": "content", "content": 3},
                {"type": "content", "content": [{"type": "image_url", "image_url": "u"}]},
                {"type": "content", "content": "x", "extra": 1}, {"type": "content", "content": "\ud83d"},
                {"type": "content", "content": "x" * (MAX_CHARS + 1)}):  # fmt: skip
        assert refused_field({**CHAT, "prediction": bad}) == "prediction"
    with pytest.raises(InvalidRequest, match="prediction: may be at most"):  # the engine's own bound
        SamplingParams(prediction="x" * (MAX_PREDICTION_CHARS + 1))


def test_a_refusal_says_which_value_would_be_taken_or_what_to_use_instead():
    with pytest.raises(
        InvalidRequest, match=r"dry_multiplier: is not supported \(only 0, which changes nothing\)"
    ):
        parse({**CHAT, "dry_multiplier": 0.8}, chat=True)
    with pytest.raises(InvalidRequest, match="repeat_penalty: is not supported; use repetition_penalty"):
        parse({**CHAT, "repeat_penalty": 1.1}, chat=True)
    with pytest.raises(InvalidRequest, match="add_special_tokens: only false"):
        parse({**CHAT, "add_special_tokens": True}, chat=True)


def test_top_k_minus_one_is_vllms_off_as_our_zero():
    assert parse({**CHAT, "top_k": -1}, chat=True).spec.sampling_params().top_k == 0
    assert parse({**CHAT, "top_k": 40}, chat=True).spec.sampling_params().top_k == 40
    assert refused_field({**CHAT, "top_k": -2}) == "top_k"


def test_add_special_tokens_is_taken_at_each_endpoints_own_default_as_vllms():
    assert parse({**CHAT, "add_special_tokens": False}, chat=True).spec.messages == CHAT["messages"]
    completion = {"model": "m", "prompt": "def f():"}
    assert parse({**completion, "add_special_tokens": True}, chat=False).spec.prompt == "def f():"
    assert refused_field({**completion, "add_special_tokens": False}, chat=False) == "add_special_tokens"


def test_a_penalty_window_is_refused_only_where_a_penalty_would_use_it():
    # llama.cpp's repeat_last_n (penalty_last_n): here repetition_penalty covers the whole context, its -1
    assert parse({**CHAT, "repeat_last_n": 64}, chat=True).spec.model == "m"  # no penalty: changes nothing
    assert parse({**CHAT, "repetition_penalty": 1.1, "penalty_last_n": -1}, chat=True).spec.model == "m"
    for name in ("repeat_last_n", "penalty_last_n"):
        assert refused_field({**CHAT, "repetition_penalty": 1.1, name: 64}) == name
        assert (
            refused_field({**CHAT, "repetition_penalty": 1.1, name: 0}) == name
        )  # llama.cpp: 0 is no penalty


def test_their_neutral_values_are_accepted():
    neutral = {"modalities": ["text"], "function_call": "auto", "min_tokens": 0, "ignore_eos": False, "min_p": 0,
               "stop_token_ids": [], "include_stop_str_in_output": False, "skip_special_tokens": True,
               "typical_p": 1.0, "user": "someone", "metadata": {"k": "v"}, "store": False}  # fmt: skip
    assert parse({**CHAT, **neutral}, chat=True).spec.messages == CHAT["messages"]
    # vLLM's template switches at their defaults, llama.cpp's samplers switched off: what such clients send
    vllm = {"chat_template_kwargs": {}, "add_generation_prompt": True, "continue_final_message": False,
            "add_special_tokens": False, "mm_processor_kwargs": {}, "documents": None, "chat_template": None}  # fmt: skip
    assert parse({**CHAT, **vllm}, chat=True).spec.messages == CHAT["messages"]
    llama_cpp = {"n_probs": 0, "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2,
                 "dry_penalty_last_n": -1, "dry_sequence_breakers": ["\n", ":"], "xtc_probability": 0,
                 "xtc_threshold": 0.1, "top_n_sigma": -1, "typical_p": 1, "mirostat": 0, "mirostat_tau": 5,
                 "mirostat_eta": 0.1, "tfs_z": 1, "dynatemp_range": 0, "dynatemp_exponent": 1,
                 "repeat_penalty": 1.0, "repeat_last_n": 64, "penalize_nl": False, "min_keep": 0,
                 "cache_prompt": True, "id_slot": -1}  # fmt: skip
    assert parse({**CHAT, **llama_cpp}, chat=True).spec.messages == CHAT["messages"]
    completion = parse(
        {"model": "m", "prompt": "def f():", "suffix": ""}, chat=False
    )  # an empty suffix asks nothing
    assert completion.spec.prompt == "def f():" and completion.spec.suffix is None


def test_a_message_field_that_would_be_dropped_is_refused_and_the_clients_own_empty_ones_are_not():
    call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for message, field in (
        ({"role": "assistant", "content": "x", "tool_calls": [call]}, "messages[1].tool_calls"),
        (
            {"role": "assistant", "content": None, "tool_calls": [call]},
            "messages[1].tool_calls",
        ),  # not content
        ({"role": "assistant", "content": "x", "function_call": {"name": "f"}}, "messages[1].function_call"),
        ({"role": "assistant", "content": "x", "prefix": True}, "messages[1].prefix"),
        ({"role": "user", "content": "x", "audio": {"id": "a"}}, "messages[1].audio"),
        ({"role": "user", "content": "x", "whatever": 1}, "messages[1].whatever"),
    ):
        assert refused_field({**CHAT, "messages": [CHAT["messages"][0], message]}) == field
    # an assistant message as the openai client returns it (model_dump), sent back as history
    echoed = {"role": "assistant", "content": "x", "refusal": None, "annotations": [], "audio": None,
              "function_call": None, "tool_calls": None, "anything": None}  # fmt: skip
    assert parse({**CHAT, "messages": [CHAT["messages"][0], echoed]}, chat=True).spec.messages[1] == {
        "role": "assistant",
        "content": "x",
    }


def test_a_participants_name_goes_to_the_template_in_openais_form_only():
    body = {
        "model": "m",
        "messages": [{"role": "user", "name": "alice-2", "content": "hi"}, {"role": "user", "content": "x"}],
    }
    assert parse(body, chat=True).spec.messages[0] == {"role": "user", "name": "alice-2", "content": "hi"}
    assert "name" not in parse(body, chat=True).spec.messages[1]
    for name in (
        "",
        "a b",
        "<|im_start|>",
        "x" * 65,
        7,
    ):  # a name is copied outside any content: no control token
        bad = {"model": "m", "messages": [{"role": "user", "name": name, "content": "hi"}]}
        assert refused_field(bad) == "messages[0].name"


def test_the_request_id_becomes_the_jobs():
    request = parse_request(CHAT, True, max_new_tokens=CAP, max_prompt_chars=MAX_CHARS, job_id="abc123")
    assert request.spec.id == "abc123"
    assert parse(CHAT, chat=True).spec.id != parse(CHAT, chat=True).spec.id


def test_a_chats_template_variables_go_with_its_job_and_bad_ones_are_refused():
    spec = parse({**CHAT, "chat_template_kwargs": {"enable_thinking": False}}, chat=True).spec
    assert spec.template_kwargs == {"enable_thinking": False}
    assert JobSpec.from_json(spec.to_json()).template_kwargs == {
        "enable_thinking": False
    }  # as the worker reads it
    assert parse({**CHAT, "chat_template_kwargs": {}}, chat=True).spec.template_kwargs is None
    for bad, says in [
        ("thinking", "must be an object"),
        ({"messages": []}, "'messages' is set by the server"),
        ({"eos_token": "x"}, "'eos_token' is set by the server"),
        ({"not a name": 1}, "'not a name' is not a name a template can read"),
    ]:
        with pytest.raises(InvalidRequest, match=says) as info:
            parse({**CHAT, "chat_template_kwargs": bad}, chat=True)
        assert info.value.field == "chat_template_kwargs"
    with pytest.raises(InvalidRequest, match="goes through no template") as info:
        parse(
            {"model": "m", "prompt": "def f():", "chat_template_kwargs": {"enable_thinking": False}},
            chat=False,
        )
    assert info.value.field == "chat_template_kwargs"


def test_a_models_recommended_sampling_fills_what_the_request_leaves_out():
    recommended = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}

    def params(body: dict, chat: bool = True, defaults: dict | None = recommended) -> dict:
        return parse_request(body, chat, 512, 10_000, model_defaults=defaults).spec.params

    assert {key: params(CHAT)[key] for key in recommended} == recommended
    assert params({**CHAT, "temperature": 0.2, "top_k": -1})["temperature"] == 0.2  # the request's own win
    assert params({**CHAT, "top_k": -1})["top_k"] == 0  # vLLM's "off", over the model's 20
    assert (
        params({**CHAT, "top_p": 0})["temperature"] == 0.0
    )  # OpenAI's top_p=0: greedy, whatever the default
    assert params({"model": "m", "prompt": "def f():"}, chat=False)["top_k"] == 20  # completions too
    assert params(CHAT, defaults=None)["temperature"] == 1.0  # none: OpenAI's
    assert params(CHAT, defaults={"seed": 1})["seed"] is None  # the sampling keys only
    # generation_config.json's max_new_tokens: a request's length when it gives none, under the server's cap
    long = {**recommended, "max_new_tokens": 300}
    assert params(CHAT, defaults=long)["max_new_tokens"] == 300
    assert params({"model": "m", "prompt": "def f():"}, chat=False, defaults=long)["max_new_tokens"] == 300
    assert params({**CHAT, "max_tokens": 7}, defaults=long)["max_new_tokens"] == 7  # the request's own
    assert params(CHAT, defaults={"max_new_tokens": 4096})["max_new_tokens"] == 512  # the server's cap


def test_what_a_request_may_store_is_bounded_and_each_refusal_names_its_limit():
    from playground.api.params import MAX_STOP_CHARS, MAX_TEMPLATE_KWARGS_CHARS, MAX_TEMPLATE_KWARGS_DEPTH

    with pytest.raises(InvalidRequest, match="at most 4 sequences, got 5"):
        parse({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, chat=True)
    with pytest.raises(InvalidRequest, match=f"at most {MAX_STOP_CHARS} characters, got 10,000"):
        parse({**CHAT, "stop": "x" * 10_000}, chat=True)
    with pytest.raises(InvalidRequest, match=f"at most {MAX_STOP_CHARS} characters"):
        parse({**CHAT, "stop": ["ok", "y" * (MAX_STOP_CHARS + 1)]}, chat=True)
    assert parse({**CHAT, "stop": ["z" * MAX_STOP_CHARS]}, chat=True).spec.params["stop"] == [
        "z" * MAX_STOP_CHARS
    ]

    big = {"note": "n" * MAX_TEMPLATE_KWARGS_CHARS}
    with pytest.raises(InvalidRequest, match=f"at most {MAX_TEMPLATE_KWARGS_CHARS:,} characters as JSON"):
        parse({**CHAT, "chat_template_kwargs": big}, chat=True)
    nested: dict = {}
    for _ in range(900):  # past the JSON encoder's recursion limit: measured, never a RecursionError
        nested = {"k": nested}
    for kwargs in ({"deep": nested}, {"deep": [[[[[[[[["x"]]]]]]]]]}):
        with pytest.raises(InvalidRequest, match=f"at most {MAX_TEMPLATE_KWARGS_DEPTH} levels deep") as info:
            parse({**CHAT, "chat_template_kwargs": kwargs}, chat=True)
        assert info.value.field == "chat_template_kwargs"
