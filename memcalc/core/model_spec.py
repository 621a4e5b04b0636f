"""The model's spec: a decoder-only transformer (:class:`ModelSpec`), with its mixture-of-experts
(:class:`MoESpec`) and latent-attention (:class:`MLASpec`) parts. Every field's description is
its help text; imported through :mod:`memcalc.core.spec`."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, PrivateAttr, model_validator

from memcalc.core.spec_base import MAX_LAYERS, MAX_SEQ, MAX_WIDTH, Spec


class MoESpec(Spec):
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
    implementation: Literal["grouped_mm", "litgpt"] = Field(
        "grouped_mm",
        description="How the routed experts are stored and run: grouped_mm = transformers 5's 3-D expert tensors "
                    "and grouped matmul (the default); litgpt = LitGPT 0.5.13's LLaMAMoE (one LLaMAMLP per expert, "
                    "top-k of the router logits then an fp32 softmax over the k, an eager torch.where loop over "
                    "the experts; LoRA gate/up/down adapts every expert's projections and the router). "
                    "--framework litgpt sets it; the router field is then unused.",
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


class MLASpec(Spec):
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


class HfSource:
    """The Hugging Face ``config.json`` a ModelSpec was read from (``memcalc.inputs.hf_config``), so the
    HF validator traces that exact file (``validate/hf_model.py``). Provenance, not identity: it
    compares equal to any other source and to none, so two specs with the same fields stay equal."""

    __slots__ = ("config", "fields", "where")

    def __init__(self, config: dict[str, Any], where: str, fields: dict[str, Any]) -> None:
        self.config, self.where, self.fields = config, where, fields

    def __eq__(self, other: object) -> bool:
        return other is None or isinstance(other, HfSource)

    __hash__ = None  # type: ignore[assignment]


#: ModelSpec fields a config.json's source still matches when they differ (the traced depth, the label)
SOURCE_FREE_FIELDS = frozenset({"n_layers", "name"})


class ModelSpec(Spec):
    """A decoder-only transformer, described by the shapes that decide its memory."""

    #: the config.json this spec was read from (:class:`HfSource`; None for a spec written as fields)
    _hf_source: Optional[HfSource] = PrivateAttr(None)

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
    norm_impl: Literal["framework", "weight-fp32", "layernorm-ops"] = Field(
        "framework",
        description="Whose norm code runs: framework = the framework's (the profile's rmsnorm; LayerNorm as "
        "F.layer_norm); weight-fp32 = an RMSNorm that multiplies the weight in fp32 and casts the product back "
        "(transformers Olmo2RMSNorm, GemmaRMSNorm, GptOssRMSNorm: the composite formula whatever the profile says); "
        "layernorm-ops = a LayerNorm written as fp32 ops (transformers CohereLayerNorm: mean, x - mean twice, "
        "rsqrt, weight multiply; each difference saved).",
    )
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
    use_cache: bool = Field(
        False, description="transformers' config use_cache: a training forward without activation checkpointing "
        "builds a DynamicCache (modeling_*.py ``if use_cache and cache is None``), whose update copies each "
        "layer's K and V (cache_utils.py DynamicLayer.update: torch.cat); attention uses and saves the copies. "
        "Every transformers config class defaults it to true; memcalc's own presets to false.",
    )

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
        kind = {"weight-fp32": "rmsnorm", "layernorm-ops": "layernorm"}.get(self.norm_impl, self.norm)
        if self.norm != kind:
            raise ValueError(f"norm_impl {self.norm_impl!r} needs norm {kind!r}, not {self.norm!r}")
        if self.mla is not None and (self.fused_qkv or self.qk_norm != "none"):
            raise ValueError("multi-head latent attention (mla) has no q/k/v projections: no fused_qkv or qk_norm")
        return self

    def with_hf_source(self, config: dict[str, Any], where: str) -> ModelSpec:
        """This spec, remembering the config.json it was read from (kept by ``model_copy``)."""
        self._hf_source = HfSource(config, where, self.model_dump(exclude=set(SOURCE_FREE_FIELDS)))
        return self

    @property
    def hf_source(self) -> Optional[HfSource]:
        """The config.json this spec was read from, while the spec is still that file's model (any
        depth, any name); None when it was written as fields or changed since."""
        src = self._hf_source
        if src is None or self.model_dump(exclude=set(SOURCE_FREE_FIELDS)) != src.fields:
            return None
        return src

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
        if self.moe is None or self.moe.n_shared_experts or self.has_dense_mlp_layers or self.moe.lora_mlp_to_experts \
                or self.moe.implementation == "litgpt":
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
