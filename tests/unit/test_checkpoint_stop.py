"""A checkpointed region's early stop, counted in its first forward, is the one a dry run finds
(memcalc/engine/checkpoint.py).

Non-reentrant checkpointing stops recomputing after the region's last saving op. The simulator
used to find that point with a dry run of the region in backward (all allocations ghosts); the
first forward now counts it (``Sim._count_save``, the layer hooks' allocations left out through
``Sim.hook_allocs``), and the dry run is left to torchtitan's op-level policy and to activation
offloading. With ``CHECK_STOP`` the dry run runs as well and ``recompute`` asserts that both agree;
the step's bytes must not change either way (the dry run allocates nothing that counts).
"""

from __future__ import annotations

import pytest

import memcalc.engine.checkpoint as ck
from memcalc.api import _resolve
from memcalc.estimate.step import simulate
from memcalc.plan.depth import shallow

# (options, whether the first forward counts the stop); each row a path the counting must get
# right. source: memcalc/engine/checkpoint.py (the dry run it replaces)
SETUPS = [
    (dict(model="llama-3.1-8b", bf16=True, checkpoint="full"), True),  # source: full fine-tune
    (dict(model="llama-3.1-8b", lora=True, bf16=True, checkpoint="full"), True),  # source: frozen base (layer 0's input needs no grad)
    (dict(model="llama-3.1-8b", lora=True, precision="amp-bf16", checkpoint="full"), True),  # source: autocast copies of frozen weights saved iff x needs grad
    (dict(model="llama-3.1-8b", qlora=True, checkpoint="sqrt"), True),  # source: segments of several layers
    (dict(model="llama-3.1-8b", lora=True, bf16=True, checkpoint="selective"), True),  # source: attention-core regions
    (dict(model="llama-3.1-8b", bf16=True, zero=3, gpus=4, sharding="fsdp2", checkpoint="sqrt"), True),  # source: FSDP2's unshard in forward only (hook_allocs)
    (dict(model="llama-3.1-8b", bf16=True, zero=3, gpus=4, sharding="fsdp1", checkpoint="full"), True),  # source: FSDP1's unshard in forward only
    (dict(model="llama-3.1-8b", bf16=True, tp=2, checkpoint="full"), True),  # source: tensor-parallel collectives
    (dict(model="llama-3.1-8b", lora=True, compile=True, checkpoint="full"), True),  # source: compiled layers
    (dict(model="deep-one-1.6b", checkpoint="full"), True),  # source: ALiBi mask inside the layer, post-norm
    (dict(model="gpt-oss-20b", bf16=True, checkpoint="full"), True),  # source: MoE, sinks, sliding masks
    (dict(model="deepseek-v3", bf16=True, checkpoint="sqrt"), True),  # source: MLA
    (dict(model="llama-3.1-8b", bf16=True, checkpoint="selective-op"), False),  # source: OpSaver keeps its dry run
    (dict(model="llama-3.1-8b", bf16=True, activation_offload=True, checkpoint="full"), False),  # source: offloading keeps it
]


def _exp(opts: dict):
    return shallow(_resolve(None, dict(opts, seq=128)).exp, 2)


def _digest(exp) -> tuple:
    r = simulate(exp, record_timeline=True, trace_allocs=True, events=True)
    return (r.peak_bytes, r.peak_phase, r.peak_label, sorted(r.peak_categories.items()), list(r.phases.items()),
            r.max_activation_bytes, r.alloc_trace, r.events,
            [(p.label, p.phase, sorted(p.by_kind.items())) for p in r.timeline])


@pytest.mark.parametrize("opts,counted", SETUPS, ids=[f"{o['model']}-{o['checkpoint']}-{i}" for i, (o, _) in enumerate(SETUPS)])
def test_counted_stop_is_the_dry_runs(opts, counted, monkeypatch):
    exp = _exp(opts)
    runs = []
    dry = ck._dry_run
    monkeypatch.setattr(ck, "_dry_run", lambda *a: runs.append(1) or dry(*a))
    fast = _digest(exp)
    assert (len(runs) == 0) == counted  # the first forward counted it (or, where it cannot, a dry run)
    monkeypatch.setattr(ck, "CHECK_STOP", True)  # recompute asserts that the dry run agrees
    checked = _digest(exp)
    assert runs  # the dry runs ran
    assert checked == fast  # and the bytes are the same with or without them


def test_trailing_no_save_nodes_run_before_the_recompute(monkeypatch: pytest.MonkeyPatch) -> None:
    """Non-reentrant checkpointing recomputes at the first unpack (torch/utils/checkpoint.py
    ``_checkpoint_hook.unpack_hook``): PEFT's down_proj ends with ``* scaling``, ``result + lora_out`` and
    ``.to(bf16)``, which save nothing, so their backward runs first and the recompute holds the base path's
    bf16 gradient and the adapter path's fp32 gradient besides the incoming one (the residual add's gradient
    replaces it): (2 + 4) bytes per (B, T, d) element above the recompute-first order.
    source: tests/trace/test_hf_full_depth.py::test_lora_dropout_all_targets_under_checkpointing (the trace)."""
    from memcalc.core.spec import ExperimentSpec, LoraSpec, TrainingSpec
    from memcalc.inputs.data_files import load_named
    from memcalc.inputs.hf_config import from_hf_config
    from memcalc.inputs.profiles import get_profile
    from memcalc.validate.hf_grid import HF_ESTIMATOR_PROFILE, estimate_hf

    m = from_hf_config(load_named("hf_configs", "mistralai--Mistral-7B-v0.3"), "mistral").model_copy(
        update={"n_layers": 2})
    lora = LoraSpec(rank=16, alpha=32, targets=("q", "k", "v", "o", "gate", "up", "down"), dropout=0.05)
    tr = TrainingSpec(batch=1, seq=512, precision="bf16", checkpoint="full", lora=lora)
    exp = ExperimentSpec(name="mistral", model=m, training=tr, profile=get_profile(HF_ESTIMATOR_PROFILE))
    first_unpack, _ = estimate_hf(exp)
    monkeypatch.setattr(ck.FirstForward, "run_tail", lambda self, s, label: None)
    monkeypatch.setattr(ck.FirstForward, "hand_over", lambda self, s, sub: None)
    recompute_first, _ = estimate_hf(exp)
    assert first_unpack - recompute_first == (2 + 4) * 512 * m.d_model
