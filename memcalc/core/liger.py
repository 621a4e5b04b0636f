"""Liger-Kernel (``--kernels liger``): which of its kernels apply to a model, and the constants of its
Python that decide what it allocates. The estimator (:mod:`memcalc.engine.blocks.liger`) and the validator
(``validate/hf_liger.py``) both read these.

Source: liger_kernel 0.8.5. transformers' Trainer applies it with
``_apply_liger_kernel_to_instance(model, **liger_kernel_config)`` (transformers 5.24
``integrations/liger.py`` ``apply_liger_kernel``), which calls ``apply_liger_kernel_to_<model_type>``
(``transformers/monkey_patch.py`` ``MODEL_TYPE_TO_APPLY_LIGER_FN``). For the families modelled here
(:data:`LIGER_FAMILIES`) each applies, by default, all of:

- ``rope``: ``apply_rotary_pos_emb = liger_rotary_pos_emb`` (``ops/rope.py`` ``LigerRopeFunction``);
- ``rms_norm``: ``_patch_rms_norm_module`` on every norm (``ops/rms_norm.py`` ``LigerRMSNormFunction``):
  llama / mistral / qwen2 ``casting_mode="llama", offset=0.0, in_place=True``; gemma
  ``casting_mode="gemma", offset=1.0`` (``apply_liger_kernel_to_gemma``);
- the gated MLP: ``LigerSwiGLUMLP`` (``ops/swiglu.py`` ``LigerSiLUMulFunction``) for the SiLU families,
  ``LigerGEGLUMLP`` (``ops/geglu.py`` ``LigerGELUMulFunction``) for gemma;
- ``fused_linear_cross_entropy``: ``lce_forward`` as the CausalLM's forward
  (``ops/fused_linear_cross_entropy.py`` ``LigerFusedLinearCrossEntropyFunction``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

from memcalc.core.errors import UserError
from memcalc.core.spec import KernelProfile, ModelSpec, TrainingSpec

#: HF model_type -> its gated MLP's Liger kernel (monkey_patch.py apply_liger_kernel_to_llama / _mistral /
#: _qwen2: swiglu; apply_liger_kernel_to_gemma: geglu)
LIGER_FAMILIES = {"llama": "swiglu", "mistral": "swiglu", "qwen2": "swiglu", "gemma": "geglu"}

#: the kernels ``liger_ops`` names, as the apply functions' keyword arguments (``glu`` is ``swiglu`` or ``geglu``)
LIGER_OPS = ("rope", "rms_norm", "glu", "flce")


class Gpu(NamedTuple):
    """What liger's Python asks of the GPU: ``torch.cuda.get_device_capability`` and the SM count
    (``get_device_properties(...).multi_processor_count``)."""

    name: str
    capability: tuple[int, int]
    sm_count: int


#: The GPU liger's device queries are answered for: an H100 SXM (sm90, 132 SMs). RMSNorm's backward
#: allocates ``(sm_count, H)`` fp32 partial weight gradients (rms_norm.py ``rms_norm_backward``); FLCE
#: accumulates the head's gradient with ``addmm(out=)`` from capability 8.0 on.
LIGER_GPU = Gpu("NVIDIA H100 80GB HBM3", (9, 0), 132)

#: fused_linear_cross_entropy.py ``_CHUNK_MEM_CONST``: the transient logits are bounded to about BT x H
CHUNK_MEM_CONST = 1


@dataclass(frozen=True)
class LigerPlan:
    """The Liger kernels that replace the model's code, with their settings."""

    rope: bool
    rms_norm: bool
    #: ``swiglu``, ``geglu`` or None (the MLP is transformers' own)
    glu: Optional[str]
    flce: bool
    #: rms_norm.py casting mode: ``llama`` (only rstd in fp32) or ``gemma`` (all in fp32); rstd is fp32 in both
    casting: str = "llama"
    #: LigerRMSNorm ``in_place``: the backward writes dX into dY (True for the families here)
    in_place: bool = True


def _family(m: ModelSpec) -> str:
    """``llama`` (the SiLU families: llama, mistral, qwen2) or ``gemma``, from the model's shape; a one-line
    UserError for a shape outside them."""
    plain = (m.norm == "rmsnorm" and m.norm_placement == "pre" and m.block == "sequential" and m.mlp == "gated"
             and m.positions == "rope" and not m.fused_qkv and not m.fused_gate_up and m.qk_norm == "none"
             and m.moe is None and m.mla is None and m.attn_softcap is None and m.logit_softcap is None
             and not m.attn_sinks and m.residual_multiplier == 1.0 and m.logit_scale == 1.0)
    if plain and m.activation == "silu" and m.embedding_scale == 1.0:
        return "llama"
    if plain and m.activation in ("gelu_tanh", "gelu") and m.embedding_scale != 1.0:
        return "gemma"
    raise UserError(f"--kernels liger: {m.name} is none of the families whose Liger kernels memcalc models "
                    f"({', '.join(LIGER_FAMILIES)}: pre-norm RMSNorm, RoPE, a gated SiLU or GELU MLP, no MoE, "
                    "no q/k norms or softcaps)")


def liger_plan(m: ModelSpec, profile: KernelProfile, tr: Optional[TrainingSpec] = None) -> LigerPlan:
    """The Liger kernels of ``profile.liger_ops`` that apply to ``m`` (see the module docstring); a one-line
    UserError for a training setup they are not modelled with."""
    if tr is not None:
        _check_training(tr)
    return _plan(m, profile)


def _check_training(tr: TrainingSpec) -> None:
    if tr.lora is not None and tr.lora.qlora:
        raise UserError("--kernels liger with QLoRA is not modelled yet (PEFT's prepare_model_for_kbit_training makes "
                        "the head and norms fp32, which changes the dtypes Liger's kernels see); use LoRA")
    if tr.tp > 1 or tr.zero == 3 or tr.compile:
        raise UserError("--kernels liger with tensor parallelism, ZeRO-3 or torch.compile is not modelled yet "
                        "(Liger's fused cross-entropy reads the whole lm_head weight, outside the model's gathers "
                        "and graphs)")
    if tr.is_amp:
        raise UserError("--kernels liger under autocast (amp-bf16, amp-fp16) is not modelled: Liger's fused "
                        "cross-entropy picks its buffers by torch.is_autocast_enabled() (fused_linear_cross_entropy.py "
                        "_can_use_mm_out); use --precision bf16, fp16 or fp32")


def _plan(m: ModelSpec, profile: KernelProfile) -> LigerPlan:
    fam = _family(m)
    ops = set(profile.liger_ops)
    if profile.cross_entropy == "trl-fused":  # trl 1.16 SFTTrainer.__init__: liger_kernel_config gets
        ops.discard("flce")  # fused_linear_cross_entropy False (its fused LM head stays; sft_trainer.py)
    gemma = fam == "gemma"
    return LigerPlan(rope="rope" in ops, rms_norm="rms_norm" in ops,
                     glu=("geglu" if gemma else "swiglu") if "glu" in ops else None, flce="flce" in ops,
                     casting="gemma" if gemma else "llama")


def liger_kernel_config(m: ModelSpec, profile: KernelProfile) -> dict[str, bool]:
    """The ``liger_kernel_config`` (keyword arguments of ``apply_liger_kernel_to_<model_type>``) for the profile."""
    p = liger_plan(m, profile)
    glu = "geglu" if _family(m) == "gemma" else "swiglu"
    return {"rope": p.rope, "rms_norm": p.rms_norm, glu: p.glu is not None,
            "fused_linear_cross_entropy": p.flce, "cross_entropy": False}


def flce_chunk(rows: int, vocab: int, hidden: int) -> tuple[int, int]:
    """(chunk_size, num_chunks) of ``fused_linear_cross_entropy_forward``: ``inc_factor = cdiv(V, C * H)``,
    ``chunk_size = min(next_power_of_2(cdiv(BT, inc_factor)), BT)``, ``num_chunks = cdiv(BT, chunk_size)``."""
    inc = -(-vocab // (CHUNK_MEM_CONST * hidden))
    per = -(-rows // inc)
    chunk = min(1 << (per - 1).bit_length(), rows)
    return chunk, -(-rows // chunk)
