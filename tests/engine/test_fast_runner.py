"""The fast runner against the reference model, on the tiny presets (kernels under the interpreter on CPU)."""

import itertools

import pytest
import torch

import inference.fast.settings as fast_settings
from common.events import SamplingParams
from inference.bench.placement import MOVABLE, move
from inference.config import ModelConfig
from inference.fast.head_choice import MIN_STEPS
from inference.fast.residual_placement import CANDIDATE_STRIDE, residual_pool
from inference.fast.runner import RING, FastRunner, reduction
from inference.fast.settings import block_spec, prefetch_overrides
from inference.model import KVCache, Transformer
from inference.presets import preset_config
from inference.sampling import Sampler
from tests.support.kernels import DEVICE, ON_GPU

DTYPE = torch.bfloat16 if ON_GPU else torch.float32
LOGIT_TOL = 2e-2 if ON_GPU else 1e-4  # relative error of the logits per step


def make_model(preset: str, seed: int = 0, **overrides) -> Transformer:
    cfg = ModelConfig.from_hf({**preset_config(preset), **overrides})
    model = Transformer(cfg, device=DEVICE, dtype=DTYPE)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    model.init_weights(std=0.05, generator=gen)
    with torch.no_grad():  # norms and biases away from 1 and 0, so that the kernels must apply them
        for name, p in model.named_parameters():
            if "norm" in name or name.rsplit(".", 1)[-1] in ("bq", "bk", "bv"):
                p.add_(
                    torch.randn(p.shape, generator=gen, device=DEVICE, dtype=torch.float32).to(p.dtype) * 0.2
                )
    return model.eval()


# Exact token equality with the reference holds in fp32; in bf16 near-ties may flip (the per-step logit
# comparison above covers the GPU).
fp32_only = pytest.mark.skipif(ON_GPU, reason="exact token equality is an fp32 property")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@torch.no_grad()
def teacher_forced(
    model: Transformer, prompt: list[int], steps: int, max_context: int = 128, **runner_kwargs
):
    """Feed the reference's own greedy tokens to both paths; yield (fast logits, reference logits, fast token).
    The greedy steps' logits come from the whole head (the head screen computes the token alone)."""
    runner = FastRunner(model, max_context, **{"head_screen": False, **runner_kwargs})
    ref_cache = KVCache(model.cfg, max_context, 1, DEVICE, DTYPE)
    ids = torch.tensor([prompt], device=DEVICE)
    ref_logits = model(ids, 0, ref_cache, last_only=True).view(-1)
    runner.prefill(prompt)
    assert int(runner.token) == int(ref_logits.argmax())
    pos = len(prompt)
    for _ in range(steps):
        token = int(ref_logits.argmax())
        runner.token.fill_(token)
        runner.step()
        ref_logits = model(torch.tensor([[token]], device=DEVICE), pos, ref_cache).view(-1)
        pos += 1
        assert int(runner.pos) == pos
        yield runner.logits.clone(), ref_logits, int(runner.token)


@pytest.mark.parametrize("preset", ["tiny-laneformer", "tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_decode_steps_match_the_reference(preset):
    model = make_model(preset)
    prompt = torch.randint(0, model.cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    for fast, ref, token in teacher_forced(model, prompt, steps=4):
        assert rel_err(fast, ref) < LOGIT_TOL
        assert token == int(fast.argmax())


@pytest.mark.parametrize(
    "preset,overrides",
    [("tiny-llama", {}), ("tiny-qwen2", {}), ("tiny-qwen3", {}), ("tiny-laneformer", {"sliding_window": 8}),
     ("tiny-laneformer", {"broadcast_delay": 1, "use_early_comm": False})],
)  # fmt: skip
@pytest.mark.parametrize("length", [1, 13, 70])  # one token; a graph bucket's padding on the GPU; past it
def test_prefill_logits_match_the_reference(preset, overrides, length):
    # the prefill's last layer runs only the last row past its cache write (prefill._last_layer)
    model = make_model(preset, seed=6, **overrides)
    prompt = torch.randint(
        0, model.cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(2)
    ).tolist()
    runner = FastRunner(model, 128)
    runner.prefill(prompt)
    with torch.no_grad():
        cache = KVCache(model.cfg, 128, 1, DEVICE, DTYPE)
        want = model(torch.tensor([prompt], device=DEVICE), 0, cache, last_only=True).view(-1)
    assert rel_err(runner.logits, want) < LOGIT_TOL
    # and the cache the decode steps read: every layer's keys and values of the prompt
    for got, ref in ((runner.cache.k, cache.k), (runner.cache.v, cache.v)):
        assert rel_err(got[:, :, :, :length], ref[:, :, :, :length]) < LOGIT_TOL


SCALED_ROPE = [
    ("tiny-llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    # yarn's attention factor multiplies the cos/sin tables the kernels read: scores scale by its square
    ("tiny-qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                     "mscale": 1.0, "mscale_all_dim": 0.5}}),
]  # fmt: skip


@pytest.mark.parametrize("preset,overrides", SCALED_ROPE)
def test_scaled_rope_of_an_own_fine_tune_runs_on_the_fast_path(preset, overrides):
    """The fast path takes any scaling the config allows through the model's cos/sin tables."""
    model = make_model(preset, seed=3, **overrides)
    plain = make_model(preset, seed=3)
    assert not torch.allclose(model.rope_cos, plain.rope_cos)  # the scaling is in the tables the kernels read
    prompt = torch.randint(
        0, model.cfg.vocab_size, (13,), generator=torch.Generator().manual_seed(4)
    ).tolist()
    for fast, ref, token in teacher_forced(model, prompt, steps=4):  # the prefill, then decode steps
        assert rel_err(fast, ref) < LOGIT_TOL
        assert token == int(fast.argmax())


def test_laneformer_reductions_and_windows():
    # past the window of the windowed layers, and every reduction mode: early sum, delayed, scaled
    for overrides in ({"sliding_window": 8}, {"use_comm": False, "use_early_comm": False, "sliding_window": 8},
                      {"broadcast_delay": 1, "pre_norm_lane_agg": True}):  # fmt: skip
        model = make_model("tiny-laneformer", seed=3, **overrides)
        modes = {reduction(model.cfg, i)[0] for i in range(model.cfg.num_layers)}
        assert modes <= {"sum", "delayed", "scaled"}
        prompt = list(range(5, 17))
        for fast, ref, _ in teacher_forced(model, prompt, steps=2):
            assert rel_err(fast, ref) < LOGIT_TOL, overrides


@pytest.mark.parametrize(
    "overrides,lane_groups",
    [({}, {"groups": 2}), ({}, {"groups": 4}), ({"sliding_window": 8, "broadcast_delay": 1}, {"groups": 2}),
     ({"use_comm": False, "use_early_comm": False}, {"groups": 2})],
)  # fmt: skip
def test_lane_groups_match_the_reference(overrides, lane_groups):
    # groups of lanes as their own chains of launches (streams on a GPU) from the first delayed layer on;
    # without communication every layer is split, layer 0's embedding row included
    model = make_model("tiny-laneformer", seed=3, **overrides)
    runner = FastRunner(model, 64, lane_groups=lane_groups)
    first_split = 0 if overrides.get("use_comm") is False else model.cfg.broadcast_delay
    assert runner.split_from == first_split
    assert [(g.start, g.stop) for g in runner.groups] == [
        (s, s + 4 // lane_groups["groups"]) for s in range(0, 4, 4 // lane_groups["groups"])
    ]
    for fast, ref, _ in teacher_forced(model, list(range(5, 17)), steps=3, lane_groups=lane_groups):
        assert rel_err(fast, ref) < LOGIT_TOL


@fp32_only
def test_lane_groups_generate_the_same_tokens():
    model = make_model("tiny-laneformer", seed=11, sliding_window=8)
    prompt, params = [4, 8, 15, 16, 23, 42], SamplingParams(max_new_tokens=12)
    whole = list(FastRunner(model, 64).generate_tokens(prompt, params))
    grouped = list(FastRunner(model, 64, lane_groups={"groups": 2}).generate_tokens(prompt, params))
    assert grouped == whole


@pytest.mark.parametrize("preset", ["tiny-laneformer", "tiny-llama", "tiny-qwen3"])
def test_the_head_screen_generates_the_whole_heads_tokens(preset):
    # greedy tokens through the int8 screen and the candidates' rows (kernels/lm_head_screen.py) against the
    # whole head's argmax, step after step; and a sampled request on the same runner still reads the logits
    model = make_model(preset, seed=12)
    prompt, params = [3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_new_tokens=10)
    whole = FastRunner(model, 64, head_screen=False)
    screened = FastRunner(model, 64, head_screen=True)
    assert whole.head_screen is None and screened.head_screen is not None
    assert list(screened.generate_tokens(prompt, params)) == list(whole.generate_tokens(prompt, params))
    sampled = SamplingParams(max_new_tokens=6, temperature=0.7, top_p=0.9, seed=3)
    assert not screened.uses_screen(sampled)  # above sampled_screen_temperature: the whole head
    assert list(screened.generate_tokens(prompt, sampled)) == list(whole.generate_tokens(prompt, sampled))
    # the page's settings, and a penalty: the sampler draws from the screened logits, the same tokens
    for sampled in (SamplingParams(max_new_tokens=8, temperature=0.2, top_p=0.95, seed=4),
                    SamplingParams(max_new_tokens=8, temperature=0.1, repetition_penalty=1.3, seed=5)):  # fmt: skip
        assert screened.uses_screen(sampled)
        assert list(screened.generate_tokens(prompt, sampled)) == list(whole.generate_tokens(prompt, sampled))


def test_the_head_screen_is_on_by_default_on_a_gpu_and_set_by_the_environment(monkeypatch):
    model = make_model("tiny-llama")
    assert FastRunner(model, 32).head_screen is None  # a head under SCREEN_MIN_HEAD_BYTES
    monkeypatch.setattr(fast_settings, "SCREEN_MIN_HEAD_BYTES", 0)
    assert (FastRunner(model, 32).head_screen is not None) == ON_GPU
    monkeypatch.setenv("KOG_HEAD_SCREEN", "1")
    assert FastRunner(model, 32).head_screen is not None
    assert FastRunner(model, 32, head_screen=False).head_screen is None  # the argument wins
    monkeypatch.setenv("KOG_HEAD_SCREEN", "yes")
    with pytest.raises(ValueError, match="KOG_HEAD_SCREEN"):
        FastRunner(model, 32)


def test_sampled_steps_take_the_screen_up_to_a_temperature(monkeypatch):
    model = make_model("tiny-llama")
    runner = FastRunner(model, 32, head_screen=True)
    cool, warm = SamplingParams(temperature=0.3), SamplingParams(temperature=0.31)
    assert runner.uses_screen(SamplingParams()) and runner.uses_screen(cool) and not runner.uses_screen(warm)
    assert not FastRunner(model, 32, head_screen=False).uses_screen(SamplingParams())
    monkeypatch.setenv("KOG_HEAD_SCREEN_SAMPLED", "-1")  # never for sampled steps
    runner = FastRunner(model, 32, head_screen=True)
    assert runner.uses_screen(SamplingParams()) and not runner.uses_screen(SamplingParams(temperature=0.01))
    monkeypatch.setenv("KOG_HEAD_SCREEN_SAMPLED", "warm")
    with pytest.raises(ValueError, match="KOG_HEAD_SCREEN_SAMPLED"):
        FastRunner(model, 32, head_screen=True)
    monkeypatch.delenv("KOG_HEAD_SCREEN_SAMPLED")
    with pytest.raises(ValueError, match="built without the head screen"):
        FastRunner(model, 32, head_screen=False).decode_step(greedy=False, screen=True)


def test_a_sampled_request_on_flat_logits_leaves_the_screen(monkeypatch):
    # random weights: every row lies within reach of the page's draw, so a screened step reads the head twice over;
    # the request leaves the screen once MIN_STEPS steps have said so and draws on from the whole head: the same
    # tokens as a runner without the screen, throughout
    model = make_model("tiny-qwen3", seed=13)
    prompt, params = (
        [2, 7, 1, 8, 2, 8],
        SamplingParams(max_new_tokens=10, temperature=0.2, top_p=0.95, seed=6),
    )
    whole = list(FastRunner(model, 64, head_screen=False).generate_tokens(prompt, params))
    runner = FastRunner(model, 64, head_screen=True)
    assert list(runner.generate_tokens(prompt, params)) == whole
    assert runner.screen_left_at == len(prompt) + MIN_STEPS
    assert runner._candidates(len(prompt) + 1) == model.cfg.vocab_size
    list(runner.generate_tokens(prompt, SamplingParams(max_new_tokens=3)))
    assert runner.screen_left_at is None, "a greedy request reads no counts"
    monkeypatch.setenv("KOG_HEAD_SCREEN_LEAVE", "1")  # never leave
    runner = FastRunner(model, 64, head_screen=True)
    assert list(runner.generate_tokens(prompt, params)) == whole
    assert runner.screen_left_at is None
    for bad in ("most", "1.5"):
        monkeypatch.setenv("KOG_HEAD_SCREEN_LEAVE", bad)
        with pytest.raises(ValueError, match="KOG_HEAD_SCREEN_LEAVE"):
            FastRunner(model, 64, head_screen=True)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs")
def test_a_built_runner_holds_every_graph_a_request_replays():
    # no request waits on a compile or a capture, not even one that leaves the screen mid-way
    model = make_model("tiny-qwen3", seed=13)
    runner = FastRunner(model, 64, head_screen=True)
    built = set(runner.graphs)
    assert built == {(True, True, 1), (False, False, 1), (False, True, 1)}
    list(runner.generate_tokens([1, 2, 3], SamplingParams(max_new_tokens=14, temperature=0.2, seed=1)))
    assert runner.screen_left_at is not None  # flat logits: it went on with the whole head's graph
    for params in (SamplingParams(max_new_tokens=4, temperature=0.9, seed=2), SamplingParams(max_new_tokens=4),
                   SamplingParams(max_new_tokens=4, repetition_penalty=1.2)):  # fmt: skip
        list(runner.generate_tokens([1, 2, 3], params))
    assert set(runner.graphs) == built


def test_lane_groups_are_the_default_on_a_gpu_for_large_layers():
    # two streams pay only where they run at once (not under the interpreter) and where a layer's kernels stream
    # long enough (not launch-bound): ~54 MB a layer in bf16 here
    big = make_model("tiny-laneformer", hidden_size=1024, intermediate_size=8192)
    assert [(g.start, g.stop) for g in FastRunner(big, 32).groups] == ([(0, 2), (2, 4)] if ON_GPU else [])
    assert FastRunner(big, 32, lane_groups={"groups": 1}).groups == []
    assert FastRunner(make_model("tiny-laneformer"), 32).groups == []  # ~0.2 MB a layer
    assert FastRunner(make_model("tiny-llama"), 32).groups == []  # one lane


def test_lane_groups_reject_what_they_cannot_split():
    with pytest.raises(ValueError, match="do not divide the model's 4 lanes"):
        FastRunner(make_model("tiny-laneformer"), 32, lane_groups={"groups": 3})
    with pytest.raises(ValueError, match="do not divide the model's 1 lanes"):
        FastRunner(make_model("tiny-llama"), 32, lane_groups={"groups": 2})
    with pytest.raises(ValueError, match="nothing to split"):  # d = 0: every layer sums at once
        FastRunner(make_model("tiny-laneformer", broadcast_delay=0), 32, lane_groups={"groups": 2})
    with pytest.raises(ValueError, match="lane_groups"):
        FastRunner(make_model("tiny-laneformer"), 32, lane_groups={"streams": 2})


@pytest.mark.parametrize("preset", ["tiny-laneformer", "tiny-qwen3"])
def test_weights_loaded_before_the_wait_change_nothing(preset):
    # every matrix-vector kind with all of its weight tiles in flight before it waits on the previous kernel
    model = make_model(preset, seed=4)
    deep = {kind: 64 for kind in ("qkv", "o", "gate_up", "down")}
    for fast, ref, _ in teacher_forced(model, list(range(3, 14)), steps=3, prefetch=deep):
        assert rel_err(fast, ref) < LOGIT_TOL


def test_one_lane_models_trigger_qkv_and_o_early_by_default(monkeypatch):
    llama = FastRunner(make_model("tiny-llama"), 32)
    assert llama.early == {"qkv", "o"} and llama.prefetch["gate_up"] == 3
    lanes = FastRunner(make_model("tiny-laneformer"), 32)
    assert lanes.early == set() and lanes.prefetch["gate_up"] == 1
    assert FastRunner(make_model("tiny-llama"), 32, early={"o": 0, "down": 1}).early == {"qkv", "down"}
    monkeypatch.setenv("KOG_EARLY", "qkv=0")
    assert FastRunner(make_model("tiny-llama"), 32).early == {"o"}
    monkeypatch.delenv("KOG_EARLY")
    with pytest.raises(ValueError, match="early"):
        FastRunner(make_model("tiny-llama"), 32, early={"head": 1})
    with pytest.raises(ValueError, match="early"):
        FastRunner(make_model("tiny-llama"), 32, early={"o": 2})


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3", "tiny-laneformer"])
def test_every_kind_triggering_early_matches_the_reference(preset):
    model = make_model(preset, seed=8)
    every = {kind: 1 for kind in ("qkv", "o", "gate_up", "down")}
    for fast, ref, _ in teacher_forced(model, list(range(2, 12)), steps=3, early=every):
        assert rel_err(fast, ref) < LOGIT_TOL


def bf16_valued(model: Transformer) -> Transformer:
    """The packed layout holds bf16 numbers: an fp32 model's weights rounded to them (a bf16 model's already are)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))
    return model


# intermediate_size 192: the down-proj's K in whole 64-column chunks (the presets' 160 is not: that one stays bf16)
PACKED = {"packed": True, "packed_blocks": {"down": {"split": 3}, "o": {"ahead": 1}}}
# every kind: layer 1's gate/up too (its sums cleared by the o-proj, read by the down-proj through the SiLU;
# D = 64: one chunk), its programs taking 2 items (qwen3-1.7b's blocks: settings.PACKED_SHAPE_DEFAULTS)
ALL_PACKED = {**PACKED, "packed": "o+gate_up+down", "packed_blocks": {**PACKED["packed_blocks"],
                                                                       "gate_up": {"ahead": 1, "items": 2}}}  # fmt: skip
# the gate/up of every layer as whole-K programs over interleaved rows, SiLU in the launch (kernels/packed_mma_glu.py)
GLU_PACKED = {
    **PACKED,
    "packed": "o+glu+down",
    "packed_blocks": {**PACKED["packed_blocks"], "glu": {"ahead": 2, "before": 1}},
}


# the q|k|v of layer 1 too, into sums the attention scales by the norm's scalar (qwen2's, with biases, stays bf16)
QKV_PACKED = {**ALL_PACKED, "packed": "qkv+o+gate_up+down",
              "packed_blocks": {**ALL_PACKED["packed_blocks"], "qkv": {"split": 1, "ahead": 1}}}  # fmt: skip


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
@pytest.mark.parametrize(
    "settings",
    [PACKED, ALL_PACKED, GLU_PACKED, QKV_PACKED],
    ids=["o+down", "o+gate_up+down", "o+glu+down", "qkv+o+gate_up+down"],
)
def test_packed_projections_match_the_reference(preset, settings):
    model = bf16_valued(make_model(preset, seed=9, intermediate_size=192))
    for fast, ref, token in teacher_forced(model, list(range(4, 15)), steps=3, **settings):
        assert rel_err(fast, ref) < LOGIT_TOL
        assert token == int(fast.argmax())


def test_which_projections_are_packed():
    """Layer 0's o-proj starts the residual from the embedding row (lane_reduce_gemv), so its gate/up stays bf16
    too (the packed o-proj clears a packed gate/up's sums); a K of no whole chunks stays bf16."""
    model = bf16_valued(make_model("tiny-qwen3", seed=9, intermediate_size=192))

    def packed(runner: FastRunner) -> list[tuple[bool, bool, bool]]:  # (o-proj, gate/up, down-proj) by layer
        return [
            (w.wo_packed is not None, w.w13_packed is not None, w.w2_packed is not None)
            for w in runner.layers
        ]

    def packed_qkv(runner: FastRunner) -> list[bool]:
        return [w.wqkv_packed is not None for w in runner.layers]

    assert packed(FastRunner(model, 32, packed=True)) == [(False, False, True), (True, False, True)]
    assert packed(FastRunner(model, 32, packed="o+gate_up+down")) == [
        (False, False, True),
        (True, True, True),
    ]
    assert packed(FastRunner(model, 32, packed="glu")) == [(False, True, False), (False, True, False)]
    assert packed(FastRunner(model, 32, packed="down")) == [(False, False, True), (False, False, True)]
    narrow = bf16_valued(make_model("tiny-qwen3", seed=9))  # intermediate_size 160: no packed down-proj
    assert packed(FastRunner(narrow, 32, packed="o+gate_up+down")) == [
        (False, False, False),
        (True, False, False),
    ]
    assert packed(FastRunner(model, 32, packed=False)) == [(False, False, False)] * 2
    # the q|k|v of layers whose o-proj clears its sums (layer 0's reads the embedding row); none with biases
    assert packed_qkv(FastRunner(model, 32, packed="qkv+o+down")) == [False, True]
    assert packed_qkv(FastRunner(model, 32, packed="o+down")) == [False, False]
    qwen2 = bf16_valued(make_model("tiny-qwen2", seed=9, intermediate_size=192))
    assert packed_qkv(FastRunner(qwen2, 32, packed="qkv+o+down")) == [False, False]


def test_a_runner_of_parameters_holds_no_autograd_graph():
    """The model's weights require gradients here (make_model's Parameters): what the runner builds from them (the
    q|k|v, the packed words, the head screen) must hold none, or each keeps its temporaries alive."""
    model = bf16_valued(make_model("tiny-qwen3", seed=9, intermediate_size=192))
    assert model.layers[0].wq.requires_grad
    runner = FastRunner(model, 32, packed="o+gate_up+down", head_screen=True)
    built = [w.wqkv for w in runner.layers] + list(vars(runner.head_screen).values())
    built += [t for w in runner.layers for p in (w.wo_packed, w.w13_packed, w.w2_packed) if p is not None
              for t in vars(p).values() if isinstance(t, torch.Tensor)]  # fmt: skip
    assert len(built) > 20
    assert not any(t.requires_grad or t.grad_fn is not None for t in built)


@fp32_only
def test_a_runner_with_a_buffer_moved_generates_the_same_tokens():
    """inference/bench/placement.py: every buffer a move re-allocates, the step's
    launches must then read and write there, or the tokens part."""
    model = bf16_valued(make_model("tiny-qwen3", seed=11, intermediate_size=192))
    prompt, params = list(range(3, 14)), SamplingParams(max_new_tokens=4, temperature=0.0)
    runner = FastRunner(model, 64, **QKV_PACKED)  # every packed kind: both sums, both norm scalars
    tokens = list(runner.generate_tokens(prompt, params))
    for what in MOVABLE:
        assert move(runner, what, offset=16 * 37)
        assert list(runner.generate_tokens(prompt, params)) == tokens, what
    # the residual re-allocated without re-pointing the lanes' view: the layers add into the old buffer, the head
    # reads the new one's zeros, and the tokens part
    runner.x = torch.zeros_like(runner.x)
    runner.graphs.clear()
    assert list(runner.generate_tokens(prompt, params)) != tokens
    assert not move(FastRunner(model, 64, packed=False), "sums")
    with pytest.raises(ValueError, match="offset"):
        move(runner, "residual", offset=8)


def test_a_runner_keeps_its_residual_at_the_fastest_of_the_timed_addresses():
    """inference/fast/residual_placement.py: the greedy step timed with the residual at each candidate address
    (CUDA graph replays on a GPU, an eager step here), x kept at the fastest, the step's state left as it was."""
    model = bf16_valued(make_model("tiny-qwen3", seed=11, intermediate_size=192))
    still = FastRunner(model, 64, residual_candidates=1, **ALL_PACKED)
    placed = FastRunner(model, 64, residual_candidates=3, **ALL_PACKED)
    assert (still.residual_choice, still.residual_seconds) == (0, [])
    assert len(placed.residual_seconds) == 3 and min(placed.residual_seconds) > 0
    assert placed.residual_seconds[placed.residual_choice] == min(placed.residual_seconds)
    # x lies at the kept candidate's place in the pool, and the step starts where a fresh runner's does
    offset = placed.x.data_ptr() - placed.x.untyped_storage().data_ptr()
    assert offset == placed.residual_choice * (placed.x.nbytes + CANDIDATE_STRIDE)
    assert placed.whole.x is placed.x
    for name in ("token", "pos", "out_tokens", "seen"):
        assert torch.equal(getattr(placed, name), getattr(still, name)), name
    prompt, params = list(range(3, 14)), SamplingParams(max_new_tokens=6, temperature=0.0)
    tokens = list(placed.generate_tokens(prompt, params))
    if not ON_GPU:  # bf16 atomics add in any order: near-ties may flip there
        assert tokens == list(still.generate_tokens(prompt, params))
    views = residual_pool(placed.x, 4)
    starts = [v.data_ptr() for v in views]
    assert all(v.shape == placed.x.shape and v.data_ptr() % 16 == 0 for v in views)
    assert [b - a for a, b in itertools.pairwise(starts)] == [placed.x.nbytes + CANDIDATE_STRIDE] * 3
    with pytest.raises(ValueError, match="candidates"):
        residual_pool(placed.x, 0)


@fp32_only
def test_packed_generation_is_the_bf16_kernels_generation():
    model = bf16_valued(make_model("tiny-llama", seed=10, intermediate_size=192))
    prompt = list(range(5, 17))
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    bf16 = list(FastRunner(model, 64, packed=False).generate_tokens(prompt, params))
    for settings in (PACKED, ALL_PACKED, GLU_PACKED, QKV_PACKED):
        assert list(FastRunner(model, 64, **settings).generate_tokens(prompt, params)) == bf16


def test_packing_refuses_weights_bf16_cannot_hold():
    model = make_model("tiny-llama", seed=11, intermediate_size=192)
    if model.tok_embeddings.dtype == torch.float32:  # random fp32 weights are not bf16 numbers
        with pytest.raises(ValueError, match="packed: layer 0 w2"):
            FastRunner(model, 32, packed=True)
    with pytest.raises(ValueError, match="one-lane"):
        FastRunner(make_model("tiny-laneformer"), 32, packed=True)


def test_prefetch_overrides():
    assert prefetch_overrides(" o=4, gate_up=2 ") == {"o": 4, "gate_up": 2}
    assert prefetch_overrides("") == {}
    for bad in ("attention=2", "o=0", "o=x", "o"):
        with pytest.raises(ValueError, match="prefetch:"):
            prefetch_overrides(bad)
    with pytest.raises(ValueError, match="prefetch:"):
        FastRunner(make_model("tiny-llama"), 32, prefetch={"head": 2})


def test_block_spec():
    assert block_spec(" down=4/4096/8, o=0/128/0 ") == {
        "down": {"block_n": 4, "block_k": 4096, "num_warps": 8},
        "o": {"block_k": 128},  # 0: the kernel's own choice
    }
    assert block_spec("") == {}
    for bad in ("head=4/512/4", "down=4/512", "down=4/x/4", "down"):
        with pytest.raises(ValueError, match="blocks:"):
            block_spec(bad)
    assert block_spec({"down": {"block_k": 4096}}) == {"down": {"block_k": 4096}}
    for bad in ({"head": {"block_n": 4}}, {"down": {"block_m": 4}}, {"down": {"block_n": 0}}):
        with pytest.raises(ValueError, match="blocks"):
            block_spec(bad)


@pytest.mark.parametrize(
    "kwargs,what",
    [({"head_blocks": {"rows": 2}}, "head_blocks:"), ({"attention": {"warps": 2}}, "attention:"),
     ({"blocks": {"down": {"block_n": -1}}}, "blocks.down:"), ({"attention": {"cluster": 2}}, "attention:")]
    + [({"attention": {"cluster": 0, "push": 1}}, "push: the push merge runs in thread-block clusters")]
    + ([] if ON_GPU else [({"attention": {"cluster": 1}}, "cluster: thread-block clusters need a Hopper GPU"),
                          ({"attention": {"push": 1}}, "push: the push merge runs in thread-block clusters")]),
)  # fmt: skip
def test_runner_rejects_unknown_block_settings(kwargs, what):
    with pytest.raises(ValueError, match=what):
        FastRunner(make_model("tiny-llama"), 32, **kwargs)


@pytest.mark.parametrize("preset", ["tiny-laneformer", "tiny-qwen3"])
@pytest.mark.parametrize("cluster,push", [(0, 0), (1, 0), (1, 1)] if ON_GPU else [(0, 0)])
def test_attention_merge_by_cluster_or_counter_matches_the_reference(preset, cluster, push):
    # splits=4 leaves several splits holding keys for the merge to combine (16-token prompt, 16-key blocks);
    # push: the cluster's partials pushed into shared memory instead of through global memory
    model = make_model(preset, seed=8)
    attention = {"splits": 4, "block_t": 16, "cluster": cluster, "push": push}
    runs = teacher_forced(model, list(range(3, 19)), steps=4, attention=attention)
    for fast, ref, _ in runs:
        assert rel_err(fast, ref) < LOGIT_TOL


@pytest.mark.parametrize("preset", ["tiny-laneformer", "tiny-qwen3"])
def test_next_layer_prefetch_is_the_gpu_default_and_changes_nothing(preset):
    # each attention asks L2 for the next layer's keys and values on a Hopper GPU; the logits are the same bits
    model = make_model(preset, seed=9)
    assert FastRunner(model, 32).attn_prefetch_next is ON_GPU
    if not ON_GPU:
        with pytest.raises(ValueError, match="prefetch_next: the L2 prefetch needs a Hopper GPU"):
            FastRunner(model, 32, attention={"prefetch_next": 1})
        return
    prompt = list(range(3, 40))
    on = [fast for fast, _, _ in teacher_forced(model, prompt, steps=4)]
    off = [fast for fast, _, _ in teacher_forced(model, prompt, steps=4, attention={"prefetch_next": 0})]
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


def test_attention_switches_from_the_environment(monkeypatch):
    # KOG_ATTN_CLUSTER, KOG_ATTN_PUSH and KOG_ATTN_PREFETCH_NEXT (0|1) are read like the `attention` argument's
    # keys
    assert FastRunner(make_model("tiny-llama"), 32).attn_push is None  # the kernel's choice
    monkeypatch.setenv("KOG_ATTN_CLUSTER", "0")
    monkeypatch.setenv("KOG_ATTN_PUSH", "0")
    monkeypatch.setenv("KOG_ATTN_PREFETCH_NEXT", "0")
    runner = FastRunner(make_model("tiny-llama"), 32)
    assert runner.attn_cluster is False and runner.attn_push is False and runner.attn_prefetch_next is False
    monkeypatch.setenv("KOG_ATTN_PREFETCH_NEXT", "2")
    with pytest.raises(ValueError, match="KOG_ATTN_"):
        FastRunner(make_model("tiny-llama"), 32)


@pytest.mark.parametrize("preset", ["tiny-laneformer", "tiny-llama"])
def test_explicit_block_sizes_and_head_row_blocks_change_nothing(preset):
    # every matrix-vector kind and the head on blocks of their own, the head's in several blocks a program
    model = make_model(preset, seed=6)
    blocks = "qkv=2/32/2,o=4/16/2,gate_up=2/64/4,down=8/32/4"
    runs = teacher_forced(
        model, list(range(2, 11)), steps=3, blocks=blocks, head_blocks={"block_n": 8, "row_blocks": 3}
    )
    for fast, ref, _ in runs:
        assert rel_err(fast, ref) < LOGIT_TOL


@fp32_only
def test_greedy_generation_equals_the_reference_loop():
    model = make_model("tiny-llama", seed=5)
    prompt = [3, 14, 15, 92, 65]
    runner = FastRunner(model, 64)
    got = list(runner.generate_tokens(prompt, SamplingParams(max_new_tokens=6)))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids], device=DEVICE))[0, -1].argmax()))
    assert got == ids[len(prompt) :]
    assert runner.last_prefill_ms > 0


def test_stop_ids_and_budget():
    model = make_model("tiny-qwen3", seed=2)
    runner = FastRunner(model, 32)
    free = list(runner.generate_tokens([1, 2, 3], SamplingParams(max_new_tokens=5)))
    assert len(free) == 5
    stopped = list(runner.generate_tokens([1, 2, 3], SamplingParams(max_new_tokens=5), frozenset({free[1]})))
    assert stopped == free[: free.index(free[1]) + 1]
    # the context bounds the budget: 30 prompt tokens leave 2 positions
    assert len(list(runner.generate_tokens(list(range(30)), SamplingParams(max_new_tokens=50)))) == 2


@fp32_only
def test_repetition_penalty_matches_the_sampler():
    model = make_model("tiny-laneformer", seed=7)
    params = SamplingParams(max_new_tokens=5, repetition_penalty=1.8)
    prompt = [10, 11, 12, 10]
    got = list(FastRunner(model, 64).generate_tokens(prompt, params))
    ids, sampler = list(prompt), Sampler(params)
    with torch.no_grad():
        for _ in range(5):
            ids.append(sampler(model(torch.tensor([ids], device=DEVICE))[0, -1], ids))
    assert got == ids[len(prompt) :]


def test_sampling_top_k_one_is_greedy_and_seeds_repeat():
    model = make_model("tiny-llama", seed=9)
    runner = FastRunner(model, 64)
    prompt = [7, 8, 9]
    greedy = list(runner.generate_tokens(prompt, SamplingParams(max_new_tokens=4)))
    top1 = list(runner.generate_tokens(prompt, SamplingParams(max_new_tokens=4, temperature=1.3, top_k=1)))
    assert top1 == greedy
    hot = SamplingParams(max_new_tokens=6, temperature=5.0, top_p=0.95, seed=123)
    first, second = list(runner.generate_tokens(prompt, hot)), list(runner.generate_tokens(prompt, hot))
    assert first == second
    assert all(0 <= t < model.cfg.vocab_size for t in first)


def test_streamed_tokens_equal_the_stepped_ones_past_the_ring():
    # on a GPU tokens reach the host through the last kernel's writes into the pinned ring (the head's for greedy
    # steps, the sampler's for sampled ones); more tokens than the ring has slots, so slots are reused
    model = make_model("tiny-llama", seed=3)
    runner = FastRunner(model, 64)
    prompt, n = list(range(5, 18)), RING + 4
    greedy = list(runner.generate_tokens(prompt, SamplingParams(max_new_tokens=n)))
    top1 = list(runner.generate_tokens(prompt, SamplingParams(max_new_tokens=n, temperature=0.7, top_k=1)))
    runner.prefill(prompt)
    stepped = [int(runner.token)]
    for _ in range(n - 1):
        runner.step()
        stepped.append(int(runner.token))
    assert greedy == top1 == stepped


def test_rejects_what_it_cannot_run():
    with pytest.raises(ValueError, match="lm_head_type"):
        FastRunner(make_model("tiny-laneformer", lm_head_type="lane"), 32)
    with pytest.raises(ValueError, match="max_context"):
        FastRunner(make_model("tiny-llama"), 4096)


def test_prefill_refuses_ids_it_cannot_embed_and_goes_on():
    # the prefill's first kernel gathers embedding rows unchecked, so the runner checks the ids it stages
    model = make_model("tiny-llama", seed=4)
    runner = FastRunner(model, 64)
    runner.prefill([5, 6, 7])
    want = runner.logits.clone()
    bad_prompts = ([1, model.cfg.vocab_size], [-1, 2], [2**70], [3, "x"])
    for bad in bad_prompts:
        with pytest.raises(ValueError, match="prompt_ids"):
            runner.prefill(bad)
    runner.prefill([5, 6, 7])
    assert torch.equal(runner.logits, want) and int(runner.pos) == 3


@fp32_only
def test_engine_streams_the_same_text_through_the_fast_runner(monkeypatch):
    from inference.engine import Engine

    params = SamplingParams(max_new_tokens=8)
    texts = {}
    for backend in ("reference", "fast"):
        monkeypatch.setenv("KOG_BACKEND", backend)
        engine = Engine.load("tiny-llama", device="cpu")
        assert type(engine.runner).__name__ == ("FastRunner" if backend == "fast" else "ReferenceRunner")
        events = list(engine.generate(engine.encode_prompt("def add(a, b):"), params))
        texts[backend] = events[-1].text
        assert events[-1].stats.completion_tokens == 8
    assert texts["fast"] == texts["reference"]
