"""``memcalc validate --gpus N --zero {2,3} --sharding {fsdp2,fsdp1} [--rank R]``: one rank's record.

The record is validate's (``validate/record.py`` ``make_record``: ``predicted_bytes`` is the
estimate of the same ``ExperimentSpec``, per rank) plus the fields of :data:`FIELDS`:
``sharding``, ``gpus``, ``zero``, ``rank``, ``mixed_precision`` (what ran: ``fsdp2.precision_plan``),
``reshard_after_forward`` (FSDP2) / ``strategy`` (FSDP1), ``baseline_bytes`` (alive when the
measured step starts: shards, optimizer state, batch), ``fsdp_tracker_bytes`` with its note
(``FSDPMemTracker``'s peak over both steps, FSDP2 only: it counts DTensor's sharding-propagation
temporaries of step 1, so it sits above ``measured_bytes``) and ``kernels``.
``device`` meta or cpu both mean the fake-tensor trace on ``cpu`` (nothing is allocated).
"""

from __future__ import annotations

from typing import Callable, Optional

from memcalc.core.errors import UserError
from memcalc.core.spec import ExperimentSpec

from ..step import Measurement, error_reason
from .runner import PHASES, TRACED, check_sharded, trace_rank

#: the record's fields beyond validate's own
FIELDS = ("sharding", "gpus", "zero", "rank", "mixed_precision", "reshard_after_forward", "strategy",
          "baseline_bytes", "fsdp_tracker_bytes", "fsdp_tracker_note", "kernels")


def check_sharded_run(items: list, device: Optional[str], framework: str, rank: int) -> None:
    """One clear line for what the sharded trace cannot run, before any trace starts."""
    import torch

    for _name, exp in items:
        if not isinstance(exp, ExperimentSpec):
            continue
        tr = exp.training
        if device == "cuda":
            found = torch.cuda.device_count() if torch.cuda.is_available() else 0
            raise UserError(f"--gpus {tr.gpus} --device cuda: validate runs one process and cannot measure {tr.gpus} "
                            f"ranks on CUDA ({found} CUDA device{'s' if found != 1 else ''} here); trace one rank "
                            "with --device meta")
        if not 0 <= rank < tr.gpus:
            raise UserError(f"--rank {rank} is not a rank of --gpus {tr.gpus} (valid: 0..{tr.gpus - 1})")
        if tr.sharding == "deepspeed":  # DeepSpeed's own engine, rank 0 (deepspeed_trace.py), not the FSDP tracer
            continue
        sharding = check_sharded(exp)
        if framework == "hf" and sharding == "fsdp1" and tr.lora is not None and tr.lora.qlora:
            from .hf_fsdp1_qlora import check

            check(exp)


def measure_sharded(exp: ExperimentSpec, device: str, rank: int = 0, scale_layers: Optional[int] = None,
                    progress: Optional[Callable[[str], None]] = None, framework: str = "plain") -> tuple[Measurement, dict]:
    """Trace rank ``rank`` of ``exp`` (``runner.trace_rank``, with FSDPMemTracker on FSDP2): the
    Measurement validate's record is made from, and the sharded fields (:data:`FIELDS`)."""
    meas = Measurement(device=device, framework=framework)
    if framework == "hf":
        from ..hf_runner import library_versions

        meas.transformers_version, meas.peft_version = library_versions()
    tr = exp.training
    extra: dict = {"sharding": tr.sharding, "gpus": tr.gpus, "zero": tr.zero, "rank": rank}
    try:
        r = trace_rank(exp, rank, scale_layers, fsdp_tracker=tr.sharding == "fsdp2", progress=progress,
                       framework=framework)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - a setup that fails is its record; the run goes on
        meas.status, meas.reason = "error", error_reason(e)
        return meas, extra
    meas.measured_bytes = r["peak_bytes"]
    meas.first_step_bytes = r["first_step_bytes"]
    meas.peak_phase = r["phase"]
    meas.peak_label = r["label"]
    meas.phase_peaks = {k: v for k, v in r["phase_peaks"].items() if k in PHASES}
    meas.layers, meas.params, meas.seconds = r["layers"], r["params"], r["seconds"]
    extra.update({k: r[k] for k in FIELDS if k in r})
    return meas, extra


__all__ = ["FIELDS", "TRACED", "check_sharded_run", "measure_sharded"]
