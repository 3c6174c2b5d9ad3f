import json
import math
import shutil

import pytest
import torch

from common.events import Done, InvalidRequest, Prefilled, SamplingParams, TextDelta, decode_tok_s
from inference.checkpoint import CheckpointError, checkpoint_shapes
from inference.engine import (
    Engine,
    LoadOutOfMemory,
    StopStrings,
    peak_bandwidth_gbs,
    rated_bandwidth_gbs,
    resolve_model,
)
from inference.synth import synth
from tests.support.chosen_ids import ChosenIds


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    return {name: synth(name, root / name, seed=0) for name in ("tiny-laneformer", "tiny-llama")}


@pytest.fixture(scope="module")
def engine(checkpoints):
    return Engine.load(checkpoints["tiny-laneformer"], device="cpu")


def run(engine, prompt_ids, **params):
    events = list(engine.generate(prompt_ids, SamplingParams(**params)))
    return events, events[-1]


def continuation(tokenizer, prompt_ids, new_ids):
    """The text new_ids add after the prompt (SentencePiece keeps the space a token starts with)."""
    return tokenizer.decode(prompt_ids + new_ids)[len(tokenizer.decode(prompt_ids)) :]


def greedy_by_recomputation(engine, prompt_ids, n):
    """The model's greedy continuation, each step a full forward without a cache."""
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(n):
            logits = engine.model(torch.tensor([ids]))[0, -1, : engine.tokenizer.vocab_size]
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids) :]


def test_event_sequence_and_text(engine):
    prompt = engine.encode_prompt("def fibonacci(n):")
    events, done = run(engine, prompt, max_new_tokens=24)
    assert isinstance(events[0], Prefilled) and events[0].prompt_tokens == len(prompt)
    assert isinstance(done, Done) and sum(isinstance(e, Done) for e in events) == 1
    deltas = [e for e in events if isinstance(e, TextDelta)]
    assert len(events) == len(deltas) + 2
    assert "".join(d.text for d in deltas) == done.text
    token_ids = [t for d in deltas for t in d.token_ids]
    assert done.finish_reason == "length" and len(token_ids) == done.stats.completion_tokens == 24
    assert token_ids == greedy_by_recomputation(engine, prompt, 24)
    assert done.text == continuation(engine.tokenizer, prompt, token_ids)


def test_timings_are_consistent(engine):
    events, done = run(engine, engine.encode_prompt("import os\n"), max_new_tokens=16)
    stats = done.stats
    times = stats.token_times
    assert len(times) == stats.completion_tokens == 16
    assert times == sorted(times) and [e.t for e in events if isinstance(e, TextDelta)] == times
    assert 0 < stats.prefill_ms <= stats.ttft_ms <= stats.total_ms
    assert math.isclose(stats.ttft_ms, times[0] * 1e3)
    assert stats.decode_tok_s == decode_tok_s(times) > 0
    assert events[0].prefill_ms == stats.prefill_ms
    assert stats.bytes_per_token == engine.bytes_per_token(stats.prompt_tokens + 16) > 0
    assert stats.peak_bandwidth_gbs is None  # on the CPU


def test_greedy_is_reproducible_and_seeded_sampling_too(engine):
    prompt = engine.encode_prompt("class Stack:")
    first = run(engine, prompt, max_new_tokens=12)[1]
    assert run(engine, prompt, max_new_tokens=12)[1].text == first.text
    sampled = [run(engine, prompt, max_new_tokens=12, temperature=1.0, seed=s)[1].text for s in (7, 7, 8)]
    assert sampled[0] == sampled[1] != sampled[2]


def test_eos_stops_without_text(tmp_path, checkpoints):
    path = shutil.copytree(checkpoints["tiny-laneformer"], tmp_path / "ckpt")
    plain = Engine.load(path, device="cpu")
    prompt = plain.encode_prompt("for i in range(10):")
    tokens = greedy_by_recomputation(plain, prompt, 12)
    eos = tokens[5]
    cut = tokens.index(eos)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    with_eos = Engine.load(path, device="cpu")
    events, done = run(with_eos, prompt, max_new_tokens=12)
    assert done.finish_reason == "stop" and done.stats.completion_tokens == cut + 1
    assert (done.ended_by, done.stop_reason) == ("eos", None)
    assert events[-2].token_ids == [eos] and events[-2].text == ""
    assert done.text == continuation(plain.tokenizer, prompt, tokens[:cut])


def test_ignore_eos_decodes_past_the_end_token_to_the_length_asked(tmp_path, checkpoints):
    path = shutil.copytree(checkpoints["tiny-laneformer"], tmp_path / "ckpt")
    plain = Engine.load(path, device="cpu")
    prompt = plain.encode_prompt("for i in range(10):")
    tokens = greedy_by_recomputation(plain, prompt, 12)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokens[5]]}))
    with_eos = Engine.load(path, device="cpu")
    assert run(with_eos, prompt, max_new_tokens=12)[1].finish_reason == "stop"
    events, done = run(with_eos, prompt, max_new_tokens=12, ignore_eos=True)
    assert done.finish_reason == "length" and done.stats.completion_tokens == 12
    assert (done.ended_by, done.stop_reason) == ("length", None)
    assert [t for e in events if isinstance(e, TextDelta) for t in e.token_ids] == tokens
    assert done.text == continuation(plain.tokenizer, prompt, tokens)


def test_a_requests_stop_token_ends_the_reply_with_its_text(engine):
    prompt = engine.encode_prompt("for i in range(10):")
    tokens = greedy_by_recomputation(engine, prompt, 12)
    cut = tokens.index(tokens[6])  # its first occurrence
    done = run(engine, prompt, max_new_tokens=12, stop_token_ids=(tokens[6],))[1]
    assert done.finish_reason == "stop" and done.stats.completion_tokens == cut + 1
    assert (done.ended_by, done.stop_reason) == ("stop_token", tokens[6])  # vLLM's stop_reason: the token
    assert done.text == continuation(engine.tokenizer, prompt, tokens[: cut + 1])
    with pytest.raises(InvalidRequest, match="stop_token_ids"):
        run(engine, prompt, stop_token_ids=(engine.config.vocab_size,))


def test_the_tokenizers_eos_token_stops_too(tmp_path, checkpoints, monkeypatch):
    # generation_config.json names other end ids; the tokenizer's eos_token (</s>) still ends the generation,
    # as in vLLM, and its text is never shown
    path = shutil.copytree(checkpoints["tiny-laneformer"], tmp_path / "ckpt")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5]}))
    engine = Engine.load(path, device="cpu")
    tok = engine.tokenizer
    eos = tok._tok.token_to_id("</s>")
    assert tok.eos_ids == {5} and tok.stop_ids == {5, eos}
    prompt = engine.encode_prompt("x = ")
    words = tok.encode("1 + 2", add_special=False)
    for end in (eos, 5):
        monkeypatch.setattr(engine, "runner", ChosenIds([*words, end, *words]))
        events, done = run(engine, prompt, max_new_tokens=20)
        assert done.finish_reason == "stop" and done.stats.completion_tokens == len(words) + 1
        assert done.text == continuation(tok, prompt, words) == " 1 + 2"


def test_stop_strings_cut_before_the_match_and_never_leak(engine):
    prompt = engine.encode_prompt("def main():")
    full = run(engine, prompt, max_new_tokens=40)[1].text
    assert len(full) > 30
    start = len(full) // 2
    stop = full[start : start + 5]
    expected = full[: full.find(stop)]
    events, done = run(engine, prompt, max_new_tokens=40, stop=("never appears \x00", stop))
    assert done.finish_reason == "stop" and done.text == expected
    assert (done.ended_by, done.stop_reason) == ("stop_string", stop)  # the one of the two that matched
    streamed = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert streamed == expected  # nothing of the stop string was ever shown


def test_include_stop_str_in_output_ends_the_text_after_the_match(engine):
    prompt = engine.encode_prompt("def main():")
    full = run(engine, prompt, max_new_tokens=40)[1].text
    stop = full[len(full) // 2 : len(full) // 2 + 5]
    expected = full[: full.find(stop) + len(stop)]
    events, done = run(engine, prompt, max_new_tokens=40, stop=(stop,), include_stop_str_in_output=True)
    assert done.finish_reason == "stop" and done.text == expected
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == expected


def test_text_held_back_for_a_stop_string_is_released_at_the_end(engine):
    prompt = engine.encode_prompt("def main():")
    full = run(engine, prompt, max_new_tokens=20)[1].text
    events, done = run(engine, prompt, max_new_tokens=20, stop=(full[-2:] + "\x00",))
    assert done.finish_reason == "length" and done.text == full
    assert (done.ended_by, done.stop_reason) == ("length", None)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == full


def test_stop_string_matcher():
    stops = StopStrings(("</end>", "##"))
    assert stops.push("hello <") == ("hello ", False)
    assert stops.push("/en") == ("", False)
    assert stops.push("d>") == ("", True)
    stops = StopStrings(("abc",))
    assert stops.push("xab") == ("x", False)
    assert stops.push("d") == ("abd", False)
    assert stops.push("zzabcabc") == ("zz", True)
    assert StopStrings(()).push("anything") == ("anything", False)
    # kept: the first match, the longest of those starting there
    stops = StopStrings(("b", "bcd", "bc"), included=True)
    assert stops.push("abcde") == ("abcd", True)


def test_cancellation_between_tokens(engine):
    count = 0

    def should_stop():
        nonlocal count
        count += 1
        return count >= 5

    events = list(
        engine.generate(engine.encode_prompt("x = "), SamplingParams(max_new_tokens=50), should_stop)
    )
    done = events[-1]
    assert done.finish_reason == "cancelled" and done.stats.completion_tokens == 5
    assert done.text == "".join(e.text for e in events if isinstance(e, TextDelta))


def test_abandoned_generation_leaves_the_engine_usable(engine):
    prompt = engine.encode_prompt("while True:")
    expected = run(engine, prompt, max_new_tokens=10)[1].text
    stream = engine.generate(
        engine.encode_prompt("something else entirely"), SamplingParams(max_new_tokens=30)
    )
    for _, _ in zip(range(4), stream, strict=False):
        pass
    stream.close()
    assert run(engine, prompt, max_new_tokens=10)[1].text == expected


def test_context_limits(checkpoints):
    small = Engine.load(checkpoints["tiny-laneformer"], device="cpu", max_context=32)
    assert small.max_context == 32
    prompt = list(range(3, 23))  # 20 tokens
    events, done = run(small, prompt, max_new_tokens=100)
    assert done.finish_reason == "length" and done.stats.completion_tokens == 12  # clipped to the context
    with pytest.raises(InvalidRequest) as info:
        next(small.generate(list(range(3, 35)), SamplingParams()))
    assert info.value.field == "prompt" and "32-token context" in str(info.value)
    assert "this server's cap; the model takes 1024" in str(info.value)  # not the model's own limit
    with pytest.raises(InvalidRequest, match="prompt"):
        small.encode_prompt("a long line of text " * 40)


def test_encode_prompt(engine):
    tok = engine.tokenizer
    raw = engine.encode_prompt("print(1)")
    assert raw[0] == tok.bos_id and tok.decode(raw) == "print(1)"
    chat = engine.encode_prompt("print(1)", chat=True)
    assert chat != raw and "[INST]" in tok.decode(chat) and chat.count(tok.bos_id) == 1
    messages = [{"role": "user", "content": "print(1)"}]
    assert engine.encode_prompt(messages=messages) == chat
    # "<s>" and "</s>" in what a person writes are characters: no second BOS, no EOS that ends the prompt
    for prompt in ('s = "</s><s>"', "</s>"):
        for ids in (engine.encode_prompt(prompt), engine.encode_prompt(prompt, chat=True)):
            assert ids.count(tok.bos_id) == 1 and not set(ids) & set(tok.eos_ids)
            assert prompt in tok.decode(ids)
    for kwargs, field in (({"prompt": ""}, "prompt"), ({}, "prompt"), ({"messages": []}, "messages")):
        with pytest.raises(InvalidRequest) as info:
            engine.encode_prompt(**kwargs)
        assert info.value.field == field
    with pytest.raises(InvalidRequest, match="prompt"):
        next(engine.generate([10**6], SamplingParams()))


def test_bytes_per_token_counts_weights_once_and_the_kv_cache(checkpoints):
    llama = Engine.load(checkpoints["tiny-llama"], device="cpu")
    cfg = llama.config
    assert cfg.tie_word_embeddings  # the head reads the whole embedding: counted once, in full
    weights = sum(math.prod(s) for s in checkpoint_shapes(cfg).values()) * 4
    kv_per_position = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    assert llama.bytes_per_token(0) == weights
    assert llama.bytes_per_token(100) == weights + 100 * kv_per_position


def test_bfloat16_on_cpu(checkpoints):
    half = Engine.load(checkpoints["tiny-llama"], device="cpu", dtype="bfloat16")
    assert half.dtype == torch.bfloat16
    done = run(half, half.encode_prompt("hello"), max_new_tokens=8)[1]
    assert done.stats.completion_tokens == 8


def test_presets_are_synthesised_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KOG_CACHE_DIR", str(tmp_path))
    path = resolve_model("tiny-qwen3")
    assert path == tmp_path / "kog-playground" / "synth" / "tiny-qwen3-0"
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("tiny-qwen3") == path and (path / "model.safetensors").stat().st_mtime_ns == stamp
    loaded = Engine.load("tiny-qwen3", device="cpu")
    assert loaded.name == "tiny-qwen3" and loaded.path == path
    with pytest.raises(CheckpointError, match="neither a checkpoint directory nor a preset"):
        resolve_model("no-such-model")
    with pytest.raises(CheckpointError, match="a file; give the checkpoint's folder"):
        resolve_model(path / "config.json")  # the folder's file, not the folder


def test_bad_device_dtype_and_backend(checkpoints, monkeypatch):
    path = checkpoints["tiny-llama"]
    with pytest.raises(ValueError, match="dtype"):
        Engine.load(path, device="cpu", dtype="int8")
    with pytest.raises(ValueError, match="device"):
        Engine.load(path, device="tpu")
    monkeypatch.setenv("KOG_BACKEND", "turbo")
    with pytest.raises(ValueError, match="KOG_BACKEND"):
        Engine.load(path, device="cpu")


@pytest.mark.parametrize("value", ["0", "1", "-5", "8k", "2.5", "1e4"])
def test_kog_max_context_is_checked_as_the_argument_is(checkpoints, monkeypatch, value):
    # 0 and 1 used to start an engine that refused every prompt, -5 died in torch.zeros, 8k in int()
    monkeypatch.setenv("KOG_MAX_CONTEXT", value)
    with pytest.raises(ValueError) as info:
        Engine.load(checkpoints["tiny-llama"], device="cpu")
    assert str(info.value) == (
        f"KOG_MAX_CONTEXT: must be an integer >= 2 (tokens: a prompt token and a new one at least), got {value!r}"
    )


def test_kog_max_context_caps_the_context_and_the_argument_wins(checkpoints, monkeypatch):
    monkeypatch.setenv("KOG_MAX_CONTEXT", " 48 ")
    assert Engine.load(checkpoints["tiny-llama"], device="cpu").max_context == 48
    assert Engine.load(checkpoints["tiny-llama"], device="cpu", max_context=40).max_context == 40
    monkeypatch.setenv("KOG_MAX_CONTEXT", "100000")  # past the model's own: the model's
    assert Engine.load(checkpoints["tiny-llama"], device="cpu").max_context == 1024


@pytest.mark.parametrize(
    "variable, value, expects",
    [
        ("KOG_CPU_THREADS", "many", "an integer >= 1 (CPU threads)"),
        ("KOG_CPU_THREADS", "0", "an integer >= 1 (CPU threads)"),
        ("KOG_PEAK_BANDWIDTH_GBS", "4.8TB/s", "a number of GB/s > 0"),
    ],
)
def test_the_engines_other_settings_name_their_variable(checkpoints, monkeypatch, variable, value, expects):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError) as info:
        Engine.load(checkpoints["tiny-llama"], device="cpu")
    assert str(info.value) == f"{variable}: must be {expects}, got {value!r}"


def test_prompt_logprobs_score_each_prompt_token_given_the_ones_before_it(checkpoints):
    engine = Engine.load(checkpoints["tiny-llama"], device="cpu")
    ids = engine.encode_prompt("def mean(xs):\n    return sum(xs) / len(xs)\n")
    assert ids[0] in engine.tokenizer.special_ids  # a BOS the tokenizer added, which the text does not hold
    events = list(engine.generate(ids, SamplingParams(max_new_tokens=2, prompt_logprobs=3)))
    entries = events[0].prompt_logprobs
    assert isinstance(events[0], Prefilled) and [e["id"] for e in entries] == ids
    assert entries[0]["logprob"] is None and entries[0]["top"] == [] and entries[0]["special"] is True
    assert not any(e.get("special") for e in entries[1:])
    with torch.inference_mode():
        logits = engine.model(torch.tensor([ids]))[0, :-1, : engine.tokenizer.max_id + 1]
    reference = logits.float().log_softmax(-1)  # row r: what follows ids[r]
    for i in range(1, len(ids)):
        assert entries[i]["logprob"] == pytest.approx(float(reference[i - 1, ids[i]]), abs=1e-4)
        expected = reference[i - 1].topk(3)
        assert [t["id"] for t in entries[i]["top"]] == expected.indices.tolist()
        assert [t["logprob"] for t in entries[i]["top"]] == pytest.approx(expected.values.tolist(), abs=1e-4)
    # the reply's own logprobs were not asked for
    assert all(isinstance(e, TextDelta) and e.logprobs is None for e in events[1:-1])


def test_a_prompt_longer_than_a_block_of_rows_is_scored_whole(checkpoints):
    from inference.logprobs import prompt_logprobs

    engine = Engine.load(checkpoints["tiny-llama"], device="cpu")
    ids = engine.encode_prompt("x = [" + ", ".join(str(i) for i in range(60)) + "]\n")
    vocab = engine.tokenizer.max_id + 1
    whole = prompt_logprobs(engine.model, ids, 2, vocab)
    blocks = prompt_logprobs(engine.model, ids, 2, vocab, rows=7)  # uneven blocks through the KV cache
    assert len(whole) == len(blocks) == len(ids) - 1
    for (a, top_a), (b, top_b) in zip(whole, blocks, strict=True):
        assert a == pytest.approx(b, abs=1e-4)
        assert [i for i, _ in top_a] == [i for i, _ in top_b]


@pytest.mark.parametrize(
    "clock_khz, bus_bits, datasheet_gbs",
    [(2_619_000, 5120, 3350), (1_215_000, 5120, 1555), (1_593_000, 5120, 2039)],
    ids=["H100-SXM", "A100-40GB", "A100-80GB"],
)
def test_a_gpus_rated_bandwidth_is_its_datasheets(clock_khz, bus_bits, datasheet_gbs):
    assert rated_bandwidth_gbs(clock_khz, bus_bits) == pytest.approx(datasheet_gbs, rel=0.002)


def test_a_driver_without_memory_figures_gives_no_rated_bandwidth():
    assert rated_bandwidth_gbs(0, 5120) is None and rated_bandwidth_gbs(2_619_000, 0) is None


def test_the_cpu_shows_no_bandwidth_even_with_a_peak_set(checkpoints, monkeypatch):
    monkeypatch.setenv("KOG_PEAK_BANDWIDTH_GBS", "4800")
    engine = Engine.load(checkpoints["tiny-llama"], device="cpu")
    assert peak_bandwidth_gbs(torch.device("cpu")) is None and engine.peak_bandwidth_gbs is None


def test_a_model_the_memory_cannot_hold_is_one_line_saying_what_did_not_fit(tmp_path, checkpoints):
    # RoPE tables for 2**48 positions: a petabyte, which no machine's address space holds (whatever its
    # overcommit), so the allocator refuses it at once, as a real one refuses an oversized model.
    path = shutil.copytree(checkpoints["tiny-llama"], tmp_path / "huge-context")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2**48}))
    with pytest.raises(LoadOutOfMemory) as info:
        Engine.load(path, device="cpu")
    message = str(info.value)
    assert message.startswith(
        "huge-context: out of cpu memory while building its RoPE tables for "
        f"max_position_embeddings={2**48} positions: check max_position_embeddings in its config.json ("
    )
    assert "can't allocate memory" in message and "\n" not in message


def test_a_checkpoints_recommended_sampling_is_read_and_a_bad_value_left_out(tmp_path, caplog):
    from inference.engine import sampling_defaults

    assert sampling_defaults(None) == {} and sampling_defaults(tmp_path) == {}  # no generation_config.json
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "do_sample": True,
                "temperature": 0.7,
                "top_p": 0,
                "top_k": 20,
                "max_new_tokens": 9,
                "max_length": 50,
            }
        )  # fmt: skip
    )
    with caplog.at_level("WARNING", logger="inference.engine"):  # the sampling keys and max_new_tokens only
        assert sampling_defaults(tmp_path) == {"temperature": 0.7, "top_k": 20, "max_new_tokens": 9}
    assert "generation_config.json's top_p left out: must be in (0, 1], got 0" in caplog.text
    (tmp_path / "generation_config.json").write_text(json.dumps({"max_new_tokens": 0}))
    with caplog.at_level("WARNING", logger="inference.engine"):
        assert sampling_defaults(tmp_path) == {}
    assert "generation_config.json's max_new_tokens left out" in caplog.text
    model = synth("tiny-llama", tmp_path / "ft", seed=0)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95}))
    assert Engine.load(str(model), device="cpu").sampling_defaults == {"temperature": 0.6, "top_p": 0.95}
