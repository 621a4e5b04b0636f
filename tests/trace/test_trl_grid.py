"""Issue 27's bar for TRL: ``memcalc estimate --framework trl`` within 2% of TRL's own SFT step traced on
meta (``memcalc validate --framework trl``: transformers + PEFT built as ``--framework hf`` builds them,
``SFTTrainer.compute_loss`` and ``add_fused_lm_head`` / ``ChunkedLogProbFunction`` of trl 1.16.0 run
unmodified; only the Triton launches, ``_use_triton`` / ``_addmm_fp32``'s device test and the label
mask's data-dependent sizes answered, validate/trainers/trl.py).

The grid: three families scaled down (Llama-, Qwen2- and GPT-2-shaped: RMSNorm/SwiGLU/RoPE/GQA, q/k/v
bias, tied head with LayerNorm/GELU/learned positions), 2 layers, width 128, vocabulary 2048 (the fused
head's tile is 32768 columns whatever the vocabulary: the trace checks that too); full fine-tuning and
LoRA and QLoRA (a bitsandbytes 4-bit base, SFTTrainer's own PEFT path); checkpointing none and full; the
fraction of tokens that reach the loss 1, 0.5 and 0.1 (``--loss-tokens``); activation offloading on and off
(TRL's own ``OffloadActivations``, validate/trl_offload.py); bf16 and fp32; batch and sequence varied; Liger's
layer kernels (``use_liger_kernel``: RoPE, RMSNorm, SwiGLU) on the Llama and Qwen2 shapes.

# source: each row is a trace of trl 1.16.0 + transformers 5.x + PEFT 0.2x on meta
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("trl")
pytest.importorskip("peft")

from memcalc.core.spec import ExperimentSpec, LoraSpec, TrainingSpec  # noqa: E402
from memcalc.inputs.presets import load_preset  # noqa: E402
from memcalc.inputs.profiles import profile_for, with_loss  # noqa: E402
from memcalc.validate.predict import estimate  # noqa: E402
from memcalc.validate.record import target_spec  # noqa: E402
from memcalc.validate.trainers import trl as trl_trainer  # noqa: E402

#: issue 27: "agree with memcalc estimate within 2% on the CI grids"
TOLERANCE_PCT = 2.0

#: (preset, its scaled-down shape: heads, kv heads, ff)
FAMILIES = (("tinyllama-1.1b", 4, 2, 256), ("qwen2.5-7b", 4, 2, 384), ("gpt2", 4, 4, 512))

#: (tuning, precision, checkpoint, loss tokens, offload, batch, seq): tuning full | qv | all
SETUPS = (
    ("full", "bf16", "none", 1.0, False, 2, 256),
    ("full", "bf16", "full", 0.5, False, 4, 128),
    ("full", "fp32", "none", 0.1, False, 1, 256),
    ("full", "bf16", "none", 0.5, True, 2, 128),
    ("qv", "bf16", "none", 1.0, False, 2, 256),
    ("qv", "bf16", "full", 0.1, False, 2, 128),
    ("qv", "fp32", "full", 0.5, False, 1, 256),
    ("all", "bf16", "none", 0.5, False, 4, 64),
    ("all", "bf16", "full", 1.0, True, 2, 128),
    ("qv", "bf16", "none", 0.1, True, 1, 256),
    ("full", "fp32", "full", 1.0, True, 2, 128),  # offloading: TRL's record_stream rule (the recompute keeps x)
)
#: with use_liger_kernel (Liger's RoPE, RMSNorm, SwiGLU; SFTTrainer turns its fused linear cross-entropy off), on
#: the families Liger patches (not GPT-2)
LIGER_SETUPS = (
    ("qv", "bf16", "none", 0.5, False, 2, 128),
    ("full", "bf16", "full", 1.0, False, 2, 128),
)

#: QLoRA (a bitsandbytes NF4 base as from_pretrained(quantization_config=...) loads it; SFTTrainer.__init__: no
#: prepare_model_for_kbit_training, enable_input_require_grads under checkpointing, the adapters cast to bf16), on
#: the Llama and Qwen2 shapes (GPT-2's Conv1D projections are not bitsandbytes linears)
QLORA_SETUPS = (
    ("qv", "bf16", "none", 1.0, False, 2, 256),
    ("all", "bf16", "full", 0.5, False, 2, 128),
)


def _model(preset: str, heads: int, kv: int, ff: int):
    m = load_preset(preset)
    return m.model_copy(update={"n_layers": 2, "d_model": 128, "n_heads": heads,
                                "n_kv_heads": kv if m.n_kv_heads else None, "d_ff": ff, "vocab_size": 2048,
                                "max_seq_len": 1024, "name": f"{preset}-tiny"})


def grid() -> list[tuple[str, ExperimentSpec]]:
    out = []
    for preset, heads, kv, ff in FAMILIES:
        m = _model(preset, heads, kv, ff)
        rows = [(s, "") for s in SETUPS]
        if preset != "gpt2":
            rows += [(s, "liger") for s in LIGER_SETUPS] + [(s, "qlora") for s in QLORA_SETUPS]
        for (tuning, prec, ck, frac, off, B, T), kind in rows:
            lora, liger = None, kind == "liger"
            if tuning != "full":
                qv = ("qkv",) if m.fused_qkv else ("q", "v")
                targets = qv if tuning == "qv" else tuple(t for t in m.lora_targets if t != "qkv" or m.fused_qkv)
                lora = LoraSpec(rank=8, alpha=16, targets=targets, dropout=0.0, qlora=kind == "qlora")
            tr = TrainingSpec(batch=B, seq=T, precision=prec, checkpoint=ck, lora=lora, activation_offload=off)
            upd: dict = {"loss_tokens": frac}
            if liger:
                upd.update(kernels="liger")  # all four; SFTTrainer's rule drops flce (memcalc.core.liger.liger_plan)
            prof = profile_for("trl").model_copy(update=upd)
            extra = (" offload" if off else "") + (" liger" if liger else "")
            name = f"{preset} {'qlora ' if kind == 'qlora' else ''}{tuning} {prec} ck={ck} tok={frac:g}{extra} {B}x{T}"
            out.append((name, ExperimentSpec(name=name, model=m, training=tr, profile=prof)))
    return out


#: rows whose gap is the Hugging Face path's, not TRL's (the same bytes missing when the setup is traced with
#: --framework hf): none at present (GPT-2's offload row closed with gelu_new's pow(x, 3) backward temporaries)
HF_RESIDUALS: dict[str, str] = {}

ITEMS = [(n, e) if n not in HF_RESIDUALS else
         pytest.param(n, e, marks=pytest.mark.xfail(strict=True, reason=HF_RESIDUALS[n])) for n, e in grid()]


@pytest.mark.parametrize("name,exp", ITEMS, ids=[n for n, _ in grid()])
def test_trl_estimate_matches_the_trl_trace(name, exp):
    meas = trl_trainer.measure(exp, "meta")
    assert meas.status == "ok", meas.reason
    predicted = estimate(target_spec(exp, None, "trl")).peak_bytes
    gap_pct = (predicted - meas.measured_bytes) / meas.measured_bytes * 100
    assert abs(gap_pct) <= TOLERANCE_PCT, (
        f"{name}: predicted {predicted:,} B, traced {meas.measured_bytes:,} B ({gap_pct:+.2f}%)")


def test_loss_tokens_move_the_traced_head():
    """Fewer loss tokens: fewer hidden rows projected (and a smaller tile): the traced peak falls, and by
    what the estimate says (within the tolerance of each)."""
    _, exp = grid()[0]
    lo = exp.model_copy(update={"profile": with_loss(exp.profile, loss_tokens=0.1)})
    a, b = trl_trainer.measure(exp, "meta"), trl_trainer.measure(lo, "meta")
    ea, eb = (estimate(target_spec(e, None, "trl")).peak_bytes for e in (exp, lo))
    assert b.measured_bytes < a.measured_bytes
    moved_trace, moved_est = a.measured_bytes - b.measured_bytes, ea - eb
    assert abs(moved_est - moved_trace) <= TOLERANCE_PCT / 100 * a.measured_bytes


# (training update, what the refusal names): source: validate/trainers/trl.py why_not
REFUSED = [
    ({"precision": "amp-bf16"}, "AMP is not traced"),
    ({"lora": LoraSpec(rank=8, alpha=16, targets=("q", "v"), qlora=True, dora=True)}, "QLoRA with DoRA is not traced"),
    ({"lora": LoraSpec(rank=8, alpha=16, targets=("q", "v", "head"))}, "LoRA on the head is bypassed"),
]


@pytest.mark.parametrize("update,message", REFUSED, ids=[m for _, m in REFUSED])
def test_what_the_trl_trace_refuses_is_one_line(update, message):
    from memcalc.core.errors import UserError

    _, exp = grid()[0]
    bad = exp.model_copy(update={"training": exp.training.model_copy(update=update)})
    with pytest.raises(UserError, match=message):
        trl_trainer.check(bad)
    assert trl_trainer.measure(bad, "meta").status == "skipped"


def test_the_trace_runs_trls_own_offloading():
    """``--activation-offload`` traces trl 1.16.0's ``OffloadActivations`` itself (validate/trl_offload.py), with
    its storage keys working on meta: two activations are two storages (each offloaded), a second save of one is
    its dedup (kept), and ``weight.t()`` is a parameter storage (kept); with every ``data_ptr()`` 0, the second
    activation would be taken for the first and kept on the device."""
    import torch
    from trl.models.activation_offloading import OffloadActivations

    from memcalc.core.kernels import pinned_bytes
    from memcalc.validate.trl_offload import MetaOffload

    with torch.device("meta"):
        model = torch.nn.Module()
        model.lin = torch.nn.Linear(64, 64, bias=False)
        model.lm_head = torch.nn.Linear(64, 8, bias=False)
    meta = MetaOffload()
    ctx = meta.build(model)
    assert type(ctx) is OffloadActivations
    x = torch.empty(32, 64, device="meta", requires_grad=True)
    with meta.patches():
        ctx.__enter__()
        h = model.lin(x)  # saves weight.t() and x
        z = h * h  # saves h twice
        offloaded = [v[1] for v in ctx.tracker.values()]
        z.sum().backward()
        ctx.__exit__(None, None, None)
    assert offloaded == [False, True, True, False]
    assert meta.host.max_pinned_bytes == 2 * pinned_bytes(32 * 64 * 4)
