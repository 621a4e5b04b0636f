"""Specs: the model architecture, the training setup and the kernel profile.

Every field's description is its help text. Specs are frozen and reject unknown
keys; cross-field errors show the arithmetic. Presets, Hugging Face configs,
``--params`` inference and the shipped reference configs all end as these.

Every spec is imported from here; each is written in the module of its part:
:mod:`memcalc.core.model_spec` (the model), :mod:`memcalc.core.training_spec` (the training
step, LoRA, DeepSpeed), this module (the kernel profile and the whole experiment), on the base
and size bounds of :mod:`memcalc.core.spec_base`.
"""

from __future__ import annotations

import math
import typing
from typing import Literal, Optional

from pydantic import Field, model_validator

# the closed vocabularies (Literal types and their values) live in memcalc.core.choices, pydantic-free,
# so that the CLI builds its choices without importing this module
from memcalc.core.choices import (COMPILE_SCOPES, CP_METHODS, FRAMEWORKS, KERNEL_LIBRARIES, LORA_DTYPES, LOSSES,  # noqa: F401
                                  PRECISIONS, SHARDINGS, Framework, KernelLibrary, LigerOp, LoraDType, LossKind,
                                  Precision, Sharding)
from memcalc.core.dtypes import DType
from memcalc.core.kernels import ALLOCATOR_ROUND_BYTES, DROPOUT_MASK_BYTES
from memcalc.core.model_spec import MLASpec, ModelSpec, MoESpec  # noqa: F401
from memcalc.core.optimizers import DEFAULT_IMPL, IMPLS, OPTIMIZER_NAMES, impl_error  # noqa: F401
from memcalc.core.spec_base import MAX_COUNT, MAX_LAYERS, MAX_SEQ, MAX_WIDTH, Spec  # noqa: F401
from memcalc.core.training_spec import (HEAD_TARGET, LORA_TARGET_ALIASES, LORA_TARGETS, DeepSpeedSpec,  # noqa: F401
                                        LoraSpec, Optimizer, OptimizerImpl, TrainingSpec, canonical_targets)


#: torchtune CEWithChunkedOutputLoss(num_output_chunks=8)
DEFAULT_LOSS_CHUNKS = 8


class KernelProfile(Spec):
    """What the kernels and the framework's own layers save: PyTorch version, device, layer code.

    The estimator and the meta tracer read the same profile.
    """

    name: str = Field("torch-2.8-cuda", description="Profile name.")
    framework: Framework = Field(
        "plain",
        description="Whose layer code runs the model: plain (memcalc's own PyTorch replica, the reference configs' "
        "build), hf (transformers 5.x + PEFT), torchtune, litgpt. What a framework changes is set by the "
        "profile's rule fields (rmsnorm, logits_fp32, shift_copy, cross_entropy, lora_dtype, lora_input_cast, "
        "sdpa_gqa, gelu_new, kv_cache, qlora_fp32_cast; memcalc.inputs.profiles.FRAMEWORKS).",
    )
    torch_version: str = Field("2.8", description="PyTorch version emulated (major.minor).")
    device: Literal["cuda"] = Field("cuda", description="Device whose kernels are emulated.")
    attention: Literal["auto", "flash", "efficient", "math"] = Field(
        "auto",
        description="SDPA kernel: auto = flash for 16-bit without an explicit mask, memory-efficient otherwise.",
    )
    rmsnorm: Literal["composite", "composite-legacy", "fused"] = Field(
        "composite",
        description="RMSNorm implementation: composite (2.6-2.8: fp32 upcast, saves fp32 input and fp32 normalised), composite-legacy (2.4-2.5: casts back before the weight), or fused (saves input + rstd).",
    )
    norm_upcast: bool = Field(True, description="The composite norm computes in fp32 (upcasts 16-bit input).")
    inductor_reuse: Literal["always", "peak-aware"] = Field(
        "always",
        description="How torch.compile's inductor reuses a dead buffer for a later allocation of the same size "
        "(torch/_inductor/codegen/wrapper.py, AllocateLine.plan): always (PyTorch <= 2.8: it is kept from its last "
        "use to the reuse), or peak-aware (PyTorch >= 2.9, AllocateLine.should_reuse_buffer, pytorch#159530: only "
        "when keeping it does not raise the graph's estimated peak, else freed and allocated anew). Decides whether a "
        "compiled layer's MLP buffers stay for the next layer's backward (memcalc.compile.compiled.mlp_pool).",
    )
    mean_saves_input: bool = Field(
        False, description="mean(x*x) backward keeps its input (PyTorch <= 2.1)."
    )
    cross_entropy: LossKind = Field(
        "full", description="Cross-entropy on the full logits, or in chunks that never hold full fp32 logits, or "
        "trl-fused: TRL's fused LM head (trl/trainer/utils.py add_fused_lm_head, ChunkedLogProbFunction: the head "
        "projected in tiles on the loss tokens only, no logits tensor).",
    )
    loss_tokens: float = Field(
        1.0, gt=0, le=1,
        description="With cross_entropy trl-fused: the fraction of the B*(T-1) next-token positions whose label is "
        "not -100 (completion-only / assistant-only masks, padding); only those reach TRL's fused head. Inert with "
        "the full and chunked losses (they run on every position; ignored labels cost the same memory).",
    )
    loss_chunks: int = Field(
        DEFAULT_LOSS_CHUNKS, gt=0, le=MAX_COUNT,
        description="With cross_entropy chunked: the logits rows are split into this many chunks, each upcast "
        f"to fp32 and reduced on its own (torchtune CEWithChunkedOutputLoss: 8; at most {MAX_COUNT:,}). Inert with "
        "cross_entropy full.",
    )
    logits_fp32: bool = Field(False, description="The loss upcasts logits to fp32 first (Hugging Face style).")
    shift_copy: bool = Field(True, description="The loss makes a contiguous copy of the shifted logits.")
    lora_dtype: LoraDType = Field(
        "model",
        description="The framework's adapter dtype when LoRA's own dtype is not set: fp32 (PEFT keeps adapters in "
        "fp32 over a 16-bit base, autocast_adapter_dtype=True) or model (the base's weight dtype).",
    )
    lora_input_cast: bool = Field(
        False,
        description="Each LoRA branch casts its input to the adapter weights' dtype first and casts the summed "
        "result back to the base output's dtype (PEFT lora.Linear.forward: x.to(lora_A.weight.dtype), "
        "result.to(torch_result_dtype)); a cast that changes the dtype is a copy.",
    )
    sdpa_gqa: bool = Field(
        False,
        description="Grouped-query K/V reach SDPA un-expanded with enable_gqa=True (transformers "
        "sdpa_attention_forward when use_gqa_in_sdpa: no explicit mask, head dim <= 256; PyTorch >= 2.5); "
        "otherwise they are expanded to every query head first (repeat_kv, a copy).",
    )
    gelu_new: Literal["fused", "chain"] = Field(
        "fused",
        description="How a gelu_new activation runs: fused (F.gelu(approximate='tanh'), saves its input) or chain "
        "(transformers NewGELUActivation: pow, mul, add, tanh, mul as separate ops, each saving its tensors).",
    )
    kv_cache: bool = Field(
        False,
        description="The framework runs transformers' model code, whose training forward fills a DynamicCache when "
        "the model's config leaves use_cache true and nothing is checkpointed (ModelSpec.use_cache; "
        "memcalc.core.rules.kv_cache); memcalc's replica, torchtune and LitGPT build no cache.",
    )
    qlora_fp32_cast: bool = Field(
        False,
        description="QLoRA: every 16-bit parameter that is not 4-bit (embedding, norms, output head) is cast to "
        "fp32 before training (PEFT prepare_model_for_kbit_training, peft/utils/other.py, as PEFT's QLoRA recipe "
        "calls it), so the residual stream runs in fp32 and each 4-bit linear casts its input to the compute "
        "dtype and its output back.",
    )
    fabric_head: bool = Field(
        False,
        description="LitGPT's finetune step under Lightning Fabric (litgpt 0.5.13): the head in 128-position "
        "chunks under LoRA (lm_head_chunk_size=128), Fabric's convert_output casting the logits to fp32, fit() "
        "keeping them until the next forward returns, and litgpt.utils.chunked_cross_entropy (memcalc.engine."
        "blocks.litgpt_head); cross_entropy, loss_chunks, logits_fp32 and shift_copy do not apply. LoRA targets "
        "q, k, v on a fused qkv are the parts of LitGPT's LoRAQKVLinear (memcalc.engine.blocks.litgpt_lora).",
    )
    kernels: KernelLibrary = Field(
        "none",
        description="A kernel library that replaces the model's own layers (framework hf or trl): none, or liger "
        "(Liger-Kernel as transformers' Trainer applies it with use_liger_kernel: fused linear cross-entropy, RMSNorm, "
        "SwiGLU/GeGLU, RoPE per model_type; liger_kernel/transformers/monkey_patch.py, memcalc.core.liger), or cce "
        "(Apple's Cut Cross-Entropy as cut_cross_entropy's cce_patch applies it: the loss from the hidden states and "
        "lm_head.weight, no logits; framework hf; memcalc.core.cce, memcalc.engine.blocks.cce).",
    )
    liger_ops: tuple[LigerOp, ...] = Field(
        ("rope", "rms_norm", "glu", "flce"),
        description="With kernels liger: which of Liger's kernels are applied (liger_kernel_config / axolotl's "
        "liger_rope, liger_rms_norm, liger_glu_activation, liger_fused_linear_cross_entropy): rope, rms_norm, glu "
        "(SwiGLU or GeGLU), flce (fused linear cross-entropy). Inert with kernels none.",
    )
    dropout_mask_bytes: int = Field(DROPOUT_MASK_BYTES, ge=1, le=4, description="Bytes per element of a dropout mask (CUDA: bool, 1).")
    allocator_round_bytes: int = Field(ALLOCATOR_ROUND_BYTES, ge=1, description="The caching allocator rounds every block up to this.")


    @model_validator(mode="after")
    def _check_kernels(self) -> KernelProfile:
        if self.kernels != "none" and self.framework not in ("hf", "trl"):  # TRL runs transformers' model code
            raise ValueError(f"kernels {self.kernels} runs on transformers' model code: it needs framework hf or "
                             f"trl, not {self.framework}")
        return self


class ExperimentSpec(Spec):
    """A whole experiment: model, training setup and kernel profile (a --config file)."""

    name: str = Field("experiment", description="Experiment name.")
    description: str = Field("", description="What the experiment sets.")
    model: ModelSpec = Field(..., description="The model.")
    training: TrainingSpec = Field(default_factory=TrainingSpec, description="The training setup.")
    profile: KernelProfile = Field(default_factory=KernelProfile, description="The kernel profile.")
    published_peak_bytes: Optional[int] = Field(
        None, ge=0, description="A measured max_memory_allocated peak, for comparison."
    )
    published_source: Optional[str] = Field(None, description="Where the published peak comes from.")

    @property
    def adapter_dtype(self) -> Optional[DType]:
        """The LoRA adapters' dtype (their weights, gradients and optimizer state): the LoRA spec's
        ``dtype``, else the framework's (``profile.lora_dtype``); ``model`` = the training's weight
        dtype. None without LoRA. TRL's QLoRA: bf16 (trl 1.16.0 trl/trainer/sft_trainer.py SFTTrainer.__init__,
        lines 908-911: on a quantized base every trainable parameter is cast to torch.bfloat16 after get_peft_model)."""
        lora = self.training.lora
        if lora is None:
            return None
        if lora.qlora and lora.dtype is None and self.profile.framework == "trl":
            return DType.bf16
        return DType.fp32 if (lora.dtype or self.profile.lora_dtype) == "fp32" else self.training.weight_dtype

    @model_validator(mode="after")
    def _check_lora_targets(self) -> "ExperimentSpec":
        lora = self.training.lora
        # LitGPT's LoRAQKVLinear adapts the q, k, v parts of its fused qkv (fabric_head: LitGPT's step)
        parts = {"q", "k", "v"} if self.profile.fabric_head and self.model.fused_qkv else set()
        missing = [t for t in lora.targets if t not in self.model.lora_targets and t != HEAD_TARGET and t not in parts
                   ] if lora is not None else []
        if missing:
            raise ValueError(lora_targets_error(self.model, missing))
        if lora is not None and lora.modules_to_save and self.profile.framework not in ("plain", "hf"):
            raise ValueError(f"modules_to_save with framework {self.profile.framework}: PEFT's ModulesToSaveWrapper "
                             "is modelled for --framework hf (transformers + PEFT); valid frameworks: hf, plain")
        moe = self.model.moe
        half = sorted({"gate", "up"} & set(lora.targets)) if lora is not None and moe is not None else []
        if moe is not None and moe.lora_mlp_to_experts and len(half) == 1:
            other = "up" if half == ["gate"] else "gate"
            raise ValueError(f"LoRA target {half[0]} without {other}: PEFT refuses it on {self.model.name}, whose "
                             "experts hold gate and up as one gate_up_proj (peft _convert_peft_config_moe)")
        return self


def lora_targets_error(model: ModelSpec, missing: "typing.Sequence[str]") -> str:
    """The message for LoRA targets a model does not have (gate on a plain MLP)."""
    why = " (its MLP is plain: fc1 = up, fc2 = down, no gate)" if "gate" in missing and model.mlp == "plain" else ""
    if model.fused_qkv and set(missing) & {"q", "k", "v"}:
        why += " (q, k, v are one fused projection: target qkv)"
    if model.fused_gate_up and set(missing) & {"gate", "up"}:
        why += " (gate and up are one fused projection: target gate_up)"
    if model.moe is not None and set(missing) & {"gate", "up", "down"}:
        why += " (every layer is MoE without shared experts: its experts are 3-D parameters, target experts)"
    return f"LoRA target(s) {', '.join(missing)} not in {model.name}{why}; its targets: {', '.join(model.lora_targets)}"


def sqrt_segments(n_layers: int) -> int:
    """Layers per segment for --checkpoint sqrt: round(sqrt(n)), at least 1."""
    return max(1, round(math.sqrt(n_layers)))
