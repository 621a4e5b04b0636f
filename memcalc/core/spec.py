"""Specs: the model architecture, the training setup and the kernel profile.

Every field's description is its help text. Specs are frozen and reject unknown
keys; cross-field errors show the arithmetic. Presets, Hugging Face configs,
``--params`` inference and the shipped reference configs all end as these.
"""

from __future__ import annotations

import math
import typing
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from memcalc.core.dtypes import DType
from memcalc.core.kernels import ALLOCATOR_ROUND_BYTES, DROPOUT_MASK_BYTES
from memcalc.core.optimizers import DEFAULT_IMPL, IMPLS, OPTIMIZER_NAMES, impl_error

# allow_inf_nan=False: a float field (norm_eps, alpha, dropout, budgets) must be finite.
_FROZEN = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


def _numeric_only(annotation: Any) -> bool:
    """The annotation is int or float (possibly Optional) or a Literal of integers, not bool."""
    if annotation in (int, float):
        return True
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return all(isinstance(a, int) and not isinstance(a, bool) for a in args)
    return typing.get_origin(annotation) is typing.Union and any(a in (int, float) for a in args) and bool not in args


class _Spec(BaseModel):
    """A frozen spec whose numeric fields refuse true/false (pydantic would read them as 1/0)."""

    model_config = _FROZEN

    @model_validator(mode="before")
    @classmethod
    def _no_bool_numbers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for k, v in data.items():
                if v is True or v is False:
                    f = cls.model_fields.get(k)
                    if f is not None and _numeric_only(f.annotation):
                        raise ValueError(f"{k} = {str(v).lower()}: expected a number, not a boolean")
        return data

#: Upper bounds on sizes, far above real models (so a typo or a fuzzer's 10**30 is one line, and
#: the step's simulation, about linear in layers, stays within seconds):
#: layers: the deepest decoder LLMs have 126 (Llama 3.1 405B), DeepNet trained 1,000 (arXiv 2203.00555);
MAX_LAYERS = 1024
#: sequence / context: 2**24 = 16,777,216 tokens, 1.6 x Llama 4 Scout's 10M context;
MAX_SEQ = 2**24
#: widths (d_model, d_ff, vocab, head_dim): 2**20 = 1,048,576, 4 x Gemma 3's 262,144-token vocabulary
#: and 19 x the widest FFN of Llama 3.1 405B (53,248);
MAX_WIDTH = 2**20
#: micro-batch, accumulation steps, GPUs: 2**20 = 1,048,576 (more than the largest clusters' GPUs).
MAX_COUNT = 2**20

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
#: PEFT ``target_modules`` names of the same projections (Hugging Face Llama/Mistral/Qwen2 module
#: names; source: peft TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING and LlamaAttention/LlamaMLP).
#: GPT-2's fused ``c_attn`` is one q,k,v projection, not one of these: it has no alias.
LORA_TARGET_ALIASES = {
    "q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
    "gate_proj": "gate", "up_proj": "up", "down_proj": "down",
}


def canonical_targets(names: "typing.Iterable[str]") -> tuple[str, ...]:
    """LoRA target names lowercased, PEFT aliases mapped (q_proj -> q), duplicates dropped, in order."""
    out: list[str] = []
    for n in names:
        t = n.strip().lower() if isinstance(n, str) else n
        t = LORA_TARGET_ALIASES.get(t, t)
        if t not in out:
            out.append(t)
    return tuple(out)


class ModelSpec(_Spec):
    """A decoder-only transformer, described by the shapes that decide its memory."""

    name: str = Field("custom", description="A name for the model, shown in reports.")
    n_layers: int = Field(..., gt=0, le=MAX_LAYERS, description=f"Number of decoder layers (at most {MAX_LAYERS:,}).")
    d_model: int = Field(..., gt=0, le=MAX_WIDTH, description=f"Hidden size (width of the residual stream; at most {MAX_WIDTH:,}).")
    n_heads: int = Field(..., gt=0, le=MAX_WIDTH, description="Number of query heads.")
    n_kv_heads: Optional[int] = Field(
        None, gt=0, description="Number of key/value heads (GQA); defaults to n_heads (full multi-head)."
    )
    head_dim: Optional[int] = Field(
        None, gt=0, le=MAX_WIDTH, description="Width of one head; defaults to d_model / n_heads."
    )
    d_ff: int = Field(..., gt=0, le=MAX_WIDTH, description=f"Width of the feed-forward hidden layer (at most {MAX_WIDTH:,}).")
    vocab_size: int = Field(..., gt=0, le=MAX_WIDTH, description=f"Vocabulary size (rows of the embedding; at most {MAX_WIDTH:,}).")
    max_seq_len: int = Field(2048, gt=0, le=MAX_SEQ, description=f"Longest sequence the model accepts (at most {MAX_SEQ:,}).")
    mlp: Literal["gated", "plain"] = Field(
        "gated", description="gated: down(act(gate(x)) * up(x)) (SwiGLU style); plain: fc2(act(fc1(x)))."
    )
    activation: Literal["silu", "gelu", "gelu_tanh", "relu"] = Field(
        "silu", description="Feed-forward activation function."
    )
    norm: Literal["rmsnorm", "layernorm"] = Field("rmsnorm", description="Normalisation layer kind.")
    norm_eps: float = Field(1e-5, gt=0, description="Epsilon of the normalisation layers.")
    norm_placement: Literal["pre", "post"] = Field(
        "pre", description="pre: x + f(norm(x)); post: norm(x * residual_scale + f(x)) (DeepNet style)."
    )
    residual_scale: float = Field(
        1.0, gt=0, description="Multiplier on the residual in post-norm layers (DeepNet alpha); 1.0 = none."
    )
    block: Literal["sequential", "parallel"] = Field(
        "sequential",
        description="sequential: attention then MLP; parallel: x + attn(norm(x)) + mlp(norm(x)) with one norm (GPT-J, phi).",
    )
    positions: Literal["rope", "learned", "alibi", "none"] = Field(
        "rope", description="Position encoding: rotary, learned absolute table, ALiBi bias, or none."
    )
    rotary_pct: float = Field(
        1.0, gt=0, le=1, description="Fraction of each head's dimensions that RoPE rotates (phi: 0.5)."
    )
    alibi_trainable: bool = Field(
        False, description="ALiBi slopes are trainable parameters (one per head per layer)."
    )
    qkv_bias: bool = Field(False, description="The q, k, v projections have biases.")
    o_bias: bool = Field(False, description="The attention output projection has a bias.")
    mlp_bias: bool = Field(False, description="The feed-forward projections have biases.")
    norm_bias: Optional[bool] = Field(
        None, description="The norms have a bias; defaults to true for layernorm, false for rmsnorm."
    )
    tie_embeddings: bool = Field(False, description="The LM head shares the embedding matrix.")
    lm_head_bias: bool = Field(False, description="The LM head has a bias (phi).")
    final_norm: bool = Field(True, description="A norm after the last layer, before the LM head.")
    attn_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on attention probabilities.")
    resid_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on each sublayer output.")
    embd_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the embeddings.")

    @model_validator(mode="after")
    def _check_shapes(self) -> "ModelSpec":
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}) "
                f"(remainder {self.d_model % self.n_heads}), or give head_dim"
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads}) "
                f"(remainder {self.n_heads % self.kv_heads})"
            )
        if self.positions == "rope" and self.rotary_dim % 2:
            raise ValueError(
                f"rotary dims (head_dim {self.dim_head} x rotary_pct {self.rotary_pct} = {self.rotary_dim}) must be even"
            )
        if self.alibi_trainable and self.positions != "alibi":
            raise ValueError(f"alibi_trainable needs positions 'alibi', not {self.positions!r}")
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.dim_head

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.dim_head

    @property
    def rotary_dim(self) -> int:
        return int(self.dim_head * self.rotary_pct)

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """The projections this model has, as LoRA target names (a plain MLP has no gate)."""
        return tuple(t for t in LORA_TARGETS if t != "gate" or self.mlp == "gated")

    @property
    def has_norm_bias(self) -> bool:
        return self.norm == "layernorm" if self.norm_bias is None else self.norm_bias

    @property
    def norms_per_layer(self) -> int:
        return 1 if self.block == "parallel" else 2


class LoraSpec(_Spec):
    """Low-rank adapters on a frozen base (LoRA; QLoRA when the base is 4-bit)."""

    rank: int = Field(16, gt=0, description="Adapter rank r.")
    alpha: float = Field(32.0, gt=0, description="Adapter scaling numerator (scale = alpha / rank).")
    targets: tuple[str, ...] = Field(
        ("q", "k", "v", "o"), description=f"Projections that get adapters, from {', '.join(LORA_TARGETS)}."
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter input.")
    qlora: bool = Field(False, description="Quantise the frozen base to 4-bit NF4 (QLoRA).")
    quant_block: int = Field(64, gt=0, description="NF4 block size (elements per absmax constant).")
    double_quant: bool = Field(True, description="Quantise the absmax constants too (QLoRA double quantisation).")

    @field_validator("targets", mode="before")
    @classmethod
    def _aliases(cls, v: Any) -> Any:
        return canonical_targets(v) if isinstance(v, (list, tuple)) else v

    @model_validator(mode="after")
    def _check_targets(self) -> "LoraSpec":
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if bad:
            raise ValueError(f"unknown LoRA target(s) {', '.join(bad)}; valid: {', '.join(LORA_TARGETS)}")
        if not self.targets:
            raise ValueError("LoRA needs at least one target")
        return self


Precision = Literal["fp32", "bf16", "fp16", "amp-bf16", "amp-fp16"]
#: the names of memcalc.core.optimizers.OPTIMIZERS (the registry)
Optimizer = Literal[OPTIMIZER_NAMES]  # type: ignore[valid-type]
OptimizerImpl = Literal[IMPLS]  # type: ignore[valid-type]


class TrainingSpec(_Spec):
    """One training step: batch, precision, optimizer and memory techniques."""

    batch: int = Field(1, gt=0, le=MAX_COUNT, description=f"Micro-batch size (sequences per forward pass; at most {MAX_COUNT:,}).")
    seq: int = Field(2048, gt=0, le=MAX_SEQ, description=f"Sequence length in tokens (at most {MAX_SEQ:,}).")
    grad_accum: int = Field(1, gt=0, le=MAX_COUNT, description=f"Gradient-accumulation micro-steps per optimizer step (at most {MAX_COUNT:,}).")
    precision: Precision = Field(
        "fp32",
        description="fp32; bf16/fp16 = pure 16-bit (weights, grads, state); amp-* = autocast over fp32 weights.",
    )
    master_weights: bool = Field(
        False,
        description="ZeRO-paper layout: 16-bit weights and grads plus fp32 master weights and fp32 moments.",
    )
    optimizer: Optimizer = Field("adamw", description="Optimizer whose state and step temporaries are counted.")
    optimizer_impl: OptimizerImpl = Field(
        DEFAULT_IMPL, description="Optimizer implementation (CUDA default for AdamW is foreach; for an optimizer without one, its own step)."
    )
    checkpoint: Literal["none", "full", "every-k", "sqrt", "selective"] = Field(
        "none",
        description="Activation checkpointing: full = every layer, every-k = every K-th layer, sqrt = segments of ~sqrt(n) layers, selective = attention internals only.",
    )
    checkpoint_every: int = Field(2, gt=0, description="K for --checkpoint every-K.")
    fused_optimizer: bool = Field(
        False, description="Run the optimizer step per parameter in post-accumulate-grad hooks (frees grads early)."
    )
    compile: bool = Field(False, description="torch.compile the model (inductor).")
    memory_budget: Optional[float] = Field(
        None, ge=0, le=1, description="torch.compile activation_memory_budget (0 = recompute all, 1 = default)."
    )
    lora: Optional[LoraSpec] = Field(None, description="LoRA/QLoRA adapters; None = full fine-tuning.")
    zero: Literal[0, 1, 2, 3] = Field(0, description="ZeRO stage (1: optimizer state, 2: +grads, 3: +weights sharded).")
    gpus: int = Field(1, gt=0, le=MAX_COUNT, description=f"Data-parallel GPUs that shard under ZeRO (at most {MAX_COUNT:,}).")
    offload_optimizer: bool = Field(False, description="Keep optimizer state (and its step) on the CPU.")

    @model_validator(mode="after")
    def _check(self) -> "TrainingSpec":
        if self.master_weights and self.precision not in ("bf16", "fp16"):
            raise ValueError(
                f"--master-weights keeps 16-bit weights beside fp32 masters; it needs precision bf16 or fp16, not {self.precision}"
            )
        if self.memory_budget is not None and not self.compile:
            raise ValueError("memory_budget applies to torch.compile; set compile too")
        bad_impl = impl_error(self.optimizer, self.optimizer_impl)
        if bad_impl:
            raise ValueError(bad_impl)
        return self

    @property
    def weight_dtype(self) -> DType:
        return {"fp32": DType.fp32, "amp-bf16": DType.fp32, "amp-fp16": DType.fp32, "bf16": DType.bf16, "fp16": DType.fp16}[
            self.precision
        ]

    @property
    def compute_dtype(self) -> DType:
        return {"fp32": DType.fp32, "amp-bf16": DType.bf16, "amp-fp16": DType.fp16, "bf16": DType.bf16, "fp16": DType.fp16}[
            self.precision
        ]

    @property
    def is_amp(self) -> bool:
        return self.precision.startswith("amp-")

    @property
    def compile_partitions(self) -> bool:
        """torch.compile with no checkpointing: the partitioner chooses what backward receives
        (memcalc.compile.compiled). With checkpointing, the tagged regions are recomputed whole."""
        return self.compile and self.checkpoint == "none"


#: ``cross_entropy`` of the kernel profile (``--loss``): on the full logits, or in chunks
LossKind = Literal["full", "chunked"]
LOSSES: tuple[str, ...] = typing.get_args(LossKind)
#: torchtune CEWithChunkedOutputLoss(num_output_chunks=8)
DEFAULT_LOSS_CHUNKS = 8


class KernelProfile(_Spec):
    """What the kernels and the framework's own layers save: PyTorch version, device, layer code.

    The estimator and the meta tracer read the same profile.
    """

    name: str = Field("torch-2.8-cuda", description="Profile name.")
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
    mean_saves_input: bool = Field(
        False, description="mean(x*x) backward keeps its input (PyTorch <= 2.1)."
    )
    cross_entropy: LossKind = Field(
        "full", description="Cross-entropy on the full logits, or in chunks that never hold full fp32 logits."
    )
    loss_chunks: int = Field(
        DEFAULT_LOSS_CHUNKS, gt=0,
        description="With cross_entropy chunked: the logits rows are split into this many chunks, each upcast "
        "to fp32 and reduced on its own (torchtune CEWithChunkedOutputLoss: 8). Inert with cross_entropy full.",
    )
    logits_fp32: bool = Field(False, description="The loss upcasts logits to fp32 first (Hugging Face style).")
    shift_copy: bool = Field(True, description="The loss makes a contiguous copy of the shifted logits.")
    dropout_mask_bytes: int = Field(DROPOUT_MASK_BYTES, ge=1, le=4, description="Bytes per element of a dropout mask (CUDA: bool, 1).")
    allocator_round_bytes: int = Field(ALLOCATOR_ROUND_BYTES, ge=1, description="The caching allocator rounds every block up to this.")


class ExperimentSpec(_Spec):
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

    @model_validator(mode="after")
    def _check_lora_targets(self) -> "ExperimentSpec":
        lora = self.training.lora
        missing = [t for t in lora.targets if t not in self.model.lora_targets] if lora is not None else []
        if missing:
            raise ValueError(lora_targets_error(self.model, missing))
        return self


def lora_targets_error(model: ModelSpec, missing: "typing.Sequence[str]") -> str:
    """The message for LoRA targets a model does not have (gate on a plain MLP)."""
    why = " (its MLP is plain: fc1 = up, fc2 = down, no gate)" if "gate" in missing and model.mlp == "plain" else ""
    return f"LoRA target(s) {', '.join(missing)} not in {model.name}{why}; its targets: {', '.join(model.lora_targets)}"


def sqrt_segments(n_layers: int) -> int:
    """Layers per segment for --checkpoint sqrt: round(sqrt(n)), at least 1."""
    return max(1, round(math.sqrt(n_layers)))
