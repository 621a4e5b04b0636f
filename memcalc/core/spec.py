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

# the closed vocabularies (Literal types and their values) live in memcalc.core.choices, pydantic-free,
# so that the CLI builds its choices without importing this module
from memcalc.core.choices import (FRAMEWORKS, LORA_DTYPES, LOSSES, PRECISIONS, SHARDINGS, Framework,  # noqa: F401
                                  LoraDType, LossKind, Precision, Sharding)
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

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "qkv", "gate_up", "q_a", "q_b", "kv_a", "kv_b", "experts",
                "head")
#: LoRA on the output projection: PEFT ``target_modules=["lm_head"]``, torchtune ``apply_lora_to_output``,
#: LitGPT ``lora_head``. Every model has it (also with tied embeddings: PEFT 0.21 adapts the lm_head module
#: itself, A: r x d, B: vocab x r, unless ``ensure_weight_tying``), so it is no per-model target.
HEAD_TARGET = "head"
#: PEFT ``target_modules`` names of the same projections (Hugging Face module names of each family's
#: modeling file; source: peft TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING and the modeling_*.py
#: attention/MLP classes). A fused projection is one module: GPT-2 ``c_attn``, Phi-3 ``qkv_proj``,
#: GPT-NeoX/Falcon ``query_key_value`` are ``qkv`` (one adapter, A: r x d, B: (q+2kv) x r);
#: Phi-3/GLM-4 ``gate_up_proj`` is ``gate_up``. DeepSeek MLA: ``q_a_proj``, ``q_b_proj``,
#: ``kv_a_proj_with_mqa``, ``kv_b_proj``. ``experts``: the routed experts' 3-D parameters
#: (transformers 5 stores them as nn.Parameter, which ``target_modules`` never reaches; PEFT 0.21
#: adapts them only through ``target_parameters`` = experts.gate_up_proj, experts.down_proj,
#: peft/tuners/lora/layer.py ParamWrapper: A r*E x in, B out x r*E).
LORA_TARGET_ALIASES = {
    "q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
    "gate_proj": "gate", "up_proj": "up", "down_proj": "down",
    "c_attn": "qkv", "qkv_proj": "qkv", "query_key_value": "qkv", "gate_up_proj": "gate_up",
    "q_a_proj": "q_a", "q_b_proj": "q_b", "kv_a_proj_with_mqa": "kv_a", "kv_b_proj": "kv_b",
    "w1": "gate", "w3": "up", "w2": "down",  # Mixtral's v4 expert names, which PEFT maps onto the experts
    "lm_head": "head", "output": "head",  # PEFT / torchtune names of the output projection
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


class MoESpec(_Spec):
    """Mixture-of-experts feed-forward layers (Mixtral, Qwen-MoE, DeepSeek, gpt-oss)."""

    n_experts: int = Field(..., gt=0, description="Routed experts per MoE layer (num_local_experts / num_experts / n_routed_experts).")
    top_k: int = Field(..., gt=0, description="Experts each token is routed to (num_experts_per_tok).")
    d_ff_expert: int = Field(..., gt=0, description="Feed-forward width of one routed expert (moe_intermediate_size).")
    n_shared_experts: int = Field(0, ge=0, description="Shared experts every token passes through (DeepSeek n_shared_experts; Qwen2-MoE: 1).")
    d_ff_shared: Optional[int] = Field(
        None, gt=0,
        description="Width of the shared-expert MLP (all shared experts as one); defaults to n_shared_experts x d_ff_expert (DeepSeek).",
    )
    shared_expert_gate: bool = Field(False, description="A sigmoid gate Linear(d_model, 1) scales the shared expert (Qwen2-MoE).")
    first_dense_layers: int = Field(0, ge=0, description="The first layers use the dense MLP of width d_ff instead (DeepSeek first_k_dense_replace).")
    every: int = Field(1, gt=0, description="Every N-th layer is MoE, the others dense (Qwen2-MoE decoder_sparse_step: layer i is MoE when (i + 1) % N == 0).")
    router_bias: bool = Field(False, description="The router has a bias (gpt-oss).")
    expert_bias: bool = Field(False, description="The experts' projections have biases (gpt-oss).")
    lora_mlp_to_experts: bool = Field(
        False,
        description="PEFT turns the MLP LoRA targets (gate, up, down) of this model type into adapters on the routed "
        "experts (gate_up at rank 2r, down at r) and adapts no dense or shared-expert MLP (peft 0.21 "
        "_convert_peft_config_moe for transformers 5: Mixtral, Qwen3-MoE, DeepSeek-V2/V3).",
    )
    routing: Literal["balanced"] = Field(
        "balanced", description="Activation assumption: tokens spread evenly over experts (each gets batch x seq x top_k / n_experts rows)."
    )
    router: Literal["softmax", "softmax-fp32", "sigmoid"] = Field(
        "softmax",
        description="The router's computation, which sets the routing weights' dtype: softmax = Qwen2/3-MoE (fp32 "
                    "softmax, top-k weights cast back to the model dtype); softmax-fp32 = Mixtral (the weights stay "
                    "fp32, so the weighted expert outputs are fp32); sigmoid = DeepSeek-V3 (router linear in fp32, "
                    "sigmoid scores, group-limited top-k, fp32 weights).",
    )

    @model_validator(mode="after")
    def _check(self) -> "MoESpec":
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= n_experts ({self.n_experts})")
        if self.d_ff_shared is not None and not self.n_shared_experts:
            raise ValueError(f"d_ff_shared ({self.d_ff_shared}) needs n_shared_experts > 0")
        if self.shared_expert_gate and not self.n_shared_experts:
            raise ValueError("shared_expert_gate needs n_shared_experts > 0")
        return self

    @property
    def shared_width(self) -> int:
        """Width of the shared-expert MLP (0 without shared experts)."""
        return self.d_ff_shared if self.d_ff_shared is not None else self.n_shared_experts * self.d_ff_expert

    def is_moe_layer(self, i: int) -> bool:
        """Layer ``i`` (0-based) has the MoE block (else the dense MLP of width d_ff)."""
        return i >= self.first_dense_layers and (i + 1) % self.every == 0


class MLASpec(_Spec):
    """DeepSeek-V2/V3 multi-head latent attention: low-rank q and compressed kv projections."""

    q_lora_rank: Optional[int] = Field(
        None, gt=0, description="Rank of the q compression (q_a_proj, q_a_layernorm, q_b_proj); None = one q_proj (V2-Lite)."
    )
    kv_lora_rank: int = Field(..., gt=0, description="Rank of the compressed kv latent (kv_a_proj_with_mqa, kv_a_layernorm).")
    qk_nope_head_dim: int = Field(..., gt=0, description="Per-head query/key dimensions without rotary embedding.")
    qk_rope_head_dim: int = Field(..., gt=0, description="Per-head query/key dimensions with rotary embedding (the key part is shared by all heads).")
    v_head_dim: int = Field(..., gt=0, description="Per-head value dimension.")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


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
    activation: Literal["silu", "gelu", "gelu_tanh", "gelu_new", "relu"] = Field(
        "silu", description="Feed-forward activation function (gelu_new: Hugging Face's NewGELUActivation, the tanh "
        "approximation written as pointwise ops; how it runs is the kernel profile's gelu_new)."
    )
    norm: Literal["rmsnorm", "layernorm"] = Field("rmsnorm", description="Normalisation layer kind.")
    norm_eps: float = Field(1e-5, gt=0, description="Epsilon of the normalisation layers.")
    norm_placement: Literal["pre", "post", "sandwich", "output"] = Field(
        "pre",
        description="pre: x + f(norm(x)); post: norm(x * residual_scale + f(x)) (DeepNet style); "
        "sandwich: x + post_norm(f(pre_norm(x))) (Gemma-2/3, GLM-4: 4 norms a layer); "
        "output: x + norm(f(x)), no pre-norm (OLMo-2).",
    )
    residual_scale: float = Field(
        1.0, gt=0, description="Multiplier on the residual in post-norm layers (DeepNet alpha); 1.0 = none."
    )
    block: Literal["sequential", "parallel"] = Field(
        "sequential",
        description="sequential: attention then MLP; parallel: x + attn(norm(x)) + mlp(norm(x)) with one norm (GPT-J, phi).",
    )
    parallel_norms: Literal[1, 2] = Field(
        1, description="With a parallel block: one shared norm (phi, Cohere) or one each for attention and MLP "
        "(GPT-NeoX use_parallel_residual, Falcon new_decoder_architecture)."
    )
    qk_norm: Literal["none", "head", "head_unshared", "full"] = Field(
        "none",
        description="A norm (of the model's norm kind, no bias) on queries and keys: head = over each head with one "
        "weight of head_dim (Qwen3, Gemma-3); head_unshared = over each head with a weight per head (Cohere "
        "use_qk_norm, StableLM qk_layernorm); full = over the whole projection (OLMo-2).",
    )
    attn_softcap: Optional[float] = Field(
        None, gt=0, description="Attention logits capped as c * tanh(s / c) (Gemma-2 attn_logit_softcapping); None = none."
    )
    logit_softcap: Optional[float] = Field(
        None, gt=0, description="Output logits capped as c * tanh(z / c) (Gemma-2 final_logit_softcapping); None = none."
    )
    attn_sinks: bool = Field(False, description="A learned sink logit per head per layer joins the softmax (gpt-oss).")
    sliding_window: Optional[int] = Field(
        None, gt=0, description="Sliding-window attention span in tokens; None = full attention everywhere."
    )
    full_attention_every: int = Field(
        0, ge=0,
        description="With a sliding window: 0 = every layer slides; N > 0 = layers with (i + 1) % N == 0 attend "
        "fully, the others slide (Gemma-2, gpt-oss: 2; Gemma-3: 6).",
    )
    embedding_scale: float = Field(
        1.0, gt=0, description="Multiplier on the embeddings (Gemma: sqrt(d_model); Granite embedding_multiplier); 1.0 = none."
    )
    residual_multiplier: float = Field(
        1.0, gt=0, description="Multiplier on each sublayer output before the residual add (Granite); 1.0 = none."
    )
    logit_scale: float = Field(
        1.0, gt=0, description="Multiplier on the output logits (Cohere logit_scale, Granite 1 / logits_scaling); 1.0 = none."
    )
    fused_qkv: bool = Field(
        False, description="q, k, v are one projection (GPT-2 c_attn, Phi-3 qkv_proj, GPT-NeoX/Falcon query_key_value): LoRA target qkv."
    )
    fused_gate_up: bool = Field(
        False, description="gate and up are one projection (Phi-3, GLM-4 gate_up_proj): LoRA target gate_up."
    )
    moe: Optional[MoESpec] = Field(None, description="Mixture-of-experts feed-forward layers; None = dense.")
    mla: Optional[MLASpec] = Field(
        None, description="Multi-head latent attention (DeepSeek-V2/V3) instead of q/k/v projections; None = standard attention."
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
        if self.parallel_norms == 2 and self.block != "parallel":
            raise ValueError("parallel_norms 2 needs block 'parallel'")
        if self.block == "parallel" and self.norm_placement != "pre":
            raise ValueError(f"a parallel block is pre-norm; norm_placement {self.norm_placement!r} needs block 'sequential'")
        if self.full_attention_every and self.sliding_window is None:
            raise ValueError(f"full_attention_every ({self.full_attention_every}) needs a sliding_window")
        if self.fused_gate_up and self.mlp != "gated":
            raise ValueError("fused_gate_up needs a gated MLP")
        if self.mla is not None and (self.fused_qkv or self.qk_norm != "none"):
            raise ValueError("multi-head latent attention (mla) has no q/k/v projections: no fused_qkv or qk_norm")
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
        """The projections this model has, as LoRA target names (a plain MLP has no gate; a fused
        projection is one target; MLA has its own; dense MLP targets only where a dense MLP or a
        shared expert exists; ``experts`` on MoE models)."""
        if self.mla is not None:
            attn = ("q",) if self.mla.q_lora_rank is None else ("q_a", "q_b")
            attn = attn + ("kv_a", "kv_b", "o")
        else:
            attn = ("qkv", "o") if self.fused_qkv else ("q", "k", "v", "o")
        mlp: tuple[str, ...] = ()
        if self.moe is None or self.moe.n_shared_experts or self.has_dense_mlp_layers or self.moe.lora_mlp_to_experts:
            if self.mlp == "plain":
                mlp = ("up", "down")
            else:
                mlp = ("gate_up", "down") if self.fused_gate_up else ("gate", "up", "down")
        return attn + mlp + (("experts",) if self.moe is not None else ())

    @property
    def attention_lora_targets(self) -> tuple[str, ...]:
        """The default LoRA targets (q, k, v, o) as this model has them: qkv, o on a fused projection;
        the MLA projections on DeepSeek."""
        return tuple(t for t in self.lora_targets if t not in ("gate", "up", "down", "gate_up", "experts"))

    @property
    def has_dense_mlp_layers(self) -> bool:
        """Some layer has the dense MLP of width d_ff (every layer without MoE)."""
        return self.moe is None or any(not self.moe.is_moe_layer(i) for i in range(self.n_layers))

    @property
    def has_norm_bias(self) -> bool:
        return self.norm == "layernorm" if self.norm_bias is None else self.norm_bias

    @property
    def norms_per_layer(self) -> int:
        if self.block == "parallel":
            return self.parallel_norms
        return 4 if self.norm_placement == "sandwich" else 2


class LoraSpec(_Spec):
    """Low-rank adapters on a frozen base (LoRA; QLoRA when the base is 4-bit)."""

    rank: int = Field(16, gt=0, description="Adapter rank r.")
    alpha: float = Field(32.0, gt=0, description="Adapter scaling numerator (scale = alpha / rank).")
    targets: tuple[str, ...] = Field(
        ("q", "k", "v", "o"),
        description=f"Projections that get adapters, from {', '.join(LORA_TARGETS)} (those the model has: "
        "qkv / gate_up on fused projections, q_a, q_b, kv_a, kv_b on MLA, experts on MoE).",
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter input.")
    qlora: bool = Field(False, description="Quantise the frozen base to 4-bit NF4 (QLoRA).")
    quant_block: int = Field(64, gt=0, description="NF4 block size (elements per absmax constant).")
    double_quant: bool = Field(True, description="Quantise the absmax constants too (QLoRA double quantisation).")
    dora: bool = Field(
        False, description="DoRA (weight-decomposed LoRA, PEFT use_dora=True): a trainable magnitude vector per "
        "target and the column norm of W + scale * B @ A in every forward.")
    dtype: Optional[LoraDType] = Field(
        None,
        description="Adapter weights (and so their gradients and optimizer state): fp32, or model = the base's "
        "weight dtype; None = the framework's (the kernel profile's lora_dtype: hf -> fp32, PEFT "
        "autocast_adapter_dtype=True; plain, torchtune, litgpt -> model).",
    )

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
        if self.dora and "experts" in self.targets:
            # peft/tuners/lora/layer.py ParamWrapper.update_layer: "lora.ParamWrapper does not work with use_dora=True."
            raise ValueError("DoRA cannot adapt the MoE experts: PEFT's ParamWrapper (target_parameters) refuses "
                             "use_dora=True; drop the experts target or --dora")
        return self


#: the names of memcalc.core.optimizers.OPTIMIZERS (the registry)
Optimizer = Literal[OPTIMIZER_NAMES]  # type: ignore[valid-type]
OptimizerImpl = Literal[IMPLS]  # type: ignore[valid-type]


class DeepSpeedSpec(_Spec):
    """DeepSpeed ZeRO's own settings (a ``ds_config.json``'s ``zero_optimization``), with the
    defaults of deepspeed/runtime/zero/config.py ``DeepSpeedZeroConfig`` (0.19). Sizes are in
    elements, as DeepSpeed counts them. Read by :mod:`memcalc.inputs.deepspeed_config`; modelled
    by :mod:`memcalc.engine.deepspeed`."""

    stage: Literal[2, 3] = Field(2, description="zero_optimization.stage: 2 shards fp32 master weights, optimizer "
                                 "state and gradients; 3 also the 16-bit weights.")
    reduce_bucket_size: int = Field(500_000_000, gt=0, le=10**12, description="zero_optimization.reduce_bucket_size: "
                                    "elements reduced at once (the gradient bucket; DeepSpeed default 5e8).")
    allgather_bucket_size: int = Field(500_000_000, ge=0, le=10**12, description="zero_optimization."
                                       "allgather_bucket_size: elements all-gathered at once after a ZeRO-2 step "
                                       "(default 5e8).")
    overlap_comm: Optional[bool] = Field(None, description="zero_optimization.overlap_comm: reduce on a side stream "
                                         "(ZeRO-3 keeps two reduce buckets, ZeRO-2 keeps the ipg buckets until the "
                                         "step); None = DeepSpeed's default (true under stage 3, false under 2).")
    contiguous_gradients: bool = Field(True, description="zero_optimization.contiguous_gradients: ZeRO-2 copies each "
                                       "reduced gradient partition into one preallocated flat buffer.")
    prefetch_bucket_size: int = Field(50_000_000, ge=0, le=10**12, description="zero_optimization."
                                      "stage3_prefetch_bucket_size: elements ZeRO-3 prefetches ahead (default 5e7).")
    max_live_parameters: int = Field(1_000_000_000, ge=0, le=10**13, description="zero_optimization."
                                     "stage3_max_live_parameters: gathered elements ZeRO-3 keeps alive (default 1e9).")
    max_reuse_distance: int = Field(1_000_000_000, ge=0, le=10**13, description="zero_optimization."
                                    "stage3_max_reuse_distance: a parameter reused within this many elements stays "
                                    "gathered (default 1e9).")
    param_persistence_threshold: int = Field(100_000, ge=0, le=10**13, description="zero_optimization."
                                             "stage3_param_persistence_threshold: ZeRO-3 keeps parameters of at most "
                                             "this many elements whole on every rank (default 1e5).")
    offload_param: bool = Field(False, description="zero_optimization.offload_param.device cpu/nvme: ZeRO-3 keeps the "
                                "16-bit weight partitions in host memory.")

    @property
    def overlap(self) -> bool:
        """overlap_comm as DeepSpeed resolves it (config.py ``overlap_comm_valid``)."""
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm


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
    checkpoint: Literal["none", "full", "every-k", "sqrt", "selective", "selective-op"] = Field(
        "none",
        description="Activation checkpointing: full = every layer, every-k = every K-th layer, sqrt = segments of ~sqrt(n) layers, selective = attention internals only, selective-op = torchtitan's op-level policy (every layer, keeping every other matmul output and the attention outputs).",
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
    sharding: Sharding = Field(
        "fsdp2",
        description="How the ZeRO stage runs over the data-parallel GPUs: fsdp2 (torch.distributed fully_shard per "
        "layer and root; zero 3 = reshard_after_forward=True, zero 2 = False), fsdp1 (FullyShardedDataParallel "
        "FULL_SHARD / SHARD_GRAD_OP), or deepspeed (ZeRO-2/3 with its reduce and prefetch buckets).",
    )
    tp: int = Field(1, gt=0, le=MAX_COUNT, description="Tensor-parallel degree: Megatron-style column/row parallel "
                    "linears (DTensor parallelize_module); the GPUs of one replica. Total GPUs = gpus x tp.")
    sequence_parallel: bool = Field(
        False, description="With tp > 1: norms and dropout run on sequence shards (Megatron sequence parallelism).")
    activation_offload: bool = Field(
        False, description="Move saved activations to host memory during forward and back for backward "
        "(torchtune OffloadActivations); the host memory it needs is reported.")
    deepspeed: Optional[DeepSpeedSpec] = Field(
        None, description="DeepSpeed ZeRO settings (from --deepspeed ds_config.json); used with sharding deepspeed. "
        "None = DeepSpeed's defaults for the --zero stage.")

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
        if self.deepspeed is not None and (self.sharding != "deepspeed" or self.zero != self.deepspeed.stage):
            raise ValueError(f"a DeepSpeed config (ZeRO stage {self.deepspeed.stage}) needs sharding deepspeed and "
                             f"zero {self.deepspeed.stage}, not sharding {self.sharding} and zero {self.zero}")
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


#: torchtune CEWithChunkedOutputLoss(num_output_chunks=8)
DEFAULT_LOSS_CHUNKS = 8


class KernelProfile(_Spec):
    """What the kernels and the framework's own layers save: PyTorch version, device, layer code.

    The estimator and the meta tracer read the same profile.
    """

    name: str = Field("torch-2.8-cuda", description="Profile name.")
    framework: Framework = Field(
        "plain",
        description="Whose layer code runs the model: plain (memcalc's own PyTorch replica, the reference configs' "
        "build), hf (transformers 5.x + PEFT), torchtune, litgpt. What a framework changes is set by the "
        "profile's rule fields (rmsnorm, logits_fp32, shift_copy, cross_entropy, lora_dtype, lora_input_cast, "
        "sdpa_gqa, gelu_new; memcalc.inputs.profiles.FRAMEWORKS).",
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

    @property
    def adapter_dtype(self) -> Optional[DType]:
        """The LoRA adapters' dtype (their weights, gradients and optimizer state): the LoRA spec's
        ``dtype``, else the framework's (``profile.lora_dtype``); ``model`` = the training's weight
        dtype. None without LoRA."""
        lora = self.training.lora
        if lora is None:
            return None
        return DType.fp32 if (lora.dtype or self.profile.lora_dtype) == "fp32" else self.training.weight_dtype

    @model_validator(mode="after")
    def _check_lora_targets(self) -> "ExperimentSpec":
        lora = self.training.lora
        missing = [t for t in lora.targets if t not in self.model.lora_targets and t != HEAD_TARGET] if lora is not None else []
        if missing:
            raise ValueError(lora_targets_error(self.model, missing))
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
