"""The cost model ``memcalc plan`` ranks options by: relative step time per token (1.00 = full
fine-tune in bf16, no checkpointing, at full GPU utilisation). Forward FLOPs per token from the model's shapes
(Kaplan et al. 2020, "Scaling Laws for Neural Language Models", Table 1):
``F = F_lin + F_head + F_attn`` with ``F_lin = 2 x`` (the layers' linear weights),
``F_head = 2 x vocab x d_model`` and ``F_attn = 2 x n_layers x T x q_dim`` (the attention
core, QK^T and PV). One step is

- forward ``F``; backward ``2 F`` for a full fine-tune (activation and weight gradients, the
  ``C = 6N`` per token of Kaplan et al.); with LoRA/QLoRA the frozen weights get no weight
  gradient: ``F_lin + F_head + 2 F_attn`` (the adapters' own matmuls are negligible at rank 16;
  Hu et al. 2021 report about 25% faster training than full fine-tuning for GPT-3);
- full or sqrt checkpointing recompute the layers' forward once (Chen et al. 2016, "Training
  Deep Nets with Sublinear Memory Cost"): ``+ F_lin + F_attn`` (about +33%); selective
  (Korthikanti et al. 2022) recomputes only the attention core: ``+ F_attn``;
- QLoRA dequantises every 4-bit weight for each matmul: x1.15 (an assumption; reported
  slowdowns over LoRA range from about 10% to 40% with the kernel and model size);
- precision: bf16/fp16 (pure or with fp32 master weights) x1.0; AMP x1.05 (an assumption: the
  casts of the fp32 weights every forward); fp32 x2.0 (TF32 tensor cores run at half the 16-bit
  rate: A100 datasheet, 156 vs 312 dense TFLOPS; without TF32 fp32 is far slower);
- optimizer (AdamW, 8-bit AdamW, Adafactor) and a fused step: +0 (the step is O(params),
  the forward/backward O(params x tokens));
- utilisation (an assumption): small steps run below peak throughput; cost per token is
  multiplied by ``1 + 1024 / (max_batch x T)`` (a 1024-token step runs at half speed), so
  options that fit a bigger batch rank higher.

The ranking is by this cost per token at each option's max batch. It is a rough guide for
comparing options on one GPU, not a time prediction.
"""

from __future__ import annotations

from typing import Optional

from memcalc.core.spec import ModelSpec
from memcalc.engine.params import param_inventory
from memcalc.plan.options import Technique

#: Cost model constants (see the module docstring).
QLORA_OVERHEAD = 0.15
PRECISION_FACTOR = {"16": 1.0, "16+master": 1.0, "amp": 1.05, "fp32": 2.0}
HALF_SPEED_TOKENS = 1024

COST_MODEL_LINES = (
    "relative cost = step time per token, 1.00 = bf16 full fine-tune, no checkpointing, GPU saturated",
    "forward F = linear + head + attention-core FLOPs; backward 2F (full) or F_lin + F_head + 2 F_attn (LoRA/QLoRA: no frozen-weight grads)",
    "checkpointing full/sqrt: + the layers' forward (~+33%); selective: + the attention core",
    f"QLoRA dequantisation x{1 + QLORA_OVERHEAD:.2f}; AMP x{PRECISION_FACTOR['amp']:.2f}; fp32 x{PRECISION_FACTOR['fp32']:.1f} (TF32); optimizer choice and fused step +0",
    f"utilisation: x (1 + {HALF_SPEED_TOKENS} / tokens per step) at the max batch, so a bigger batch ranks higher",
    "torch.compile (--compile): + the forward FLOPs its memory budget recomputes; compile's own speed-up is not counted",
)


def flops_per_token(model: ModelSpec, seq: int) -> tuple[float, float, float]:
    """Forward FLOPs per token: (layers' linear matmuls, LM head, attention core at ``seq``).

    MoE: the router is a linear; a token passes through ``top_k`` of the ``n_experts`` routed
    experts, so the expert weights count at top_k / n_experts (balanced routing). MLA: the
    attention core's width is the q/k head width (qk_nope + qk_rope) times the heads."""
    inv = param_inventory(model)
    lin = sum(p.numel for p in inv if p.kind in ("linear", "router"))
    if model.moe is not None:
        lin += sum(p.numel for p in inv if p.kind == "experts") * model.moe.top_k / model.moe.n_experts
    f_lin = 2.0 * lin
    f_head = 2.0 * model.vocab_size * model.d_model
    width = model.n_heads * model.mla.qk_head_dim if model.mla is not None else model.q_dim
    f_attn = 2.0 * model.n_layers * seq * width
    return f_lin, f_head, f_attn


def relative_cost(t: Technique, model: ModelSpec, seq: int, batch: int,
                  recompute_fraction: float = 0.0) -> Optional[float]:
    """Relative step time per token at ``batch`` x ``seq`` (see the module docstring); None when
    ``batch`` is 0 (nothing fits). ``recompute_fraction``: the share of the forward FLOPs that a
    torch.compile memory budget recomputes (memcalc.compile.compiled)."""
    if batch <= 0:
        return None
    f_lin, f_head, f_attn = flops_per_token(model, seq)
    fwd = f_lin + f_head + f_attn
    bwd = 2 * fwd if t.adapters == "none" else f_lin + f_head + 2 * f_attn
    rec = {"none": 0.0, "full": f_lin + f_attn, "sqrt": f_lin + f_attn, "selective": f_attn}[t.checkpoint]
    rec += recompute_fraction * fwd
    units = fwd + bwd + rec
    if t.adapters == "qlora":
        units *= 1 + QLORA_OVERHEAD
    units *= PRECISION_FACTOR[t.precision]
    units *= 1 + HALF_SPEED_TOKENS / (batch * seq)
    return units / (3 * fwd)
