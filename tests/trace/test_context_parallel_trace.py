"""Context parallelism: the estimate against torch's ring attention traced on one rank of the fake process group.

Each row builds memcalc's replica, runs its SDPA through torch 2.13's ``context_parallel`` pieces (load-balanced
ring, all-gather rotater; ``validate/sharded/context_parallel.py``) and traces the rank the estimate simulates
(``memcalc.core.ring_attention.worst_rank``); the estimate of the same spec must be within :data:`TOLERANCE_PCT`.
Small shapes (d_model 256, 2 layers, vocab 1024) so each trace takes about two seconds.
"""

from __future__ import annotations

import pytest

from memcalc.core.spec import ExperimentSpec, ModelSpec, TrainingSpec
from memcalc.estimate.peak import estimate

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")

#: issue 31: "agrees within 2% on a CI grid"
TOLERANCE_PCT = 2.0


def spec(cp: int, kv: int = 4, seq: int = 512, batch: int = 2, **tr) -> ExperimentSpec:
    m = ModelSpec(name="tiny-llama", n_layers=2, d_model=256, n_heads=8, n_kv_heads=kv, d_ff=704,
                  vocab_size=1024, max_seq_len=8192)
    return ExperimentSpec(model=m, training=TrainingSpec(batch=batch, seq=seq, cp=cp, precision="bf16", **tr))


# (cp, kv heads, training fields, where the trace peaks)
ROWS = [
    (2, 4, {}, "backward layer 1"),  # source: trace, -0.01%: the ring's backward (repeat_kv's contiguous K/V)
    (4, 8, {}, "backward layer 1"),  # source: trace, -0.01%: K/V transposed views (key.contiguous() copies)
    (2, 4, {"checkpoint": "full"}, "backward layer 0"),  # source: trace, -0.01%: the ring recomputed
    (8, 8, {"batch": 1, "seq": 1024}, ""),  # source: trace, -0.01%: 8 ranks, 7 partial steps on rank 0
]


@pytest.mark.parametrize("cp,kv,tr,where", ROWS)
def test_estimate_matches_traced_ring_rank(cp, kv, tr, where):
    from memcalc.validate.sharded.context_parallel import measure_cp

    tr = dict(tr)
    exp = spec(cp, kv, seq=tr.pop("seq", 512), batch=tr.pop("batch", 2), **tr)
    meas = measure_cp(exp)
    assert meas.status == "ok", meas.reason
    assert where in f"{meas.peak_phase} {meas.peak_label}"
    est = estimate(exp).peak_bytes
    gap = 100 * (est - meas.measured_bytes) / meas.measured_bytes
    assert abs(gap) <= TOLERANCE_PCT, (f"cp {cp} kv {kv} {tr}: estimate {est:,} vs traced {meas.measured_bytes:,} "
                                       f"({gap:+.2f}%, {meas.peak_phase} {meas.peak_label})")


# (cp, kv heads, training fields): DeepSpeed 0.19's DistributedAttention around the kernel (validate/sharded/
# context_parallel.py ulysses_sdpa), vocab 256 so that attention and its all-to-alls are near the peak
ULYSSES_ROWS = [
    (2, 4, {"seq": 1024}),  # source: trace, -0.01%: repeat_kv's copies (transposed: pre_all2all_fun copies them)
    (4, 8, {"seq": 1024}),  # source: trace, -0.01%: K/V contiguous in (B, S, H, D): no pre-copy
    (2, 4, {"precision": "fp32"}),  # source: trace, -0.00%: the memory-efficient kernel on the gathered heads
    (2, 4, {"checkpoint": "full"}),  # source: trace, -0.01%: the all-to-alls recomputed
]


@pytest.mark.parametrize("cp,kv,tr", ULYSSES_ROWS)
def test_estimate_matches_traced_ulysses_rank(cp, kv, tr):
    from memcalc.validate.sharded.context_parallel import measure_cp

    tr = {"precision": "bf16", "seq": 512, **tr}
    m = ModelSpec(name="tiny-llama", n_layers=2, d_model=256, n_heads=8, n_kv_heads=kv, d_ff=704, vocab_size=256,
                  max_seq_len=8192)
    exp = ExperimentSpec(model=m, training=TrainingSpec(batch=2, cp=cp, cp_method="ulysses", **tr))
    meas = measure_cp(exp)
    assert meas.status == "ok", meas.reason
    est = estimate(exp).peak_bytes
    gap = 100 * (est - meas.measured_bytes) / meas.measured_bytes
    assert abs(gap) <= TOLERANCE_PCT, (f"ulysses cp {cp} kv {kv} {tr}: estimate {est:,} vs traced "
                                       f"{meas.measured_bytes:,} ({gap:+.2f}%, {meas.peak_phase} {meas.peak_label})")


def test_ulysses_trace_restores_only_what_it_set(monkeypatch):
    """RANK / WORLD_SIZE / ... (context_parallel.ulysses_env) each back as it was: a value given before
    comes back, one unset is deleted; a variable something else set during the trace stays (the whole
    environment used to be put back, deleting what libraries set on import)."""
    import os

    from memcalc.validate.sharded import context_parallel as cpm

    monkeypatch.setenv("RANK", "5")
    for key in cpm.ULYSSES_ENV_KEYS[1:]:
        monkeypatch.delenv(key, raising=False)
    trace = cpm._trace

    def traced(*args, **kwargs):
        os.environ["MEMCALC_SET_DURING_TRACE"] = "1"
        return trace(*args, **kwargs)

    monkeypatch.setattr(cpm, "_trace", traced)
    monkeypatch.delenv("MEMCALC_SET_DURING_TRACE", raising=False)
    m = ModelSpec(name="tiny-llama", n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=64,
                  max_seq_len=256)
    exp = ExperimentSpec(model=m, training=TrainingSpec(batch=1, seq=64, cp=2, cp_method="ulysses"))
    assert cpm.measure_cp(exp).status == "ok"
    assert os.environ["RANK"] == "5"
    assert not [k for k in cpm.ULYSSES_ENV_KEYS[1:] if k in os.environ]
    assert os.environ["MEMCALC_SET_DURING_TRACE"] == "1"


# context parallelism x FSDP2: fully_shard over the flattened dp x cp mesh (torchtitan's dp_shard_cp), traced as
# the FSDP2 x TP harness traces (fake tensors on cpu); the estimate shards over gpus x cp
# (engine.context_parallel.shard_group)
FSDP_ROWS = [
    ("ring", {"zero": 3, "gpus": 2}),  # source: trace, -0.01%: a 2 x 2 mesh, ZeRO-3 over 4 ranks
    ("ulysses", {"zero": 3}),  # source: trace, -0.03%: ZeRO-3 over the 2 cp ranks alone
    # source: trace, -0.07%: torchtitan's apply_tp (tp 2, sequence parallel) under the ring, a 1 x 2 x 2 mesh; the
    # ring on tp-local heads (TP's ignored ids mask of the vocabulary-parallel embedding: engine.tensor_parallel)
    ("ring", {"tp": 2, "sequence_parallel": True}),
]


#: the cp x TP trace runs in a fresh interpreter: after an FSDP2 x TP trace in the same process
#: (tests/trace/test_tp.py's 2-D rows, on the same xdist worker) it fails with the RoPE table at the
#: cp-local length against a query of twice it (torch state that outlives the fake process group, not
#: DTensor's sharding-propagation cache; not found yet)
FRESH = """
import json, sys
from memcalc.core.spec import ExperimentSpec
from memcalc.validate.sharded.context_parallel import measure_cp
m = measure_cp(ExperimentSpec.model_validate_json(sys.stdin.read()))
print(json.dumps({"status": m.status, "reason": m.reason, "measured_bytes": m.measured_bytes}))
"""


def _measure_cp_fresh(exp: ExperimentSpec):
    import json
    import subprocess
    import sys
    from types import SimpleNamespace

    out = subprocess.run([sys.executable, "-c", FRESH], input=exp.model_dump_json(), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return SimpleNamespace(**json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("method,tr", FSDP_ROWS)
def test_estimate_matches_traced_cp_x_fsdp2_rank(method, tr):
    from memcalc.validate.sharded.context_parallel import measure_cp

    exp = spec(2, cp_method=method, **tr)
    meas = _measure_cp_fresh(exp) if tr.get("tp") else measure_cp(exp)
    assert meas.status == "ok", meas.reason
    est = estimate(exp).peak_bytes
    gap = 100 * (est - meas.measured_bytes) / meas.measured_bytes
    assert abs(gap) <= TOLERANCE_PCT, f"{method} {tr}: estimate {est:,} vs traced {meas.measured_bytes:,} ({gap:+.2f}%)"


def test_the_simulated_rank_holds_most():
    # source: trace: the estimate simulates worst_rank's rank; rank 0 (no step on the whole q after the first)
    # and the last rank (no partial step) hold no more
    from memcalc.core.ring_attention import ring_shapes, worst_rank
    from memcalc.validate.sharded.context_parallel import measure_cp

    exp = spec(4, 8)
    est = estimate(exp).peak_bytes
    worst = worst_rank(4, ring_shapes(exp))
    peaks = {r: measure_cp(exp, rank=r).measured_bytes for r in sorted({0, worst, 3})}
    assert max(peaks.values()) == peaks[worst]
    assert abs(100 * (est - peaks[worst]) / peaks[worst]) <= TOLERANCE_PCT
