"""Kernel profiles: what a PyTorch version's kernels and a framework's layers save.

A profile is (framework, PyTorch version): :data:`FRAMEWORKS` holds each framework's rules
with the library source it follows, :func:`profile_for` builds the profile of a pair and
:func:`compose` applies ``--framework`` / ``--torch`` to a named or configured profile. The
reference configs pin ``torch-2.8-cuda`` (plain, the build the published table was measured
with). Every field can also be set in a config file's ``profile:`` mapping. The plain profiles
take their RMSNorm from :data:`memcalc.core.kernels.RMSNORM_BY_TORCH` (the table the
validator follows too).
"""

from __future__ import annotations

import re
from typing import Optional

from memcalc.core.errors import UserError, unknown_name
from memcalc.core.kernels import rmsnorm_for_torch
from memcalc.core.rules import framework_model
from memcalc.core.spec import KERNEL_LIBRARIES, LOSSES, MAX_COUNT, KernelProfile, ModelSpec
from memcalc.inputs.pydantic_errors import _short_repr

#: what each framework's own layer code decides, with the library source each rule follows.
#: ``rmsnorm`` None = the PyTorch version's ``nn.RMSNorm`` (:func:`rmsnorm_for_torch`).
FRAMEWORKS: dict[str, dict] = {
    # memcalc's own PyTorch replica (validate/model.py): nn.RMSNorm; the loss on model-dtype logits
    # with a shifted contiguous copy (Forgather's layers, the reference experiment's build);
    # repeat_kv before SDPA; adapters in the base's dtype; gelu_new as the fused tanh GELU.
    "plain": dict(rmsnorm=None, logits_fp32=False, shift_copy=True, cross_entropy="full", lora_dtype="model",
                  lora_input_cast=False, sdpa_gqa=False, gelu_new="fused", kv_cache=False,
                  qlora_fp32_cast=False, fabric_head=False),
    # transformers 5.x + PEFT 0.2x:
    # - LlamaRMSNorm (models/llama/modeling_llama.py): hidden.to(fp32) ... ``self.weight *
    #   hidden_states.to(input_dtype)``: casts back before the weight multiply (composite-legacy),
    #   whatever the PyTorch version;
    # - ForCausalLMLoss (loss/loss_utils.py): ``logits.float()``; labels padded and shifted
    #   (``nn.functional.pad(labels, (0, 1))``, ``labels[..., 1:]``), the logits are not shifted;
    # - PEFT (peft/tuners/tuners_utils.py ``cast_adapter_dtype``, ``autocast_adapter_dtype=True``)
    #   keeps adapters in fp32 over a 16-bit base; lora.Linear.forward (peft/tuners/lora/layer.py)
    #   casts x to lora_A.weight.dtype (``_cast_input_dtype``) and the result back;
    # - integrations/sdpa_attention.py ``sdpa_attention_forward``: ``enable_gqa=True`` with K/V
    #   un-expanded when ``use_gqa_in_sdpa`` (CUDA: no mask, head dim <= 256), else repeat_kv;
    #   ``enable_gqa`` exists from PyTorch 2.5 on (see :func:`profile_for`);
    # - activations.py NewGELUActivation (``gelu_new``): pointwise ops, not a fused kernel;
    # - default attention implementation sdpa; activation checkpointing (modeling_utils.py
    #   ``_activation_checkpointing_enable``: ``use_reentrant=False`` by default, each decoder
    #   layer a GradientCheckpointingLayer, modeling_layers.py) = memcalc's --checkpoint full;
    # - the model's forward builds a DynamicCache when the config's use_cache is true and no layer is
    #   checkpointed (utils/generic.py merge_with_config_defaults; memcalc.core.rules.kv_cache);
    # - QLoRA as PEFT's recipe (docs "Quantization", the QLoRA paper's qlora.py) runs it:
    #   ``prepare_model_for_kbit_training`` (peft/utils/other.py) casts every 16-bit parameter that is
    #   not a bitsandbytes Params4bit to fp32 (TRL >= 0.20's SFTTrainer no longer calls it: trl below).
    "hf": dict(rmsnorm="composite-legacy", logits_fp32=True, shift_copy=False, cross_entropy="full",
               lora_dtype="fp32", lora_input_cast=True, sdpa_gqa=True, gelu_new="chain", kv_cache=True,
               qlora_fp32_cast=True, fabric_head=False),
    # torchtune (0.6.1; validate --framework torchtune traces it):
    # - modules/rms_norm.py RMSNorm.forward: ``F.rms_norm(x.float(), ..., weight=self.scale,
    #   eps).to(x.dtype)``: an fp32 input with a 16-bit weight cannot take the fused kernel
    #   (layer_norm.cpp rms_norm_symint: "Mismatch dtype between input and weight"), so the
    #   composite runs on the fp32 copy, the weight multiply in fp32, the result cast back
    #   (composite; an fp32 model on PyTorch >= 2.9 takes the fused kernel: not modelled);
    # - modules/transformer.py TransformerDecoder.unembed: the chunked output (``chunked_output``)
    #   with CEWithChunkedOutputLoss (modules/loss/ce_chunked_output_loss.py: 8 chunks, each
    #   ``.float()``), else ``self.output(h).float()``: the head and loss are
    #   memcalc.engine.blocks.chunked_output; the recipes shift the labels
    #   (``torch.hstack((labels[..., 1:], ignore))``), not the logits;
    # - modules/peft/lora.py LoRALinear: ``out + lora_b(lora_a(dropout(x))) * alpha/rank`` with
    #   no cast; the recipes build every parameter in the training dtype (adapters included);
    # - modules/attention.py MultiHeadAttention: k/v ``expand`` + ``reshape`` to every query head
    #   (a copy) before SDPA;
    # - training/_activation_checkpointing.py set_activation_checkpointing:
    #   ``apply_activation_checkpointing`` with the default ``checkpoint_wrapper``
    #   (CheckpointImpl.NO_REENTRANT) on each TransformerSelfAttentionLayer = --checkpoint full.
    # Not verified: gelu_new (torchtune has no model using it; fused assumed).
    "torchtune": dict(rmsnorm="composite", logits_fp32=False, shift_copy=False, cross_entropy="chunked",
                      lora_dtype="model", lora_input_cast=False, sdpa_gqa=False, gelu_new="fused", kv_cache=False,
                      qlora_fp32_cast=False, fabric_head=False),
    # LitGPT:
    # - litgpt/model.py RMSNorm: ``x.float()``, ``mean(x * x)``, ``(x_normed * weight.float()).to(dtype)``:
    #   the weight multiply in fp32 (composite);
    # - litgpt/model.py CausalSelfAttention: ``k.repeat_interleave(q_per_kv, dim=1)`` (a copy)
    #   before SDPA; GptNeoxMLP: ``F.gelu(x, approximate=config.gelu_approximate)`` (fused);
    # - litgpt/lora.py LoRALinear: no cast; adapters in the Fabric precision's dtype (``bf16-true``);
    # - litgpt/utils.py chunked_cross_entropy on model-dtype logits (no fp32 upcast); the shift is
    #   ``logits[..., :-1, :]`` then ``reshape`` (a copy).
    # - the finetune scripts' step under Lightning Fabric (litgpt 0.5.13; validate --framework litgpt
    #   traces it): ``fabric_head`` (memcalc.engine.blocks.litgpt_head: lightning/fabric/wrappers.py
    #   _FabricModule.forward ``convert_output`` casts the logits to fp32; finetune/lora.py and full.py
    #   ``fit`` keep ``logits`` until the next forward returns; lora.py ``lm_head_chunk_size=128``;
    #   litgpt/utils.py chunked_cross_entropy), which replaces the loss fields below;
    # - litgpt/model.py GPT.__init__: an untied lm_head and one fused qkv (core.rules.framework_model).
    # - litgpt/lora.py LoRAQKVLinear: LoRA on q/k/v as parts of the fused qkv (memcalc.engine.blocks.litgpt_lora).
    "litgpt": dict(rmsnorm="composite", logits_fp32=False, shift_copy=True, cross_entropy="full",
                   lora_dtype="model", lora_input_cast=False, sdpa_gqa=False, gelu_new="fused", kv_cache=False,
                   qlora_fp32_cast=False, fabric_head=True),
    # TRL 1.16.0 SFTTrainer: transformers + PEFT (the hf rules above) with TRL's loss path:
    # - trl/trainer/sft_trainer.py SFTTrainer.__init__: ``add_fused_lm_head(model, outputs=("log_probs",
    #   "entropy", "is_top1"))``; compute_loss (``loss_type="nll"``, the default; "chunked_nll" its
    #   deprecated alias, sft_config.py) calls ``model(**inputs, fused_lm_head=True)``: the head projected in
    #   tiles on the positions whose label is not -100 (trl/kernels/chunked_logprob.py
    #   ChunkedLogProbFunction), never the (B, T, V) logits (memcalc.engine.blocks.trl_head);
    # - SFTConfig.activation_offloading: trl/models/activation_offloading.py OffloadActivations (torchtune's,
    #   copied) around the whole training_step; its NoOpManager hooks sit on ``lm_head``, which the fused
    #   head never calls, so the head's saved tensors are offloaded too;
    # - a 4-bit model is not passed through ``prepare_model_for_kbit_training`` (SFTTrainer.__init__ only
    #   calls get_peft_model; TRL dropped the call in 0.20): no fp32 casts.
    "trl": dict(rmsnorm="composite-legacy", logits_fp32=True, shift_copy=False, cross_entropy="trl-fused",
                lora_dtype="fp32", lora_input_cast=True, sdpa_gqa=True, gelu_new="chain",
                # SFTTrainer.compute_loss (trainer/sft_trainer.py): ``inputs["use_cache"] = False``: no DynamicCache
                kv_cache=False, qlora_fp32_cast=False, fabric_head=False),
    # Unsloth (unsloth 2026.10.9 + unsloth_zoo 2026.10.9, read from source, not traced: memcalc.core.unsloth):
    # - kernels/rms_layernorm.py Fast_RMS_Layernorm: ``ctx.save_for_backward(X, W, r)`` with ``r`` fp32 per row,
    #   ``Y = torch.empty(..., dtype=X.dtype)``: the fused rule (input + rstd);
    # - models/llama.py CausalLM_fast_forward: with labels, ``unsloth_fused_ce_loss`` (unsloth_zoo
    #   fused_losses/cross_entropy_loss.py, by default fused_linear.py ``fused_linear_ce_v2``): no logits tensor
    #   (memcalc.engine.blocks.unsloth_head);
    # - unsloth_zoo training_utils.py prepare_model_for_training: ``.lora_A.`` / ``.lora_B.`` parameters
    #   ``upcast = True``: fp32 adapters; kernels/utils.py matmul_lora: ``XA = torch_matmul(X, A.to(dtype))``,
    #   ``addmm_(out, XA, B.to(dtype), alpha=s)``: the adapter weights are cast to the input's dtype, never the
    #   input to fp32 (memcalc.engine.blocks.unsloth_lora: LoRA_QKV, LoRA_W, LoRA_MLP where patch_peft_model installs
    #   them); a projection outside those groups (LoRA on q and v only, a bias, lora_dropout > 0) runs PEFT's
    #   lora.Linear.forward, which casts x to the fp32 adapters' dtype (``lora_input_cast``, as hf);
    # - models/llama.py LlamaAttention_fast_forward: K/V expanded to every query head for SDPA (the path without
    #   flash-attn / xformers); no KV cache in training;
    # - --checkpoint full is ``use_gradient_checkpointing="unsloth"`` (memcalc.engine.unsloth_checkpoint).
    "unsloth": dict(rmsnorm="fused", logits_fp32=False, shift_copy=False, cross_entropy="unsloth-fused",
                    lora_dtype="fp32", lora_input_cast=True, sdpa_gqa=False, gelu_new="chain", kv_cache=False,
                    qlora_fp32_cast=False, fabric_head=False),
}

#: why each framework's adapters have the dtype they have (the inputs table's reason for the default)
LORA_DTYPE_WHY: dict[str, str] = {
    "plain": "adapters in the base's dtype (memcalc's replica builds every parameter in the training dtype)",
    "hf": "PEFT keeps adapters in fp32 over a 16-bit base, autocast_adapter_dtype=True",
    "torchtune": "adapters in the base's dtype (the recipes build every parameter in the training dtype)",
    "litgpt": "adapters in the base's dtype (Fabric's bf16-true precision converts every parameter)",
    "trl": "PEFT keeps adapters in fp32 over a 16-bit base, autocast_adapter_dtype=True (TRL wraps with PEFT)",
    "unsloth": "Unsloth upcasts lora_A/lora_B to fp32 (unsloth_zoo training_utils.py prepare_model_for_training)",
}

#: the fields :func:`profile_for` sets from the framework and the PyTorch version
RULE_FIELDS = ("rmsnorm", "mean_saves_input", "inductor_reuse", *FRAMEWORKS["plain"])

#: ``--torch``: the PyTorch versions memcalc has rules for (major.minor, 2.1 .. 2.13)
TORCH_MIN, TORCH_MAX = (2, 1), (2, 13)
#: first PyTorch with ``scaled_dot_product_attention(..., enable_gqa=True)``
SDPA_GQA_SINCE = (2, 5)
#: last PyTorch whose ``mean(x*x)`` backward keeps its input
MEAN_SAVES_INPUT_UNTIL = (2, 1)
#: first PyTorch whose inductor reuses a dead buffer only when that does not raise the graph's peak
#: (torch/_inductor/codegen/wrapper.py AllocateLine.should_reuse_buffer, pytorch#159530, in 2.9)
PEAK_AWARE_REUSE_SINCE = (2, 9)

DEFAULT_TORCH = "2.8"
#: ``--profile`` of lit-gpt before 6178c7cc (October 2023): its RMSNorm in the input dtype (:data:`PROFILES`)
LIT_GPT_2023 = "litgpt-2023.10-torch-2.1-cuda"
#: named profiles that are a (framework, PyTorch) pair with fields of a framework version changed
VARIANTS: dict[str, dict] = {LIT_GPT_2023: {"norm_upcast": False}}
#: a variant's framework version, the first part of its name (``--torch`` keeps it, ``--framework`` leaves it)
VARIANT_LABEL: dict[str, str] = {LIT_GPT_2023: "litgpt-2023.10"}


def parse_torch(version: str) -> tuple[int, int]:
    """``--torch`` as (major, minor); a one-line error outside :data:`TORCH_MIN` .. :data:`TORCH_MAX`."""
    m = re.fullmatch(r"\s*(\d{1,3})\.(\d{1,3})(?:\.\d+)?\s*", str(version))
    v = (int(m.group(1)), int(m.group(2))) if m else None
    if v is None or not TORCH_MIN <= v <= TORCH_MAX:
        lo, hi = ".".join(map(str, TORCH_MIN)), ".".join(map(str, TORCH_MAX))
        raise UserError(f"unknown --torch {str(version)[:40]!r}; valid: {lo} to {hi} (major.minor, e.g. 2.8)")
    return v


def profile_name(framework: str, torch: str) -> str:
    """``torch-2.8-cuda`` for plain, ``hf-torch-2.8-cuda`` for the others."""
    return ("" if framework == "plain" else f"{framework}-") + f"torch-{torch}-cuda"


def profile_for(framework: str, torch: str = DEFAULT_TORCH) -> KernelProfile:
    """The profile of ``framework``'s layer code on PyTorch ``torch`` (:data:`FRAMEWORKS`); the
    version decides ``nn.RMSNorm`` (plain), ``mean_saves_input`` (<= 2.1), whether
    ``enable_gqa`` exists (>= 2.5) and inductor's buffer reuse (``inductor_reuse``, peak-aware >= 2.9)."""
    if framework not in FRAMEWORKS:
        raise unknown_name("framework", framework, list(FRAMEWORKS))
    v = parse_torch(torch)
    t = f"{v[0]}.{v[1]}"
    rules = dict(FRAMEWORKS[framework])
    rules["rmsnorm"] = rules["rmsnorm"] or rmsnorm_for_torch(t)
    rules["sdpa_gqa"] = rules["sdpa_gqa"] and v >= SDPA_GQA_SINCE
    return KernelProfile(name=profile_name(framework, t), framework=framework, torch_version=t,
                         mean_saves_input=v <= MEAN_SAVES_INPUT_UNTIL,
                         inductor_reuse="peak-aware" if v >= PEAK_AWARE_REUSE_SINCE else "always", **rules)


def compose(base: KernelProfile, framework: Optional[str] = None, torch: Optional[str] = None) -> KernelProfile:
    """``base`` with ``--framework`` and/or ``--torch`` replacing that part of it: the rule fields
    (:data:`RULE_FIELDS`) and the name come from (framework or base's, torch or base's); the other
    fields (attention, loss_chunks, the allocator's rounding, ...) stay as ``base`` has them."""
    if framework is None and torch is None:
        return base
    new = profile_for(framework if framework is not None else base.framework,  # ("" is refused, not the default)
                      torch if torch is not None else base.torch_version)
    keep = {k: v for k, v in base.model_dump().items() if k not in RULE_FIELDS}
    upd = {k: getattr(new, k) for k in ("name", "framework", "torch_version", *RULE_FIELDS)}
    if base.name in VARIANTS:  # a framework version's fields: they are that framework's code, on any PyTorch
        if new.framework == base.framework:  # the label says the variant runs: litgpt-2023.10-torch-T-cuda
            same = new.torch_version == base.torch_version
            upd["name"] = base.name if same else f"{VARIANT_LABEL[base.name]}-torch-{new.torch_version}-cuda"
        else:  # another framework's code: none of the variant's fields (the new framework's values)
            upd.update({k: getattr(new, k) for k in VARIANTS[base.name]})
    return KernelProfile.model_validate({**keep, **upd})


PROFILES: dict[str, KernelProfile] = {
    p.name: p
    for p in (
        # PyTorch 2.8 on CUDA with plain PyTorch layers (nn.RMSNorm composite with the weight
        # multiply in fp32; loss on model-dtype logits with a shifted contiguous copy). The
        # reference experiment's build (Forgather's layers).
        profile_for("plain", "2.8"),
        # PyTorch 2.9+: nn.RMSNorm dispatches to the fused _fused_rms_norm kernel on CUDA.
        profile_for("plain", "2.9"),
        # PyTorch 2.4-2.5: composite RMSNorm casts back before the weight multiply.
        profile_for("plain", "2.4"),
        # PyTorch 2.1: mean(x*x) backward keeps its input.
        profile_for("plain", "2.1"),
        # Hugging Face transformers 5.x + PEFT on PyTorch 2.8 (FRAMEWORKS["hf"]).
        profile_for("hf", "2.8"),
        profile_for("torchtune", "2.8"),
        profile_for("litgpt", "2.8"),
        # lit-gpt before commit 6178c7cc ("Half precision fixes", 2023-10-24; the resource tables' 8641822 of
        # 2023-10-20) on PyTorch 2.1: lit_gpt/rmsnorm.py RMSNorm.forward ``torch.mean(x * x, ...)``,
        # ``x * torch.rsqrt(norm_x + eps)``, ``self.weight * x_normed``: in the input dtype, no ``x.float()``
        # (norm_upcast False: the composite saves the 16-bit x, x * x (PyTorch 2.1's mean) and the rsqrt)
        profile_for("litgpt", "2.1").model_copy(update={"name": LIT_GPT_2023, **VARIANTS[LIT_GPT_2023]}),
    )
}

DEFAULT_PROFILE = "torch-2.8-cuda"


def get_profile(name: str) -> KernelProfile:
    """A named profile; unknown names list the valid ones."""
    try:
        return PROFILES[name]
    except (KeyError, TypeError):  # TypeError: a list or dict (a config's profile.base: [1])
        raise unknown_name("profile", name, list(PROFILES)) from None


def with_loss(profile: KernelProfile, loss: Optional[str] = None, loss_chunks: Optional[int] = None,
              loss_tokens: Optional[float] = None) -> KernelProfile:
    """``profile`` with ``--loss`` (its ``cross_entropy``), ``--loss-chunks`` (its ``loss_chunks``) and
    ``--loss-tokens`` (its ``loss_tokens``) overridden where given; bad values are one-line errors."""
    upd: dict = {}
    if loss is not None:
        if loss not in LOSSES:
            raise UserError(f"unknown --loss {loss!r}; valid: {', '.join(LOSSES)}")
        upd["cross_entropy"] = loss
    if loss_chunks is not None:
        if isinstance(loss_chunks, bool) or not isinstance(loss_chunks, int):
            raise UserError(f"--loss-chunks must be a whole number, got {loss_chunks!r}")
        if loss_chunks <= 0:
            raise UserError(f"--loss-chunks must be positive, got {loss_chunks}")
        if loss_chunks > MAX_COUNT:  # (a chunk per token at most; a fuzzer's 10**30 was taken)
            raise UserError(f"--loss-chunks must be at most {MAX_COUNT:,}, got {_short_repr(loss_chunks)}")
        upd["loss_chunks"] = loss_chunks
    if loss_tokens is not None:
        if isinstance(loss_tokens, bool) or not isinstance(loss_tokens, (int, float)) or not 0 < loss_tokens <= 1:
            raise UserError(f"--loss-tokens must be a fraction in (0, 1] (the share of positions whose label is "
                            f"not -100), got {loss_tokens!r}")
        upd["loss_tokens"] = float(loss_tokens)
    if not upd:
        return profile
    return KernelProfile.model_validate({**profile.model_dump(), **upd})


def with_kernels(profile: KernelProfile, kernels: Optional[str], liger_ops: Optional[tuple[str, ...]] = None
                 ) -> KernelProfile:
    """``profile`` with ``--kernels`` (and a recipe's ``liger_ops``) where given; Liger runs on transformers'
    model code only (framework hf). Bad values are one-line errors."""
    if kernels is None and liger_ops is None:
        return profile
    kernels = kernels if kernels is not None else profile.kernels
    if kernels not in KERNEL_LIBRARIES:
        raise UserError(f"unknown --kernels {kernels!r}; valid: {', '.join(KERNEL_LIBRARIES)}")
    if kernels != "none" and profile.framework not in ("hf", "trl"):
        raise UserError(f"--kernels {kernels} patches transformers' model code: it needs --framework hf or trl, not "
                        f"{profile.framework}")
    if kernels == "cce" and profile.framework != "hf":  # validate/trainers/trl.py does not apply cce_patch
        raise UserError(f"--kernels cce replaces the CausalLM's forward (cut_cross_entropy cce_patch): it needs "
                        f"--framework hf, not {profile.framework}")
    upd: dict = {"kernels": kernels, **({"liger_ops": tuple(liger_ops)} if liger_ops is not None else {})}
    return KernelProfile.model_validate({**profile.model_dump(), **upd})


def plan_profile(profile: Optional[str] = None, framework: Optional[str] = None, torch: Optional[str] = None,
                 loss: Optional[str] = None, loss_chunks: Optional[int] = None,
                 loss_tokens: Optional[float] = None, kernels: Optional[str] = None) -> tuple[KernelProfile, str]:
    """``memcalc plan``'s kernel profile (``--profile`` or the hf default of estimate's ``--model``,
    with ``--framework``/``--torch``/``--loss``/``--loss-chunks`` over it) and the note saying
    which it is and why; the CLI and the Python API both call this."""
    prof = compose(get_profile(profile) if profile else profile_for("hf", DEFAULT_TORCH), framework, torch)
    if loss is not None or loss_chunks is not None or loss_tokens is not None:
        prof = with_loss(prof, loss, loss_chunks, loss_tokens)
    prof = with_kernels(prof, kernels)
    note = (f"kernel profile {prof.name}: framework {prof.framework}"
            + (" (default: most users fine-tune with Hugging Face transformers + PEFT; --framework to change)"
               if profile is None and framework is None else "")
            + f", PyTorch {prof.torch_version}" + (" (default)" if profile is None and torch is None else ""))
    return prof, note


def plan_model_profile(model: ModelSpec, *args) -> tuple[ModelSpec, KernelProfile, list[str]]:
    """:func:`plan_profile` (``args``: its arguments) and the model as that framework builds it
    (:func:`memcalc.core.rules.framework_model`; LoRA targets are the plan's to choose, so the qkv
    stays as the model has it): (model, profile, notes)."""
    prof, note = plan_profile(*args)
    model, why = framework_model(model, prof.framework, fuse_qkv=False)
    return model, prof, [note, *why]
