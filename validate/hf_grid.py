"""A grid of Hugging Face setups: the traced HF step (:func:`~.hf_runner.measure_hf`) beside memcalc's
estimate of the same ExperimentSpec, one row per setup, the gap per row.

Run ``python -m memcalc.validate.hf_grid`` (``--json`` for the records, ``--only llama`` to filter by
name). The models are the shipped presets of each family at full width and vocabulary, scaled down in
depth (4 layers); a meta trace costs the same at any size (about 1.5 s a row).

The estimator side is one function, :func:`~.record.hf_estimator_spec`: the ExperimentSpec the estimate
is computed for (through :mod:`memcalc.api`: :mod:`.predict`). Until the estimator knows the HF
framework rules it is the spec with the ``hf-torch-2.8-cuda`` profile (HF's RMSNorm and fp32 loss
upcast); switch it there.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from memcalc.core.spec import ExperimentSpec, LoraSpec, ModelSpec, TrainingSpec
from memcalc.inputs.profiles import get_profile

from .record import hf_estimator_spec

#: the profile the HF trace is compared with, until the estimator has framework rules
HF_ESTIMATOR_PROFILE = "hf-torch-2.8-cuda"


def estimate_hf(exp: ExperimentSpec) -> tuple[int, str]:
    """(peak bytes, peak phase) of memcalc's estimate of the HF step of ``exp``."""
    from .predict import estimate

    est = estimate(hf_estimator_spec(exp))
    return est.peak_bytes, est.peak_phase


def hf_gap(name: str, exp: ExperimentSpec) -> tuple[float, str]:
    """The estimate's gap to the HF trace of ``exp`` on meta, in percent, and a line naming both numbers
    (what every HF-path grid test asserts). A trace that did not run is an AssertionError with its reason."""
    from .hf_runner import measure_hf

    meas = measure_hf(exp, "meta")
    assert meas.status == "ok" and meas.measured_bytes is not None, meas.reason
    predicted, _phase = estimate_hf(exp)
    gap_pct = (predicted - meas.measured_bytes) / meas.measured_bytes * 100
    return gap_pct, f"{name}: predicted {predicted:,} B, traced {meas.measured_bytes:,} B ({gap_pct:+.2f}%)"


# -- the models: the shipped presets' widths and vocabularies, 4 layers ----------------------------
PRESETS = ("llama-3.1-8b", "tinyllama-1.1b", "mistral-7b", "qwen2.5-7b", "gpt2", "phi-1.5")
LAYERS = 4

ALL = ("q", "k", "v", "o", "gate", "up", "down")

#: (tuning, precision, checkpoint, lora dropout, batch, seq); tuning: full | qv | all; seq is capped
#: at the model's maximum (gpt2: 1024)
SETUPS = (
    ("full", "fp32", "none", 0.0, 1, 2048),
    ("full", "bf16", "none", 0.0, 4, 2048),
    ("full", "amp-bf16", "none", 0.0, 2, 2048),
    ("full", "bf16", "full", 0.0, 8, 2048),
    ("qv", "bf16", "none", 0.0, 2, 2048),
    ("qv", "bf16", "none", 0.05, 1, 1024),
    ("all", "bf16", "full", 0.05, 2, 1024),
    ("all", "amp-bf16", "none", 0.0, 1, 1024),
    ("qv", "fp32", "full", 0.05, 1, 512),
    ("all", "bf16", "none", 0.0, 4, 512),
    ("qv", "amp-bf16", "full", 0.05, 2, 2048),
)


def models() -> list[ModelSpec]:
    """The presets of :data:`PRESETS` with :data:`LAYERS` layers."""
    from memcalc.inputs.presets import load_preset

    return [load_preset(n).model_copy(update={"n_layers": LAYERS}) for n in PRESETS]


def grid(only: Optional[str] = None) -> list[tuple[str, ExperimentSpec]]:
    """The setups (name, spec); ``only`` keeps names containing it."""
    out = []
    for m in models():
        for tuning, prec, ck, drop, B, T in SETUPS:
            T = min(T, m.max_seq_len)
            lora = None
            if tuning != "full":
                # GPT-2 fuses q, k, v in c_attn: its "q,v" is the whole c_attn (one adapter)
                qv = ("qkv",) if m.fused_qkv else ("q", "v")
                targets = qv if tuning == "qv" else tuple(t for t in ALL if t in m.lora_targets)
                lora = LoraSpec(rank=16, alpha=32, targets=targets, dropout=drop)
            tr = TrainingSpec(batch=B, seq=T, precision=prec, checkpoint=ck, lora=lora)
            name = f"{m.name} {tuning}{'' if lora is None else f' d{drop:g}'} {prec} ck={ck} {B}x{T}"
            if only is None or only in name:
                out.append((name, ExperimentSpec(name=name, model=m, training=tr, profile=get_profile(HF_ESTIMATOR_PROFILE))))
    return out


# -- QLoRA (issue 28): a bitsandbytes 4-bit base, PEFT's prepare_model_for_kbit_training, LoRA ----------------
QLORA_PRESETS = ("llama-3.1-8b", "mistral-7b", "qwen2.5-7b")
QLORA_LAYERS = 2

#: (rank, targets, checkpoint, double quantisation, precision, qlora_fp32_cast, lora dropout, batch, seq):
#: per family, rank 16/64 x checkpoint none/full x double quantisation on/off, in bf16 (no autocast) and
#: amp-bf16 (Trainer bf16=True: autocast), with and without the fp32 casts
QLORA_SETUPS = (
    (16, "all", "none", True, "bf16", True, 0.0, 2, 1024),
    (64, "all", "full", False, "bf16", True, 0.05, 1, 2048),
    (16, "qv", "full", True, "amp-bf16", True, 0.05, 4, 512),
    (64, "qv", "none", False, "amp-bf16", False, 0.0, 1, 1024),
    (16, "all", "full", False, "bf16", False, 0.0, 2, 1024),
)


def qlora_grid(only: Optional[str] = None) -> list[tuple[str, ExperimentSpec]]:
    """The QLoRA setups (name, spec) over :data:`QLORA_PRESETS` at :data:`QLORA_LAYERS` layers, with
    the HF profile (its ``qlora_fp32_cast`` set per setup); ``only`` keeps names containing it."""
    from memcalc.inputs.presets import load_preset

    out = []
    for preset in QLORA_PRESETS:
        m = load_preset(preset).model_copy(update={"n_layers": QLORA_LAYERS})
        for rank, tuning, ck, dq, prec, cast, drop, B, T in QLORA_SETUPS:
            targets = ("q", "v") if tuning == "qv" else tuple(t for t in ALL if t in m.lora_targets)
            lora = LoraSpec(rank=rank, alpha=2 * rank, targets=targets, dropout=drop, qlora=True, double_quant=dq)
            tr = TrainingSpec(batch=B, seq=T, precision=prec, checkpoint=ck, lora=lora)
            profile = get_profile(HF_ESTIMATOR_PROFILE).model_copy(update={"qlora_fp32_cast": cast})
            name = (f"{m.name} qlora r{rank} {tuning} d{drop:g} {'dq' if dq else 'no-dq'} {prec} "
                    f"{'fp32-cast' if cast else 'no-cast'} ck={ck} {B}x{T}")
            if only is None or only in name:
                out.append((name, ExperimentSpec(name=name, model=m, training=tr, profile=profile)))
    return out


# -- modules_to_save (issue 28): PEFT's ModulesToSaveWrapper beside LoRA ----------------------------------------
#: (preset, modules, precision, checkpoint, qlora): untied (TinyLlama, GPT-2's wte / lm_head) and tied
#: (Llama 3.2 1B: a copy of lm_head is a new untied weight; a copy of embed_tokens leaves the head on the
#: frozen original) models, bf16 / fp32 / AMP, checkpointing, a 4-bit base (the copies of fp32-cast modules)
MODULES_TO_SAVE_SETUPS = (
    ("tinyllama-1.1b", ("embed_tokens", "lm_head"), "bf16", "none", False),
    ("llama-3.2-1b", ("lm_head",), "bf16", "full", False),
    ("llama-3.2-1b", ("embed_tokens",), "amp-bf16", "none", False),
    ("gpt2", ("embed_tokens", "lm_head"), "fp32", "none", False),
    ("tinyllama-1.1b", ("embed_tokens", "lm_head"), "bf16", "full", True),
)


def modules_to_save_grid(only: Optional[str] = None) -> list[tuple[str, ExperimentSpec]]:
    """LoRA q,v (GPT-2: its c_attn) rank 16 with ``modules_to_save``, one layer, 2 x 256 tokens: the
    rows of :data:`MODULES_TO_SAVE_SETUPS` with the HF profile; ``only`` keeps names containing it."""
    from memcalc.inputs.presets import load_preset

    out = []
    for preset, save, prec, ck, qlora in MODULES_TO_SAVE_SETUPS:
        m = load_preset(preset).model_copy(update={"n_layers": 1})
        targets = ("qkv",) if m.fused_qkv else ("q", "v")
        lora = LoraSpec(rank=16, alpha=32, targets=targets, qlora=qlora, modules_to_save=save)
        tr = TrainingSpec(batch=2, seq=256, precision=prec, checkpoint=ck, lora=lora)
        name = f"{m.name} {'qlora' if qlora else 'lora'} save={','.join(save)} {prec} ck={ck} 2x256"
        if only is None or only in name:
            profile = get_profile(HF_ESTIMATOR_PROFILE)
            out.append((name, ExperimentSpec(name=name, model=m, training=tr, profile=profile)))
    return out


def run_grid(items: list[tuple[str, ExperimentSpec]], device: str = "meta", progress=None) -> list[dict]:
    """One record per setup: measured (HF trace) and predicted bytes, the gap in percent, phases."""
    from .hf_runner import measure_hf

    rows = []
    for k, (name, exp) in enumerate(items):
        if progress:
            progress(f"[{k + 1}/{len(items)}] {name}")
        meas = measure_hf(exp, device)
        try:
            pred, phase = estimate_hf(exp)
        except Exception as e:  # an unsupported combination is reported beside the measurement
            pred, phase = None, f"no estimate: {e}"
        gap = (None if not meas.measured_bytes or pred is None
               else round((pred - meas.measured_bytes) / meas.measured_bytes * 100, 2))
        rows.append(dict(config=name, status=meas.status, reason=meas.reason, measured_bytes=meas.measured_bytes,
                         predicted_bytes=pred, error_pct=gap, measured_phase=meas.peak_phase, peak_phase=phase,
                         first_step_bytes=meas.first_step_bytes))
    return rows


def table(rows: list[dict]) -> str:
    """A Markdown table of the rows (MiB = 2**20)."""
    from memcalc.core.units import MiB

    lines = ["| setup | measured MiB | predicted MiB | gap | measured phase | predicted phase |",
             "|---|---:|---:|---:|---|---|"]
    for r in rows:
        meas = "-" if r["measured_bytes"] is None else f"{r['measured_bytes'] / MiB:.1f}"
        gap = "-" if r["error_pct"] is None else f"{r['error_pct']:+.2f}%"
        pred = "-" if r["predicted_bytes"] is None else f"{r['predicted_bytes'] / MiB:.1f}"
        lines.append(f"| {r['config']} | {meas} | {pred} | {gap} | "
                     f"{r['measured_phase'] or r['status']} | {r['peak_phase']} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="keep setups whose name contains this")
    ap.add_argument("--json", action="store_true", help="print the records as JSON")
    ap.add_argument("--qlora", action="store_true", help="the QLoRA grid (qlora_grid) instead")
    ap.add_argument("--modules-to-save", action="store_true", help="the modules_to_save grid instead")
    args = ap.parse_args(argv)
    which = qlora_grid if args.qlora else modules_to_save_grid if args.modules_to_save else grid
    rows = run_grid(which(args.only), progress=lambda s: print(s, file=sys.stderr))
    print(json.dumps(rows, indent=2) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
