"""A grid of Liger-Kernel setups (``--kernels liger``): the real transformers + PEFT step with Liger applied
as the Trainer applies it, traced on meta (:func:`~.hf_runner.measure_hf`, :mod:`.hf_liger`), beside memcalc's
estimate of the same spec; one row per setup, the gap per phase.

Run ``python -m memcalc.validate.kernels_grid`` (``--only gemma`` to filter by name) for the table in
``docs/kernels.md``. The models are scaled down so that activations, not weights, set the peaks and a row
traces in about a second: Llama, Mistral and Qwen2 at width 256 (4 heads, 2 KV heads, MLP 704, vocabulary
8192: FLCE runs 32 chunks of 64 rows), one layer; Gemma is google/gemma-2b's published config.json
(``data/hf_configs``) at one layer (the family builds only from its file).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from memcalc.core.spec import ExperimentSpec, LoraSpec, ModelSpec, TrainingSpec
from memcalc.inputs.profiles import get_profile

from .record import hf_estimator_spec

#: the HF profile the trace is compared with (hf_grid.HF_ESTIMATOR_PROFILE), with kernels liger
PROFILE = "hf-torch-2.8-cuda"
ALL = ("q", "k", "v", "o", "gate", "up", "down")
#: (tuning, checkpoint, precision, liger_ops, batch, seq)
SETUPS = (
    ("full", "none", "bf16", None, 2, 1024),
    ("full", "full", "bf16", None, 2, 1024),
    ("qv", "none", "bf16", None, 2, 1024),
    ("qv", "full", "bf16", None, 4, 512),
    ("all", "none", "bf16", None, 2, 1024),
    ("all", "full", "bf16", None, 2, 1024),
    ("full", "none", "fp32", None, 1, 1024),
    ("qv", "none", "bf16", ("flce",), 2, 1024),
)


def models() -> list[ModelSpec]:
    """Llama, Mistral, Qwen2 scaled down (named so the family is the name's); Gemma-2B's config at one layer."""
    from memcalc.inputs.data_files import load_file
    from memcalc.inputs.hf_config import from_hf_config
    from memcalc.inputs.presets import load_preset

    small = dict(n_layers=1, d_model=256, n_heads=4, n_kv_heads=2, head_dim=None, d_ff=704, vocab_size=8192)
    out = [load_preset(p).model_copy(update=dict(small, name=n))
           for p, n in (("llama-3.1-8b", "llama-mini"), ("mistral-7b", "mistral-mini"), ("qwen2.5-7b", "qwen2-mini"))]
    gemma = from_hf_config(load_file("hf_configs/google--gemma-2b.json"), "gemma-2b")
    return [*out, gemma.model_copy(update={"n_layers": 1})]


def grid(only: Optional[str] = None) -> list[tuple[str, ExperimentSpec]]:
    """The setups (name, spec); ``only`` keeps names containing it."""
    out = []
    for m in models():
        for tuning, ck, prec, ops, B, T in SETUPS:
            lora = None
            if tuning != "full":
                targets = ("q", "v") if tuning == "qv" else ALL
                lora = LoraSpec(rank=16, alpha=32, targets=targets)
            tr = TrainingSpec(batch=B, seq=T, precision=prec, checkpoint=ck, lora=lora)
            upd: dict = {"kernels": "liger"}
            if ops is not None:
                upd["liger_ops"] = ops
            prof = get_profile(PROFILE).model_copy(update=upd)
            name = f"{m.name} {tuning} {prec} ck={ck}{'' if ops is None else ' ' + '+'.join(ops)} {B}x{T}"
            if only is None or only in name:
                out.append((name, ExperimentSpec(name=name, model=m, training=tr, profile=prof)))
    return out


def estimate_phases(exp: ExperimentSpec) -> tuple[int, dict[str, int]]:
    """(peak, per-phase peaks) of memcalc's estimate of the traced spec."""
    from .predict import estimate

    est = estimate(hf_estimator_spec(exp))
    return est.peak_bytes, dict(est.phases)


def run_grid(items: list[tuple[str, ExperimentSpec]], progress=None) -> list[dict]:
    """One record per setup: traced and estimated bytes (peak and per phase), the gaps in percent."""
    from .hf_runner import measure_hf

    rows = []
    for k, (name, exp) in enumerate(items):
        if progress:
            progress(f"[{k + 1}/{len(items)}] {name}")
        meas = measure_hf(exp, "meta")
        pred, phases = estimate_phases(exp)
        rows.append(dict(config=name, status=meas.status, reason=meas.reason, measured_bytes=meas.measured_bytes,
                         predicted_bytes=pred, measured_phases=meas.phase_peaks, predicted_phases=phases,
                         error_pct=gap(pred, meas.measured_bytes)))
    return rows


def gap(pred: Optional[int], meas: Optional[int]) -> Optional[float]:
    return None if not meas or pred is None else round((pred - meas) / meas * 100, 2)


def table(rows: list[dict]) -> str:
    """A Markdown table of the rows (MiB = 2**20): the peak and the forward and backward phases."""
    from memcalc.core.units import MiB

    lines = ["| setup | traced MiB | estimated MiB | gap | forward gap | backward gap |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        mp, pp = r["measured_phases"], r["predicted_phases"]
        fg, bg = (gap(pp.get(p), mp.get(p)) for p in ("forward", "backward"))
        lines.append(f"| {r['config']} | {r['measured_bytes'] / MiB:.1f} | {r['predicted_bytes'] / MiB:.1f} | "
                     f"{r['error_pct']:+.2f}% | {fg:+.2f}% | {bg:+.2f}% |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="keep setups whose name contains this")
    args = ap.parse_args(argv)
    print(table(run_grid(grid(args.only), progress=lambda s: print(s, file=sys.stderr))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
