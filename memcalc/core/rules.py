"""Model-layout and library rules both sides need: the estimator (``memcalc.engine``) and the
validator (``validate/``, which imports them from here and from :mod:`memcalc.core.kernels`,
never from the engine). A rule here says which layers slide, which router groups DeepSeek uses,
what PEFT adapts on routed experts, what torchtune offloads and which tensor-parallel setups
torchtitan covers; each names the library source it is read from. What a kernel allocates or
saves stays in the engine (the estimator's formula) and in its PyTorch twin (the validator's
module); only the choice both must make alike lives here.
"""

from __future__ import annotations

import math

from typing import Optional

from memcalc.core.errors import UserError
from memcalc.core.spec import ExperimentSpec, LoraSpec, ModelSpec


# -- attention: which layers slide, which run eager (transformers 5) -------------------------
def layer_slides(m: ModelSpec, i: int) -> bool:
    """Layer ``i`` attends through the sliding window (HF ``layer_types[i] == "sliding_attention"``):
    every layer when ``full_attention_every`` is 0, else all but those with (i + 1) % N == 0."""
    if m.sliding_window is None:
        return False
    n = m.full_attention_every
    return not (n and (i + 1) % n == 0)


def eager(m: ModelSpec) -> bool:
    """The family runs transformers' eager attention (softcapped scores or attention sinks)."""
    return m.attn_softcap is not None or m.attn_sinks


def sliding_mask_materialised(m: ModelSpec, seq: int) -> bool:
    """An SDPA sliding layer gets an explicit mask: the window is set and ``seq >= window``
    (masking_utils ``_ignore_causal_mask_sdpa``: ``kv_length >= local_attention_size`` -> no skip).
    Below the window the causal mask is skipped (``is_causal=True``: flash, as before).
    The same for every framework profile (PyTorch SDPA has no window argument); a switch for a
    framework with a windowed flash kernel would go here."""
    return m.sliding_window is not None and seq >= m.sliding_window


def mask_types(m: ModelSpec) -> list[str]:
    """The mask types the layers use ("full", "sliding"), in HF's ``causal_mask_mapping`` order."""
    kinds = {"sliding" if layer_slides(m, i) else "full" for i in range(m.n_layers)}
    return [k for k in ("full", "sliding") if k in kinds]


def is_attention_variant(m: ModelSpec) -> bool:
    """The attention block is not Llama's (fused q,k,v, q/k norms, eager or sliding attention)."""
    return m.fused_qkv or m.qk_norm != "none" or eager(m) or m.sliding_window is not None


def is_variant_layer(m: ModelSpec) -> bool:
    """The layer is not one of the original walk's (pre, post, parallel with one norm)."""
    return m.norm_placement in ("sandwich", "output") or m.parallel_norms == 2 or m.residual_multiplier != 1.0


# -- the family's own norm code, the training-time KV cache (transformers 5.24) --------------
def rmsnorm_mode(m: ModelSpec, profile_mode: str) -> str:
    """The RMSNorm formula that runs: ``composite`` (the weight multiply in fp32, the product cast
    back) when the model's own norm code is written that way (``norm_impl`` weight-fp32:
    models/olmo2/modeling_olmo2.py Olmo2RMSNorm.forward ``(self.weight * hidden_states).to(input_dtype)``,
    models/gemma/modeling_gemma.py GemmaRMSNorm.forward ``output * (1.0 + self.weight.float())`` then
    ``type_as(x)``, models/gpt_oss/modeling_gpt_oss.py GptOssRMSNorm), else the profile's
    ``profile_mode`` (LlamaRMSNorm's ``self.weight * hidden_states.to(input_dtype)``: composite-legacy)."""
    return "composite" if m.norm_impl == "weight-fp32" else profile_mode


def kv_cache(m: ModelSpec, checkpoint: str, framework_cache: bool) -> bool:
    """A training forward fills transformers' DynamicCache: a framework that runs transformers' model
    code (``framework_cache``: the profile's ``kv_cache``), the config's ``use_cache`` and no
    activation checkpointing. utils/generic.py ``merge_with_config_defaults`` takes ``use_cache``
    from the config and turns it off only when the model has ``gradient_checkpointing`` set and is
    training (modeling_utils.py ``_set_gradient_checkpointing`` sets it on the inner model for any
    ``every_n_layers``); models/llama/modeling_llama.py LlamaModel.forward then builds
    ``DynamicCache(config=self.config)`` and every attention calls ``cache.update(k, v)``."""
    return framework_cache and m.use_cache and checkpoint == "none" and m.mla is None


# -- multi-head latent attention (DeepSeek-V3) ---------------------------------------------
def rope_width(m: ModelSpec) -> int:
    """Columns of the RoPE tables: ``qk_rope_head_dim`` with MLA (DeepseekV3Config sets
    head_dim to it), else the model's rotary width."""
    return m.mla.qk_rope_head_dim if m.mla is not None else m.rotary_dim


def rope_tables_bytes(framework: str, batch: int, seq: int, width: int, itemsize: int) -> int:
    """The step's RoPE cos and sin, made once after the embedding and alive to the step's end (every
    layer's rotation uses them; its multiplies save them). transformers (hf, trl): models/llama/
    modeling_llama.py ``LlamaModel.forward`` makes ``position_ids = torch.arange(T).unsqueeze(0)`` when the
    batch brings none (the HF Trainer's and TRL's default collators send none), and
    ``LlamaRotaryEmbedding.forward`` returns ``cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)``: two (1, T,
    width) tensors in the hidden states' dtype (``itemsize``), the fp32 ``freqs``/``emb``/``cos()``/``sin()``
    freed inside (transformers 5.24; traced on meta: two ``_to_copy`` outputs of T * width * 2 B each
    in bf16); memcalc's replica builds the same (validate/blocks/sdpa.py ``rope_tables``). litgpt keeps
    the earlier rule, two (B, T, width) fp32 tables (its own are views of the ``cos``/``sin`` buffers,
    litgpt/model.py ``GPT.forward`` ``self.cos[:T]``; its grid agrees with this rule as it is)."""
    if framework == "litgpt":
        return 2 * 4 * batch * seq * width
    return 2 * itemsize * seq * width


def input_require_grads(framework: str, checkpoint: str, embedding_trains: bool) -> bool:
    """Whether the token embedding's output is a leaf that requires grad: ``enable_input_require_grads``'s
    forward hook on the input embeddings, ``output.requires_grad_(True)`` (transformers 5.24 modeling_utils.py).
    transformers registers it whenever it enables checkpointing on a model whose ``main_input_name`` is
    ``input_ids`` (``activation_checkpointing_enable``: ``needs_embedding_grads``), which the HF Trainer calls
    (validate/hf_runner.py); TRL 1.16 ``SFTTrainer.__init__`` with PEFT and ``gradient_checkpointing``
    (trainer/sft_trainer.py l.899-900). A trainable embedding's output requires grad already (no leaf).
    The leaf's ``AccumulateGrad`` node keeps it to the end of backward, gradients flow into the first layer's
    input (and the embedding dropout saves its mask), and the leaf's ``.grad`` stays with it."""
    return framework in ("hf", "trl") and checkpoint != "none" and not embedding_trains


def torchtune_rope_buffers(m: ModelSpec) -> tuple[int, int]:
    """The bytes of torchtune's RoPE buffers, one module shared by every layer (the component
    builders make one ``rope`` and pass it to each layer): ``theta`` (head_dim / 2 fp32) and
    ``cache`` = ``torch.stack([cos, sin], dim=-1)`` over ``max_seq_len`` positions, (max_seq_len,
    head_dim / 2, 2) fp32 (torchtune 0.6.1 models/llama3_1/_position_embeddings.py
    ``Llama3ScaledRoPE.rope_init`` / ``build_rope_cache``; modules/position_embeddings.py
    ``RotaryPositionalEmbeddings`` the same). They live with the weights; the forward takes
    ``self.cache[:seq_len]``, a view (no per-step tables)."""
    half = m.rotary_dim // 2
    return 4 * half, 4 * m.max_seq_len * half * 2


def torchao_nf4_dequant_peak_bytes(numel: int, out_bytes: int) -> int:
    """The most torchao's ``NF4Tensor.get_original_weight`` (torchao 0.14 dtypes/nf4tensor.py; what
    ``LinearNF4`` runs in forward and again in backward, ``weight.to(dtype)``) holds at once for a
    weight of ``numel`` elements dequantized to ``out_bytes`` per element, its result included:
    the two nibble tensors as int64 (``(quantized_data >> 4).to(torch.long)`` and ``& 0b1111``:
    numel/2 elements each), the two ``nf4[...]`` lookups and the two scaled halves (numel/2 each,
    the output dtype) are all locals alive when ``torch.stack`` allocates the result (numel):
    ``8 numel + 3 numel out_bytes`` (14 numel for bf16); the double-quantized scalers are
    numel/64 elements and fall under the allocator's rounding of these."""
    return 8 * numel + 3 * numel * out_bytes


# -- mixture of experts ----------------------------------------------------------------------
def deepseek_groups(n_experts: int) -> tuple[int, int]:
    """(n_group, topk_group) of the group-limited router: V3's 8 and 4 when the experts split
    into 8 groups of at least 2, else one group."""
    g = 8 if n_experts % 8 == 0 and n_experts >= 16 else 1
    return g, max(1, g // 2)


def balanced_rows(routed: int, n_experts: int) -> list[int]:
    """Rows each expert receives of ``routed`` (= tokens x top_k) under ``MoESpec.routing`` balanced: as
    even as rows allow, the first ``routed mod n_experts`` experts one more (the shapes the validator gives
    LitGPT's per-expert ``torch.where`` on meta, validate/trainers/litgpt.py ``BalancedRouting``)."""
    q, r = divmod(routed, n_experts)
    return [q + 1] * r + [q] * (n_experts - r)


def expert_lora_ranks(m: ModelSpec, lora: Optional[LoraSpec]) -> dict[str, int]:
    """LoRA rank per routed-expert tensor (0 = not adapted): ``experts`` targets both at rank r; with
    ``lora_mlp_to_experts`` PEFT maps gate + up onto gate_up_proj at rank 2r (their two adapters fused,
    its rank_pattern) and down onto down_proj at r (peft 0.21 _convert_peft_config_moe)."""
    if lora is None or m.moe is None:
        return {"gate_up_proj": 0, "down_proj": 0}
    t = set(lora.targets)
    r = lora.rank
    gu = r if "experts" in t else 0
    dn = r if "experts" in t else 0
    if m.moe.lora_mlp_to_experts:
        if {"gate", "up"} <= t:
            gu = 2 * r
        elif t & {"gate", "up"}:
            gu = max(gu, r)  # PEFT refuses one without the other; counted as one adapter
        if "down" in t:
            dn = r
    return {"gate_up_proj": gu, "down_proj": dn}


# -- the loss ------------------------------------------------------------------------------
def chunk_rows(rows: int, chunks: int) -> list[int]:
    """Rows per chunk: ``chunks`` pieces whose sizes differ by at most one, the larger first
    (``torch.tensor_split(rows, chunks)`` sizing, as torchtune splits its labels). A chunk is
    empty when there are fewer rows than chunks."""
    q, r = divmod(rows, chunks)
    return [q + 1] * r + [q] * (chunks - r)


def loss_token_count(batch: int, seq: int, fraction: float) -> int:
    """How many of the ``batch * (seq - 1)`` next-token positions reach TRL's fused head (the
    profile's ``loss_tokens``): ``fraction`` of them rounded half up, at least 1 (trl/trainer/utils.py
    ``add_fused_lm_head``: ``hidden_states[mask]`` with ``mask = labels[:, 1:] != -100``). The
    estimator and the validator's label mask (validate/trainers/trl.py) both use it."""
    positions = batch * (seq - 1)
    return min(positions, max(1, math.floor(fraction * positions + 0.5)))


#: LitGPT 0.5.13: litgpt/finetune/lora.py ``fit`` runs ``model(input_ids, lm_head_chunk_size=128)`` (the head
#: in chunks of 128 positions) and litgpt/utils.py ``chunked_cross_entropy(..., chunk_size=128)`` splits the
#: loss rows by the same count (the validator's LitGPT step and the estimator's litgpt head both read it)
LITGPT_LM_HEAD_CHUNK = 128


def framework_model(m: ModelSpec, framework: str, lora: Optional[LoraSpec] = None,
                    fuse_qkv: bool = True) -> tuple[ModelSpec, list[str]]:
    """The model as ``framework``'s own code builds it, and a note per change (the estimate's
    ``--framework`` and the validator's record both apply it). LitGPT 0.5.13 (litgpt/model.py
    ``GPT.__init__``): ``lm_head`` is always its own ``nn.Linear`` (the finetune scripts refuse
    ``train.tie_embeddings``, litgpt/finetune/lora.py ``validate_args``), and
    ``CausalSelfAttention.qkv`` is one fused projection whose q, k, v are views (so attention saving
    v keeps the whole qkv output); LoRA targets q, k, v are then the parts of its ``LoRAQKVLinear``
    (memcalc.engine.blocks.litgpt_lora); an MoE is ``LLaMAMoE`` (``MoESpec.implementation`` litgpt,
    memcalc.engine.blocks.litgpt_moe). ``fuse_qkv`` False keeps the qkv as it is (``memcalc plan``
    chooses LoRA targets itself)."""
    if framework != "litgpt":
        return m, []
    upd: dict = {}
    notes = []
    if m.tie_embeddings:
        upd["tie_embeddings"] = False
        notes.append("framework litgpt: LitGPT's GPT builds its own lm_head (litgpt/model.py GPT.__init__): "
                     "the head is not tied to the embedding")
    if fuse_qkv and not m.fused_qkv and m.mla is None:
        upd["fused_qkv"] = True
    if m.moe is not None and m.moe.implementation != "litgpt":  # litgpt/model.py LLaMAMoE (blocks/litgpt_moe.py)
        upd["moe"] = m.moe.model_copy(update={"implementation": "litgpt"})
        notes.append("framework litgpt: LitGPT's LLaMAMoE runs one LLaMAMLP per expert in an eager loop "
                     "(litgpt/model.py LLaMAMoE.forward), not transformers' grouped experts")
    return (m.model_copy(update=upd) if upd else m), notes


# -- activation offloading ------------------------------------------------------------------
#: torchtune OffloadActivations defaults (min_offload_size, max_fwd_stash_size)
MIN_OFFLOAD_BYTES = 1024
MAX_FWD_STASH = 5


# -- tensor parallelism (torchtitan apply_tp) -------------------------------------------------
#: why ``--tp`` with ``--ep`` is refused (torchtitan 0.3.0 models/common/moe_sharding.py
#: ``_routed_experts_sharding_configs`` with ``enable_ep``: tokens ``Shard(1)`` on the tp axis, experts ``Shard(0)``
#: on ep); ``--tp`` alone on the routed experts is modelled (``engine/tensor_parallel.local_model``,
#: ``engine/blocks/moe.moe_block``)
MOE_TP = ("tp x ep: torchtitan 0.3.0's set_moe_sharding_config(enable_ep=True) shards the MoE's tokens over the tp "
          "axis and the experts over ep; not traced. Without --ep, --tp shards every expert's hidden width")


def check_tp(exp: ExperimentSpec) -> None:
    """Refuse tensor-parallel setups the model does not cover, or shapes ``tp`` does not divide
    (torchtitan divides heads, kv heads, hidden width and vocabulary exactly: its attention views
    ``-1`` local heads, and an uneven DTensor shard would change the local shapes per rank)."""
    tr, m = exp.training, exp.model
    tp = tr.tp
    if tp == 1:
        return
    unsupported = [name for cond, name in (
        (m.mla is not None, "multi-head latent attention"),
        (m.moe is not None and tr.ep > 1, f"--ep ({MOE_TP})"),
        (m.moe is not None and m.moe.shared_expert_gate,
         "Qwen2-MoE's gated shared expert (torchtitan 0.3.0 has no such model to follow)"),
        (m.moe is not None and m.moe.expert_bias, "expert biases (gpt-oss's mlp1/mlp2 layout: not traced)"),
        (m.moe is not None and m.moe.implementation == "litgpt", "LitGPT's per-expert MoE loop"),
        (is_attention_variant(m), "an attention variant (fused qkv, q/k norms, eager or sliding attention)"),
        (m.fused_gate_up, "a fused gate_up projection"),
        (m.block != "sequential" or is_variant_layer(m), "a parallel block or a norm placement variant"),
        (m.norm_placement != "pre", f"{m.norm_placement}-norm layers"),
        (m.positions not in ("rope", "none"), f"{m.positions} positions"),
        (tr.lora is not None, "LoRA / QLoRA adapters"),
        (tr.compile, "torch.compile"),
    ) if cond]
    if unsupported:
        raise UserError(f"--tp {tp} models Llama-style decoders (torchtitan's apply_tp); {m.name} with "
                        f"{', '.join(unsupported)} is not covered")
    sizes = [("n_heads", m.n_heads), ("n_kv_heads", m.kv_heads), ("d_ff", m.d_ff), ("vocab_size", m.vocab_size)]
    if m.moe is not None:  # torchtitan expert_param_placement_dense: w1/w3 Shard(1), w2 Shard(2)
        sizes.append(("d_ff_expert", m.moe.d_ff_expert))
        if m.moe.n_shared_experts:  # _shared_expert_colwise_config: the shared experts' w1/w3 Shard(0)
            sizes.append(("the shared experts' width", m.moe.shared_width))
    for what, n in sizes:
        if n % tp:
            raise UserError(f"--tp {tp} must divide {what} ({n}): {n} / {tp} = {n / tp:g} "
                            f"(remainder {n % tp}); each rank holds {what} / tp (torchtitan shards the "
                            "rows of every column-parallel weight evenly and views whole local heads)")


# -- context parallelism (memcalc.engine.context_parallel) ---------------------------------------
def check_cp(exp: ExperimentSpec) -> None:
    """Refuse context-parallel setups the model does not cover, or shapes ``cp`` does not divide.

    ring: torch 2.13's ``context_parallel`` with its default head-tail load balancer
    (torch/distributed/tensor/experimental/_context_parallel/_load_balancer.py ``_HeadTailLoadBalancer``)
    cuts the sequence into ``2 x cp`` equal chunks, and its ring runs only the flash / memory-efficient /
    cuDNN kernels (``_sdpa_handler``: "CP only supports flash attention and memory efficient attention")
    with ``is_causal`` and no mask. ulysses: DeepSpeed 0.19's ``DistributedAttention`` all-to-all
    (deepspeed/sequence/layer.py ``_generate_layout_params``) asserts the heads divide by the group size
    and the sequence is scattered evenly; an uneven head count takes ``uneven_heads_all2all``, not modelled."""
    tr, m = exp.training, exp.model
    cp = tr.cp
    if cp == 1:
        return
    unsupported = [name for cond, name in (
        (m.mla is not None, "multi-head latent attention"),
        (is_attention_variant(m), "an attention variant (fused qkv, q/k norms, eager or sliding attention)"),
        (m.positions not in ("rope", "none"), f"{m.positions} positions (an additive mask or position table)"),
        (m.attn_dropout > 0, "attention dropout"),
        (tr.compile, "torch.compile"),
        (tr.checkpoint not in ("none", "full"), f"--checkpoint {tr.checkpoint}"),
    ) if cond]
    if unsupported:
        raise UserError(f"--cp {cp} models causal SDPA attention (flash or memory-efficient kernels); {m.name} with "
                        f"{', '.join(unsupported)} is not covered")
    if tr.cp_method == "ring" and tr.seq % (2 * cp):
        raise UserError(f"--cp {cp} --cp-method ring: seq ({tr.seq}) must divide by 2 x cp = {2 * cp} (remainder "
                        f"{tr.seq % (2 * cp)}); torch's load-balanced ring attention gives each rank two of "
                        f"2 x cp equal chunks")
    if tr.cp_method == "ulysses":
        if tr.seq % cp:
            raise UserError(f"--cp {cp} --cp-method ulysses: seq ({tr.seq}) must divide by cp (remainder "
                            f"{tr.seq % cp}); each rank holds seq / cp tokens")
        for what, n in (("n_heads", m.n_heads // tr.tp), ("n_kv_heads", m.kv_heads // tr.tp)):
            if n % cp:
                raise UserError(f"--cp {cp} --cp-method ulysses: {what} ({n}) must divide by cp (remainder "
                                f"{n % cp}); DeepSpeed's all-to-all gives each rank {what} / cp whole heads")


#: the 4-bit base formats ``LoraSpec.quant`` names (``--quant``)
QUANT_METHODS = ("gptq", "awq")
#: GPTQ / AWQ group size (elements of in_features per scale and zero): 128, the default of transformers'
#: GPTQConfig / AwqConfig and of the published 4-bit checkpoints
QUANT_GROUP = 128


def packed_4bit_parts(method: str, in_features: int, out_features: int, group: int = QUANT_GROUP) -> list[int]:
    """Bytes of each buffer of a 4-bit GPTQ / AWQ linear (``LoraSpec.quant``), each its own allocation.
    GPTQ (auto-gptq / gptqmodel ``QuantLinear``: ``qweight`` int32 [in * 4 / 32, out], ``qzeros`` int32
    [ceil(in / group), out * 4 / 32], ``scales`` fp16 [ceil(in / group), out], ``g_idx`` int32 [in]);
    AWQ (AutoAWQ / gptqmodel ``WQLinear_GEMM`` / ``AwqTorchLinear``: ``qweight`` int32 [in, out * 4 / 32],
    ``qzeros`` int32 [in / group, out * 4 / 32], ``scales`` fp16 [in / group, out], no ``g_idx``)."""
    groups = -(-in_features // group)
    parts = [in_features * out_features // 2, groups * out_features // 2, 2 * groups * out_features]
    return [*parts, 4 * in_features] if method == "gptq" else parts


def awq_dequant_peak_bytes(in_features: int, out_features: int, out_bytes: int) -> int:
    """The peak of gptqmodel's ``dequantize_gemm`` (quantization/awq/utils/packing_utils.py) on one weight,
    its result included: ``unpack_awq`` shifts the int32 ``qweight`` to int32 [in, out / 8, 8] (4 bytes an
    element) then ``.to(int8)`` (1); ``reverse_awq_order`` and ``bitwise_and`` each make a new int8 copy while
    the old one is alive (2); then ``scales.repeat_interleave`` (``out_bytes``) and
    ``izeros.repeat_interleave`` (1) beside ``iweight``, ``iweight - izeros`` (int8) and its product with the
    scales (the result, ``out_bytes``): max(5, 3 + 2 x out_bytes) bytes an element (the group-sized zeros
    left out)."""
    n = in_features * out_features
    return max(5 * n, 3 * n + 2 * out_bytes * n)
