"""The fast runner against the reference model, on the tiny presets (kernels under the interpreter on CPU)."""

import dataclasses
import itertools

import pytest
import torch

import inference.fast.settings as fast_settings
from common.events import SamplingParams
from inference.config import ModelConfig
from inference.fast.head_choice import MIN_STEPS
from inference.fast.layers import reduction
from inference.fast.residual_placement import CANDIDATE_STRIDE, residual_pool
from inference.fast.runner import RING, FastRunner
from inference.fast.settings import RunnerSettings
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


def build(model: Transformer, max_context: int, **changes) -> FastRunner:
    """A runner with `changes` to the settings this model resolves to here (dataclasses.replace)."""
    defaults = RunnerSettings.resolve(model.cfg, model.tok_embeddings.device, model.tok_embeddings.dtype)
    return FastRunner(model, max_context, settings=dataclasses.replace(defaults, **changes))


# Exact token equality with the reference holds in fp32; in bf16 near-ties may flip (the per-step logit
# comparison above covers the GPU).
fp32_only = pytest.mark.skipif(ON_GPU, reason="exact token equality is an fp32 property")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@torch.no_grad()
def teacher_forced(model: Transformer, prompt: list[int], steps: int, max_context: int = 128, **changes):
    """Feed the reference's own greedy tokens to both paths; yield (fast logits, reference logits, fast token).
    The greedy steps' logits come from the whole head (the head screen computes the token alone)."""
    runner = build(model, max_context, **{"head_screen": False, **changes})
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
    "overrides",
    [{}, {"sliding_window": 8, "broadcast_delay": 1}, {"use_comm": False, "use_early_comm": False}],
)
def test_lane_groups_match_the_reference(overrides):
    # groups of lanes as their own chains of launches (streams on a GPU) from the first delayed layer on;
    # without communication every layer is split, layer 0's embedding row included
    model = make_model("tiny-laneformer", seed=3, **overrides)
    runner = build(model, 64, lane_groups=2)
    first_split = 0 if overrides.get("use_comm") is False else model.cfg.broadcast_delay
    assert runner.split_from == first_split
    assert [(g.start, g.stop) for g in runner.groups] == [(0, 2), (2, 4)]
    assert runner.settings.prefetch["gate_up"] == 2
    for fast, ref, _ in teacher_forced(model, list(range(5, 17)), steps=3, lane_groups=2):
        assert rel_err(fast, ref) < LOGIT_TOL


@fp32_only
def test_lane_groups_generate_the_same_tokens():
    model = make_model("tiny-laneformer", seed=11, sliding_window=8)
    prompt, params = [4, 8, 15, 16, 23, 42], SamplingParams(max_new_tokens=12)
    whole = list(FastRunner(model, 64).generate_tokens(prompt, params))
    grouped = list(build(model, 64, lane_groups=2).generate_tokens(prompt, params))
    assert grouped == whole


@pytest.mark.parametrize("preset", ["tiny-laneformer", "tiny-llama", "tiny-qwen3"])
def test_the_head_screen_generates_the_whole_heads_tokens(preset):
    # greedy tokens through the int8 screen and the candidates' rows (kernels/lm_head_screen.py) against the
    # whole head's argmax, step after step; and a sampled request on the same runner still reads the logits
    model = make_model(preset, seed=12)
    prompt, params = [3, 1, 4, 1, 5, 9, 2, 6], SamplingParams(max_new_tokens=10)
    whole = build(model, 64, head_screen=False)
    screened = build(model, 64, head_screen=True)
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
    assert build(model, 32, head_screen=False).head_screen is None  # the settings passed win
    monkeypatch.setenv("KOG_HEAD_SCREEN", "0")
    monkeypatch.setattr(fast_settings, "SCREEN_MIN_HEAD_BYTES", 0)
    assert FastRunner(model, 32).head_screen is None
    monkeypatch.setenv("KOG_HEAD_SCREEN", "yes")
    with pytest.raises(ValueError, match="KOG_HEAD_SCREEN: expected 0 or 1"):
        FastRunner(model, 32)


def test_sampled_steps_take_the_screen_up_to_a_temperature():
    model = make_model("tiny-llama")
    runner = build(model, 32, head_screen=True)
    cool, warm = SamplingParams(temperature=0.3), SamplingParams(temperature=0.31)
    assert runner.uses_screen(SamplingParams()) and runner.uses_screen(cool) and not runner.uses_screen(warm)
    assert not build(model, 32, head_screen=False).uses_screen(SamplingParams())
    runner = build(model, 32, head_screen=True, screen_sampled_temperature=-1)  # never for sampled steps
    assert runner.uses_screen(SamplingParams()) and not runner.uses_screen(SamplingParams(temperature=0.01))
    with pytest.raises(ValueError, match="built without the head screen"):
        build(model, 32, head_screen=False).decode_step(greedy=False, screen=True)


def test_a_sampled_request_on_flat_logits_leaves_the_screen():
    # random weights: every row lies within reach of the page's draw, so a screened step reads the head twice over;
    # the request leaves the screen once MIN_STEPS steps have said so and draws on from the whole head: the same
    # tokens as a runner without the screen, throughout
    model = make_model("tiny-qwen3", seed=13)
    prompt, params = (
        [2, 7, 1, 8, 2, 8],
        SamplingParams(max_new_tokens=10, temperature=0.2, top_p=0.95, seed=6),
    )
    whole = list(build(model, 64, head_screen=False).generate_tokens(prompt, params))
    runner = build(model, 64, head_screen=True)
    assert list(runner.generate_tokens(prompt, params)) == whole
    assert runner.screen_left_at == len(prompt) + MIN_STEPS
    assert runner._candidates(len(prompt) + 1) == model.cfg.vocab_size
    list(runner.generate_tokens(prompt, SamplingParams(max_new_tokens=3)))
    assert runner.screen_left_at is None, "a greedy request reads no counts"
    runner = build(model, 64, head_screen=True, screen_leave_share=1)  # never leave
    assert list(runner.generate_tokens(prompt, params)) == whole
    assert runner.screen_left_at is None


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs")
def test_a_built_runner_holds_every_graph_a_request_replays():
    # no request waits on a compile or a capture, not even one that leaves the screen mid-way
    model = make_model("tiny-qwen3", seed=13)
    runner = build(model, 64, head_screen=True)
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
    assert build(big, 32, lane_groups=1).groups == []
    assert FastRunner(make_model("tiny-laneformer"), 32).groups == []  # ~0.2 MB a layer
    assert FastRunner(make_model("tiny-llama"), 32).groups == []  # one lane


def test_lane_groups_reject_what_they_cannot_split():
    with pytest.raises(ValueError, match="lane_groups: expected 1 or 2"):
        build(make_model("tiny-laneformer"), 32, lane_groups=4)
    with pytest.raises(ValueError, match="lane_groups: two groups need an even number of lanes"):
        build(make_model("tiny-llama"), 32, lane_groups=2)
    with pytest.raises(ValueError, match="lane_groups: two groups"):  # d = 0: every layer sums at once
        build(make_model("tiny-laneformer", broadcast_delay=0), 32, lane_groups=2)


def test_one_lane_models_trigger_qkv_and_o_early():
    llama = FastRunner(make_model("tiny-llama"), 32).settings
    assert llama.early == {"qkv", "o"} and llama.prefetch["gate_up"] == 3
    lanes = FastRunner(make_model("tiny-laneformer"), 32).settings
    assert lanes.early == set() and lanes.prefetch["gate_up"] == 1


def bf16_valued(model: Transformer) -> Transformer:
    """The packed layout holds bf16 numbers: an fp32 model's weights rounded to them (a bf16 model's already are)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))
    return model


# intermediate_size 192: the down-proj's K in whole 64-column chunks (the presets' 160 is not: that one stays bf16),
# and its 3 chunks over 3 programs along K, whose atomics add into the residual
SPLIT_BLOCKS = {**fast_settings.PACKED_BLOCKS, "down": {"ahead": 2, "split": 3}}
PACKED = {"packed": True, "packed_blocks": SPLIT_BLOCKS}
# layer 1's gate/up too (its sums cleared by the o-proj, read by the down-proj through the SiLU; D = 64: one chunk),
# its programs taking 2 items (qwen3-1.7b's blocks)
ALL_PACKED = {"packed": True, "packed_gate_up": True,
              "packed_blocks": {**SPLIT_BLOCKS, "gate_up": fast_settings.PACKED_SHAPE_BLOCKS[2 * 6144, 2048]}}  # fmt: skip


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
@pytest.mark.parametrize(
    "settings",
    [PACKED, ALL_PACKED],
    ids=["o+down", "o+gate_up+down"],
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

    assert packed(build(model, 32, packed=True)) == [(False, False, True), (True, False, True)]
    assert packed(build(model, 32, **ALL_PACKED)) == [(False, False, True), (True, True, True)]
    narrow = bf16_valued(make_model("tiny-qwen3", seed=9))  # intermediate_size 160: no packed down-proj
    assert packed(build(narrow, 32, **ALL_PACKED)) == [(False, False, False), (True, False, False)]
    assert packed(build(model, 32, packed=False)) == [(False, False, False)] * 2


@pytest.mark.parametrize("lane_groups", [1, 2])
def test_a_laneformers_packed_gate_up_matches_the_reference(lane_groups):
    """Every layer's gate/up in 12 bits with its norm and SiLU (packed_glu_gemv): the whole model's lanes before
    the groups split, each group's own after."""
    model = bf16_valued(make_model("tiny-laneformer", seed=12))
    for fast, ref, token in teacher_forced(model, list(range(4, 15)), steps=3, packed_gate_up=True,
                                           lane_groups=lane_groups):  # fmt: skip
        assert rel_err(fast, ref) < LOGIT_TOL
        assert token == int(fast.argmax())


def test_which_of_a_laneformers_gate_ups_are_packed():
    model = bf16_valued(make_model("tiny-laneformer", seed=12))
    runner = build(model, 32, packed_gate_up=True, lane_groups=2)
    split = runner.split_from
    assert 0 < split < len(runner.layers)
    assert [w.w13_packed is not None for w in runner.layers] == [i < split for i in range(len(runner.layers))]
    for group in runner.groups:
        later = group.layers[split:]
        assert all(w.w13_packed is not None for w in later)
        assert all(w.w13_packed.n == 2 * 48 * 2 for w in later)  # 2 lanes of 48 gate rows and 48 up rows
    whole = 2 * 48 * 4 * 64 * 2  # a layer's gate and up, all lanes, in bf16 bytes
    assert {kind for _, kind in runner.packed_bytes()} == {"gate/up"}
    assert all(0.74 * whole < n < 0.8 * whole for n in runner.packed_bytes().values())
    assert not build(model, 32, packed_gate_up=False).packed_bytes()


@fp32_only
def test_a_laneformers_packed_generation_is_its_bf16_kernels_generation():
    model = bf16_valued(make_model("tiny-laneformer", seed=13))
    prompt, params = list(range(5, 17)), SamplingParams(max_new_tokens=10, temperature=0.0)
    bf16 = list(build(model, 64, packed_gate_up=False).generate_tokens(prompt, params))
    assert list(build(model, 64, packed_gate_up=True).generate_tokens(prompt, params)) == bf16


# 2 lanes of F / L = 64: the down-proj's K in whole chunks
LANE_CHUNKS = {"num_lanes": 2, "intermediate_size": 128}
LANES_PACKED = {"packed_gate_up": True, "packed_lane_down": True}


@pytest.mark.parametrize("lane_groups,early_comm", [(1, True), (2, True), (1, False)])
def test_a_laneformers_packed_reductions_match_the_reference(lane_groups, early_comm):
    """The down-proj of the delayed layers in 12 bits (packed_lane_reduce_gemv), the reduction and the residual add
    in the launch: the whole model's lanes, or each group's (one lane each) after the split. Without early
    communication the first layers are scaled and packed too, and the delayed ones read their partials."""
    model = bf16_valued(make_model("tiny-laneformer", seed=14, use_early_comm=early_comm, **LANE_CHUNKS))
    for fast, ref, token in teacher_forced(model, list(range(4, 15)), steps=3, lane_groups=lane_groups,
                                           **LANES_PACKED):  # fmt: skip
        assert rel_err(fast, ref) < LOGIT_TOL
        assert token == int(fast.argmax())


def test_which_of_a_laneformers_reductions_are_packed():
    """The layers before d sum every lane's fresh partial (one launch must hold them all): bf16. The delayed
    layers' down-proj is packed for the lanes that launch it (the o-proj stays bf16), and only where asked."""
    model = bf16_valued(make_model("tiny-laneformer", seed=14, **LANE_CHUNKS))
    runner = build(model, 32, lane_groups=2, **LANES_PACKED)
    split = runner.split_from
    assert [w.mode for w in runner.layers] == ["sum", "sum", "delayed", "delayed"] and split == 2
    for w in runner.layers[:split] + [w for group in runner.groups for w in group.layers[split:]]:
        assert w.wo_packed is None and (w.w2_packed is not None) == (w.mode == "delayed")
    assert {kind for _, kind in runner.packed_bytes()} == {"gate/up", "down"}
    gate_up_only = build(model, 32, packed_gate_up=True, packed_lane_down=False)
    assert {kind for _, kind in gate_up_only.packed_bytes()} == {"gate/up"}


def test_a_runner_of_parameters_holds_no_autograd_graph():
    """The model's weights require gradients here (make_model's Parameters): what the runner builds from them (the
    q|k|v, the packed words, the head screen) must hold none, or each keeps its temporaries alive."""
    model = bf16_valued(make_model("tiny-qwen3", seed=9, intermediate_size=192))
    assert model.layers[0].wq.requires_grad
    runner = build(model, 32, head_screen=True, **ALL_PACKED)
    built = [w.wqkv for w in runner.layers] + list(vars(runner.head_screen).values())
    built += [t for w in runner.layers for p in (w.wo_packed, w.w13_packed, w.w2_packed) if p is not None
              for t in vars(p).values() if isinstance(t, torch.Tensor)]  # fmt: skip
    assert len(built) > 20
    assert not any(t.requires_grad or t.grad_fn is not None for t in built)


def test_a_runner_keeps_its_residual_at_the_fastest_of_the_timed_addresses():
    """inference/fast/residual_placement.py: the greedy step timed with the residual at each candidate address
    (CUDA graph replays on a GPU, an eager step here), x kept at the fastest, the step's state left as it was."""
    model = bf16_valued(make_model("tiny-qwen3", seed=11, intermediate_size=192))
    still = build(model, 64, **ALL_PACKED)
    placed = build(model, 64, **ALL_PACKED)
    assert (still.residual_choice, still.residual_seconds) == (0, [])  # none timed until asked
    assert placed.place_residual(3) is placed.residual_seconds
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
    bf16 = list(build(model, 64, packed=False).generate_tokens(prompt, params))
    for settings in (PACKED, ALL_PACKED):
        assert list(build(model, 64, **settings).generate_tokens(prompt, params)) == bf16


def test_packing_refuses_weights_bf16_cannot_hold():
    model = make_model("tiny-llama", seed=11, intermediate_size=192)
    if model.tok_embeddings.dtype == torch.float32:  # random fp32 weights are not bf16 numbers
        with pytest.raises(ValueError, match="packed: layer 0 w2"):
            build(model, 32, packed=True)
    with pytest.raises(ValueError, match="one-lane"):
        build(make_model("tiny-laneformer"), 32, packed=True)


@pytest.mark.parametrize("preset", ["tiny-laneformer", "tiny-qwen3"])
def test_split_keys_merge_to_the_reference(preset):
    # 4 splits of a 150-token context: several splits hold keys for the merge to combine (a cluster's push on a
    # Hopper GPU, the arrival counter elsewhere)
    model = make_model(preset, seed=8)
    for fast, ref, _ in teacher_forced(
        model, list(range(3, 153)), steps=3, max_context=160, attention_splits=4
    ):
        assert rel_err(fast, ref) < LOGIT_TOL


@pytest.mark.parametrize("preset", ["tiny-laneformer", "tiny-qwen3"])
def test_next_layer_prefetch_is_the_gpu_default_and_changes_nothing(preset):
    # each attention asks L2 for the next layer's keys and values on a Hopper GPU; the logits are the same bits
    model = make_model(preset, seed=9)
    assert FastRunner(model, 32).settings.attention_prefetch_next is ON_GPU
    if not ON_GPU:
        with pytest.raises(ValueError, match="next_layer: the L2 prefetch needs a Hopper GPU"):
            build(model, 32, attention_prefetch_next=True).decode_step()
        return
    prompt = list(range(3, 40))
    on = [fast for fast, _, _ in teacher_forced(model, prompt, steps=4)]
    off = [fast for fast, _, _ in teacher_forced(model, prompt, steps=4, attention_prefetch_next=False)]
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


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


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs")
@pytest.mark.parametrize("preset", ["tiny-laneformer", "tiny-qwen3"])
@torch.no_grad()
def test_a_suffix_prefill_replays_a_graph_with_the_eager_kernels_logits(preset):
    max_context = 256
    runner = build(make_model(preset, seed=17), max_context)
    graphs = runner.suffix_graphs
    assert set(graphs.graphs) == set(graphs.buckets)  # captured when the runner was built
    gen = torch.Generator().manual_seed(5)
    # (start, new ids): mid-bucket, a whole bucket, the last id alone, and a bucket that would run past the cache
    for start, length in [(40, 11), (100, 32), (7, 1), (150, 60), (max_context - 20, 17)]:
        n = start + length
        prompt = torch.randint(3, 1000, (n,), generator=gen).tolist()
        runner.prefill(prompt)  # cache rows [0, n) hold the prompt: the reused prefix is [0, start)
        bucket = next(b for b in graphs.buckets if b >= length)
        assert (graphs.for_suffix(length, start) is not None) == (start + bucket <= max_context)
        runner.prefill(prompt, start=start)
        replayed, token, keys = runner.logits.clone(), int(runner.token), runner.cache.k[:, :, :, :n].clone()
        if start + bucket <= max_context:  # the graph's kernels run eagerly: the same bits
            graphs.forward(bucket)
            assert torch.equal(runner.logits, replayed)
        buckets, graphs.buckets = graphs.buckets, []  # the eager suffix prefill, T = length rows
        try:
            runner.prefill(prompt, start=start)
        finally:
            graphs.buckets = buckets
        # cuBLAS may round a bucket's rows and the suffix's own by one bf16 ulp apart
        assert rel_err(replayed, runner.logits) < LOGIT_TOL
        top = replayed[: runner.vocab_limit].topk(2).values
        if top[0] - top[1] > 0.1:  # not a near-tie that one ulp may flip
            assert token == int(runner.token)
        torch.testing.assert_close(keys, runner.cache.k[:, :, :, :n], rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize("preset", ["tiny-laneformer", "tiny-qwen3"])
@torch.no_grad()
def test_the_suffix_graphs_math_run_eagerly_matches_the_eager_suffix_prefill(preset):
    # what a suffix graph replays (start and the last row read from the staged prompt on the device, a whole
    # bucket of rows) against the eager suffix prefill; on the CPU under the interpreter, where no graph runs
    runner = build(make_model(preset, seed=19), 96)
    prompt = torch.randint(3, 1000, (70,), generator=torch.Generator().manual_seed(6)).tolist()
    runner.prefill(prompt)
    graphs, start = runner.suffix_graphs, 59  # 11 new ids in a bucket of 16, past the 64-token window
    buckets, graphs.buckets = graphs.buckets, []
    runner.prefill(prompt, start=start)  # eager; leaves the prompt and start staged
    graphs.buckets = buckets
    eager, keys = runner.logits.clone(), runner.cache.k[:, :, :, :70].clone()
    graphs.forward(16)
    assert rel_err(runner.logits, eager) < LOGIT_TOL
    torch.testing.assert_close(runner.cache.k[:, :, :, :70], keys, rtol=1.6e-2, atol=1.6e-2)
