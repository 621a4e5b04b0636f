"""memcalc.plan.depth: the step of a deep model extrapolated from 3-, 4- and 5-layer copies must
have exactly the peak of the direct simulation, or fall back to it."""

from __future__ import annotations

import pytest

from memcalc.core.layout import layout_of
from memcalc.core.spec import ExperimentSpec, MLASpec, MoESpec
from memcalc.engine.sharding import Share
from memcalc.estimate.peak import estimate
from memcalc.estimate.step import simulate
from memcalc.inputs.presets import list_presets, load_preset
from memcalc.inputs.profiles import PROFILES, with_loss
from memcalc.plan.cluster import cluster_setups
from memcalc.plan.depth import (CHECKED, CHECKED_DEPTHS, SHALLOW_DEPTHS, applies, deep_trace, extrapolate, shallow,
                                structure_key)
from memcalc.plan.options import Technique, techniques
from memcalc.plan.simulations import estimated_peak, with_training
from memcalc.plan.steps import SIM_CACHE

from conftest import tiny_llama

# the whole file runs in the slow lane: its quick rows are a subset of the slow grid, and the quick
# lane must stay under 30 s (tests/unit/test_plan.py keeps plan's exactness checks there)
pytestmark = pytest.mark.slow

DEPTH = 13  # deeper than depth.MIN_DEPTH, odd (no accidental periodicity with the shallow depths)

# Small decoders of each family the engine walks. source: memcalc/engine/forward.py (the blocks)
FAMILIES = {
    "llama": tiny_llama(n_layers=DEPTH),
    "deep-one": tiny_llama(name="tiny-alibi", n_layers=DEPTH, n_kv_heads=None, positions="alibi",
                           alibi_trainable=True, norm_placement="post", residual_scale=2.0, activation="relu",
                           max_seq_len=2048),
    "gpt2": tiny_llama(name="tiny-gpt2", n_layers=DEPTH, n_kv_heads=None, positions="learned", norm="layernorm",
                       mlp="plain", activation="gelu", tie_embeddings=True, qkv_bias=True, o_bias=True,
                       mlp_bias=True, max_seq_len=1024, attn_dropout=0.1, resid_dropout=0.1),
    "phi": tiny_llama(name="tiny-phi", n_layers=DEPTH, n_kv_heads=None, block="parallel", norm="layernorm",
                      mlp="plain", activation="gelu_tanh", rotary_pct=0.5, qkv_bias=True, o_bias=True,
                      mlp_bias=True, max_seq_len=2048),
}
#: (batch, seq) points, including sequences that are not multiples of the attention kernels'
#: roundings. source: memcalc/core/kernels.py (FLASH_SEQ_ROUND 128, EFFICIENT_LSE_ROUND 32)
POINTS = ((1, 512), (3, 333))
#: the quick lane keeps these technique keys; the slow lane runs all 112
QUICK = {"none/bf16+master/adafactor/full/fused", "qlora/bf16/adamw/selective"}


def _peaks(exp: ExperimentSpec) -> list[tuple[int, int]]:
    out = []
    for first in (False, True):
        deep = deep_trace(exp, first)
        direct = simulate(exp, first_step=first, record_timeline=False).peak_bytes
        out.append((None if deep is None else int(deep[0].max()), direct))
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("tech", [pytest.param(t, marks=[] if t.key() in QUICK else [pytest.mark.slow])
                                  for t in techniques()], ids=Technique.key)
def test_extrapolated_peak_is_the_direct_peak(family, tech):
    # source: memcalc.engine.timeline.simulate on the full-depth model; tolerance: none (bytes)
    m = FAMILIES[family]
    for b, t in POINTS[:1] if tech.key() in QUICK else POINTS:  # the quick lane: one point
        exp = ExperimentSpec(model=m, training=tech.training(b, min(t, m.max_seq_len)))
        for deep, direct in _peaks(exp):
            if tech.checkpoint == "sqrt":
                assert deep is None  # segments depend on the depth: simulated directly
            else:
                assert deep == direct, (family, tech.key(), b, t)


@pytest.mark.parametrize("profile", [pytest.param(p, marks=[] if p == "torch-2.8-cuda" else [pytest.mark.slow])
                                     for p in PROFILES])
def test_extrapolated_peak_every_profile(profile):
    # source: memcalc.engine.timeline.simulate; the profiles change norms, attention, loss, dropout masks
    prof = PROFILES[profile]
    m = FAMILIES["llama"]
    for tech in (Technique("none", "16", "adamw", "none", False), Technique("lora", "16", "adamw", "full", False)):
        for p in (prof, with_loss(prof, "chunked", 3)):
            exp = ExperimentSpec(model=m, training=tech.training(2, 1000), profile=p)
            for deep, direct in _peaks(exp):
                assert deep == direct, (profile, p.cross_entropy, tech.key())


@pytest.mark.parametrize("gpus", [8, pytest.param(1, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow),
                                  pytest.param(64, marks=pytest.mark.slow)])
def test_extrapolated_peak_zero3_cluster_setups(gpus):
    # source: memcalc.engine.timeline.simulate of plan's cluster setups (ZeRO-3, layers gathered);
    # a step that cannot be extrapolated exactly (a sharded sum) falls back, never differs
    m = FAMILIES["llama"]
    for setup in cluster_setups(m, 700, PROFILES["torch-2.8-cuda"]).values():
        for exp in setup.values():
            exp = with_training(exp, gpus=gpus)
            for deep, direct in _peaks(exp):
                assert deep is None or deep == direct, (exp.name, exp.training.checkpoint, gpus)


@pytest.mark.parametrize("sharding,zero,gpus,precision,master,checkpoint", [
    # source: memcalc.engine.fsdp / fsdp1: every parameter sharded on its own (padded rows), so the
    # step's sums over parameters are affine in the depth and the deep step extrapolates exactly
    ("fsdp2", 3, 8, "bf16", True, "full"),
    ("fsdp2", 3, 3, "fp32", False, "none"),
    ("fsdp2", 2, 16, "bf16", False, "none"),
    ("fsdp2", 3, 64, "bf16", True, "selective"),
    ("fsdp1", 3, 8, "bf16", False, "full"),
    # source: memcalc.engine.optimizers (the foreach step's temporary is ceil(S / N) of the whole
    # state, an engine.sharding.Share: extrapolated through S, exact at a degree that does not divide S)
    ("fsdp2", 3, 7, "bf16", False, "none"),
    ("fsdp2", 3, 137, "bf16", True, "full"),
])
def test_fsdp_steps_extrapolate_exactly(sharding, zero, gpus, precision, master, checkpoint):
    m = FAMILIES["llama"]
    tr = Technique("none", "16+master" if master else "16", "adamw", checkpoint, False).training(2, 700)
    tr = tr.model_copy(update={"precision": precision, "master_weights": master, "zero": zero, "gpus": gpus,
                               "sharding": sharding})
    exp = ExperimentSpec(model=m, training=tr)
    for deep, direct in _peaks(exp):
        assert deep == direct, (sharding, zero, gpus)


@pytest.mark.parametrize("gpus", [7, 13])
def test_cluster_setups_extrapolate_at_any_degree(gpus):
    # source: plan's cluster setups (FSDP2, ZeRO-3) at degrees that do not divide the foreach step's
    # sum: extrapolated (not simulated directly) and exact
    m = FAMILIES["llama"]
    for setup in cluster_setups(m, 700, PROFILES["torch-2.8-cuda"]).values():
        for exp in setup.values():
            for deep, direct in _peaks(with_training(exp, gpus=gpus)):
                assert deep == direct, (exp.name, exp.training.checkpoint, gpus)


def test_plan_peaks_are_estimate_peaks():
    # source: estimate(): the plan's estimated_peak (extrapolated) equals its peak_bytes
    m = FAMILIES["llama"]
    for tech in (Technique("none", "16+master", "adamw", "selective", True), Technique("qlora", "16", "adamw", "full", False)):
        exp = ExperimentSpec(model=m, training=tech.training(2, 999))
        assert applies(exp)
        assert estimated_peak(exp) == estimate(exp, timeline=False).peak_bytes


def test_what_is_simulated_directly():
    m = FAMILIES["llama"]
    base = Technique("none", "16", "adamw", "none", False).training(1, 256)
    assert applies(ExperimentSpec(model=m, training=base))
    for update in ({"checkpoint": "sqrt"}, {"checkpoint": "every-k", "checkpoint_every": 2}, {"compile": True}):
        assert not applies(ExperimentSpec(model=m, training=base.model_copy(update=update))), update
    assert not applies(ExperimentSpec(model=tiny_llama(n_layers=12), training=base))  # too shallow to gain


@pytest.mark.parametrize("tech,base,others", [
    # source: memcalc.plan.depth.deep_trace at SHALLOW_DEPTHS (three depths) and the direct
    # simulation, for the same structure at other sizes and GPU counts; tolerance: none (bytes)
    (Technique("none", "16+master", "adamw", "full", False), {"zero": 3, "gpus": 8},
     [{"gpus": 5}, {"gpus": 137, "seq": 333}, {"gpus": 2, "batch": 3}]),  # plan's cluster table: FSDP2 over N
    (Technique("lora", "16", "adamw", "none", False), {"zero": 3, "gpus": 3}, [{"gpus": 64, "seq": 999}]),
    (Technique("none", "16", "adamw", "none", False), {"zero": 1, "gpus": 7, "sharding": "fsdp1"},
     [{"gpus": 13}]),  # a foreach step's Share of the sharded state
    (Technique("lora", "16", "adamw", "none", False), {}, [{"batch": 3, "seq": 333}, {"batch": 8, "seq": 64}]),
    (Technique("none", "fp32", "adafactor", "selective", True), {}, [{"batch": 2, "seq": 1000}]),
    (Technique("qlora", "16", "adamw", "full", False), {}, [{"batch": 5, "seq": 129}]),
])
def test_two_depths_once_the_structure_is_checked(tech, base, others):
    m = FAMILIES["llama"]
    exp = ExperimentSpec(model=m, training=tech.training(1, 512).model_copy(update=base))
    CHECKED.clear()
    for first in (False, True):
        deep_trace(exp, first)  # three depths: the structure is checked and recorded
        assert structure_key(exp, first) in CHECKED
        for upd in others:
            e = with_training(exp, **upd)
            assert structure_key(e, first) in CHECKED
            two = deep_trace(e, first)
            assert (shallow(e, SHALLOW_DEPTHS[-1]).model, e.training, e.profile, first) not in SIM_CACHE  # two depths
            three = deep_trace(e, first, SHALLOW_DEPTHS)
            direct = simulate(e, first_step=first, record_timeline=False).peak_bytes
            assert two is not None and three is not None and two[1] == three[1]
            assert two[0].tolist() == three[0].tolist() and int(two[0].max()) == direct, (tech.key(), upd, first)
    assert deep_trace(exp, False, CHECKED_DEPTHS)[0].tolist() == deep_trace(exp, False, SHALLOW_DEPTHS)[0].tolist()


def test_deepspeed_steps_always_take_three_depths():
    # source: memcalc.engine.deepspeed: buckets cut by bytes (a boundary may move with the sizes), so
    # no DeepSpeed structure is recorded as checked
    tr = Technique("none", "16", "adamw", "none", False).training(1, 256).model_copy(
        update={"zero": 2, "gpus": 4, "sharding": "deepspeed"})
    exp = ExperimentSpec(model=FAMILIES["llama"], training=tr)
    CHECKED.clear()
    deep_trace(exp, False)
    assert not CHECKED


def _trace(depth: int, per_layer: int, extra=lambda d: 0) -> list[tuple[int, str, str, int]]:
    """A synthetic step: setup, one allocation per layer in forward, and a last one."""
    out, total = [], 1000
    for i in range(depth):
        total += per_layer
        out.append((total, "forward", f"fwd layer {i}", per_layer))
    req = 512 + extra(depth)
    out.append((total + -(-req // 512) * 512, "backward", "backward start", req))  # rounded, as Sim.alloc does
    return out


def test_extrapolate_checks_affinity():
    # source: the module docstring of memcalc.plan.depth (affine in the depth, else None)
    traces = [_trace(d, 1024) for d in SHALLOW_DEPTHS]
    got = extrapolate(traces, SHALLOW_DEPTHS, 40, 512)
    assert got is not None and int(got[0].max()) == _trace(40, 1024)[-1][0]
    # a request that is not affine in the depth: refused
    bent = [_trace(d, 1024, extra=lambda d: 512 * d * d) for d in SHALLOW_DEPTHS]
    assert extrapolate(bent, SHALLOW_DEPTHS, 40, 512) is None
    # a request that grows with the depth is rounded at the real depth (a foreach temporary)
    grow = [_trace(d, 1024, extra=lambda d: 100 * d) for d in SHALLOW_DEPTHS]
    got = extrapolate(grow, SHALLOW_DEPTHS, 40, 512)
    assert got is not None and int(got[0].max()) == _trace(40, 1024, extra=lambda d: 100 * d)[-1][0]


def _share_trace(depth: int, parts: int, shared: bool) -> list[tuple[int, str, str, int]]:
    """A step whose last request is a rank's share ceil(S / parts) of S = 1000 + 333 * depth."""
    out = _trace(depth, 1024)[:-1]
    req = Share(1000 + 333 * depth, parts)
    out.append((out[-1][0] + -(-req // 512) * 512, "optimizer step", "optimizer step", req if shared else int(req)))
    return out


def test_a_share_is_its_int_and_pickles():
    # source: definition: ceil(1000 / 7) = 143; pickle round trip keeps what it is a share of
    import pickle

    s = Share(1000, 7)
    back = pickle.loads(pickle.dumps(s))
    assert (s, s.whole, s.parts) == (143, 1000, 7) and (back, back.whole, back.parts) == (143, 1000, 7)


def test_extrapolate_divides_a_share_at_the_real_depth():
    # source: memcalc.engine.sharding.Share: ceil((1000 + 333 d) / 7) is not affine in d; its whole is
    want = _share_trace(40, 7, True)[-1][0]
    shares = [_share_trace(d, 7, True) for d in SHALLOW_DEPTHS]
    got = extrapolate(shares, SHALLOW_DEPTHS, 40, 512, shards=7)
    assert got is not None and int(got[0].max()) == want
    # the same requests as plain ints (nothing says what they are shares of): refused, not guessed
    plain = [_share_trace(d, 7, False) for d in SHALLOW_DEPTHS]
    assert extrapolate(plain, SHALLOW_DEPTHS, 40, 512, shards=7) is None


# Layouts with a period, a prefix and a suffix (memcalc/core/layout.py), deeper than their three
# shallow copies together. source: the families' patterns (Gemma-2 / gpt-oss sliding and full
# attention alternating, eager softcapped attention; Gemma-3 five sliding layers to a full one;
# DeepSeek MLA with dense first layers; Qwen2-MoE decoder_sparse_step)
PERIODIC = {
    "gemma-2-like": tiny_llama(name="tiny-gemma2", n_layers=29, sliding_window=200, full_attention_every=2,
                               attn_softcap=50.0, logit_softcap=30.0, norm_placement="sandwich"),
    "gemma-3-like": tiny_llama(name="tiny-gemma3", n_layers=44, sliding_window=300, full_attention_every=3,
                               qk_norm="head"),
    "deepseek-like": tiny_llama(name="tiny-deepseek", n_layers=21, n_kv_heads=None, mla=MLASpec(
        q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16),
        moe=MoESpec(n_experts=8, top_k=2, d_ff_expert=96, n_shared_experts=1, first_dense_layers=2,
                    router="sigmoid")),
    "moe-every-2": tiny_llama(name="tiny-moe2", n_layers=35, moe=MoESpec(
        n_experts=4, top_k=2, d_ff_expert=128, first_dense_layers=2, every=2, n_shared_experts=1,
        shared_expert_gate=True)),
}
#: (prefix, period, suffix) of each. source: definition (memcalc.core.layout.prefix_and_period)
PERIODIC_CUTS = {"gemma-2-like": (0, 2, 1), "gemma-3-like": (0, 3, 2), "deepseek-like": (2, 1, 0),
                 "moe-every-2": (2, 2, 1)}
PERIODIC_TECHS = [Technique("none", "16", "adamw", "none", False),
                  Technique("none", "16+master", "adamw", "selective", True),
                  Technique("lora", "16", "adamw", "full", False),
                  Technique("qlora", "16", "adamw", "selective", False)]


@pytest.mark.parametrize("family", list(PERIODIC))
@pytest.mark.parametrize("tech", PERIODIC_TECHS, ids=Technique.key)
def test_periodic_layouts_extrapolate_in_whole_periods(family, tech):
    # source: memcalc.engine.timeline.simulate on the full-depth model; tolerance: none (bytes)
    m = PERIODIC[family]
    lay = layout_of(m)
    assert (lay.prefix, lay.period, lay.suffix) == PERIODIC_CUTS[family]
    for b, t in POINTS:
        exp = ExperimentSpec(model=m, training=tech.training(b, t, targets=m.attention_lora_targets))
        assert applies(exp)
        for deep, direct in _peaks(exp):
            assert deep == direct, (family, tech.key(), b, t)
    tr = tech.training(2, 700, targets=m.attention_lora_targets).model_copy(
        update={"zero": 3, "gpus": 8, "sharding": "fsdp2"})
    if tr.lora is None:  # FSDP2 over 8 GPUs (plan's cluster table)
        for deep, direct in _peaks(ExperimentSpec(model=m, training=tr)):
            assert deep == direct, (family, tech.key(), "fsdp2")


#: Shipped presets simulated directly (source: memcalc.plan.depth.stack): gpt2 has 12 layers (its
#: copies of 3, 4 and 5 layers are as many); gemma-3-1b's copies of 3, 4 and 5 periods of six (and
#: its suffix of two) are 78 layers to its 26; gpt-oss-20b's of 3, 4 and 5 periods of two are 24
#: layers, as many as it has. Every other preset is extrapolated.
DIRECT_PRESETS = {"gpt2", "gemma-3-1b", "gpt-oss-20b"}


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_extrapolates_to_the_direct_peak(name):
    # source: memcalc.engine.timeline.simulate of the preset at full depth; tolerance: none (bytes)
    m = load_preset(name)
    targets = m.attention_lora_targets
    setups = [Technique("none", "16", "adamw", "selective", False).training(1, 512),
              Technique("lora", "16", "adamw", "full", False).training(2, 333, targets=targets),
              Technique("none", "16+master", "adamw", "full", False).training(1, 256).model_copy(
                  update={"zero": 3, "gpus": 8, "sharding": "fsdp2"})]
    for tr in setups:
        exp = ExperimentSpec(model=m, training=tr)
        assert applies(exp) == (name not in DIRECT_PRESETS)
        for deep, direct in _peaks(exp):
            assert deep is None if name in DIRECT_PRESETS else deep == direct, (name, tr.checkpoint)


@pytest.mark.parametrize("update", [
    # source: memcalc.engine.weights / optimizers: per-parameter tensors and shards, rounded one by one
    {}, {"zero": 3, "gpus": 7}, {"zero": 2, "gpus": 3, "sharding": "fsdp1"}, {"zero": 1, "gpus": 13},
    {"optimizer": "adamw-8bit"}, {"lora": None, "precision": "fp32"},
])
def test_state_floor_extrapolates_exactly(update):
    # source: memcalc.engine.timeline.floor_bytes (weights, state and, before an unfused single-GPU
    # step, every gradient) on the full-depth model; tolerance: none
    from memcalc.engine.timeline import floor_bytes
    from memcalc.plan.simulations import state_floor

    tr = Technique("lora", "16", "adamw", "none", False).training(1, 2).model_copy(update=update)
    exp = ExperimentSpec(model=FAMILIES["llama"], training=tr)
    assert applies(exp)
    assert state_floor(exp) == floor_bytes(exp)
    if tr.gpus > 1:  # the same setup at other GPU counts: two depths, checked structure
        for g in (2, 5, 64):
            e = with_training(exp, gpus=g)
            assert state_floor(e) == floor_bytes(e), g


def test_one_gpu_traces_two_depths_are_the_first_two_of_three():
    # source: memcalc.plan.steps.traced_step of the 3- and 4-layer copies on one GPU
    from memcalc.plan.depth import ONE_GPU_TRACES, _one_gpu_traces
    from memcalc.plan.steps import traced_step

    tr = Technique("none", "16", "adamw", "none", False).training(1, 256)
    exp = ExperimentSpec(model=FAMILIES["llama"], training=tr)
    ONE_GPU_TRACES.clear()
    three = _one_gpu_traces(exp, False, SHALLOW_DEPTHS)
    two = _one_gpu_traces(exp, False, CHECKED_DEPTHS)
    assert two == three[:2] == [traced_step(shallow(exp, d)).alloc_trace for d in CHECKED_DEPTHS]
    assert (exp, False, CHECKED_DEPTHS) not in ONE_GPU_TRACES  # read from the three-depth entry
