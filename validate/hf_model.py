"""memcalc's :class:`~memcalc.core.spec.ModelSpec` as a Hugging Face ``transformers`` config, and the
real model built from it (``memcalc validate --framework hf``).

This is the inverse of :mod:`memcalc.inputs.hf_config` (config.json -> ModelSpec). A registry,
:data:`FAMILIES`, keyed by the Hugging Face ``model_type``, holds for each family:

- ``mismatches(m)``: what of the ModelSpec the family's modeling code cannot express (empty =
  it can), read from its ``modeling_*.py`` (transformers 5.23);
- ``config(m)``: the keyword arguments of its configuration class (``AutoConfig.for_model``);
- ``lora_modules``: memcalc's LoRA target names (:data:`memcalc.core.spec.LORA_TARGETS`) as the
  module names PEFT matches (``target_modules``); several memcalc targets that name one fused
  module (GPT-2's ``c_attn`` = q, k, v) must be asked together.

A preset read from a shipped config.json (``data/models/*.yaml`` with ``hf_config``) needs none of
this: when the ModelSpec is that preset's model, :func:`choose_family` returns a family whose config is
the published file cut to the traced depth (:mod:`.hf_presets`), any ``model_type`` transformers knows.

To add a family: write its two functions and one :class:`Family` record, and add the record to
:data:`FAMILIES` (the tests round-trip every family: ModelSpec -> config -> ``from_config``
parameter count == :func:`memcalc.engine.params.count_params`).

Choices the ModelSpec does not carry, fixed here: Mistral's ``sliding_window`` is None (the
estimator assumes no attention mask; Mistral-7B-v0.1's 4096 only matters for longer sequences);
ModelSpec's ``gelu_new`` is transformers' ``gelu_new`` (NewGELUActivation, the composite chain) and
``gelu_tanh`` its ``gelu_pytorch_tanh`` (one fused kernel), in every family.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from memcalc.core.errors import UserError
from memcalc.core.spec import LoraSpec, ModelSpec

_ACT_LLAMA = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "gelu_new": "gelu_new", "relu": "relu"}
_ACT_GPT = _ACT_LLAMA


def _want(m: ModelSpec, **expected: Any) -> list[str]:
    """``field=value (needs expected)`` for each field of ``m`` (or property) that differs."""
    out = []
    for k, v in expected.items():
        have = getattr(m, k)
        if have != v:
            out.append(f"{k}={have!r} (needs {v!r})")
    return out


def _llama_shape(m: ModelSpec) -> list[str]:
    """LlamaDecoderLayer and its siblings: pre-norm RMSNorm (no bias), gated MLP, full RoPE, no
    residual or embedding dropout, a final norm, no head bias."""
    return _want(m, mlp="gated", norm="rmsnorm", has_norm_bias=False, norm_placement="pre", residual_scale=1.0,
                 block="sequential", positions="rope", rotary_pct=1.0, final_norm=True, lm_head_bias=False,
                 resid_dropout=0.0, embd_dropout=0.0)


def _llama_config(m: ModelSpec, act: dict[str, str] = _ACT_LLAMA) -> dict[str, Any]:
    return dict(vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.d_ff,
                num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads, num_key_value_heads=m.kv_heads,
                head_dim=m.dim_head, hidden_act=act[m.activation], max_position_embeddings=m.max_seq_len,
                rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tie_embeddings, attention_dropout=m.attn_dropout)


def _llama_mismatches(m: ModelSpec) -> list[str]:
    # LlamaAttention: q/k/v/o all take bias=config.attention_bias; LlamaMLP: bias=config.mlp_bias
    out = _llama_shape(m)
    if m.qkv_bias != m.o_bias:
        out.append(f"qkv_bias={m.qkv_bias} with o_bias={m.o_bias} (attention_bias sets both)")
    return out


def _llama(m: ModelSpec) -> dict[str, Any]:
    return dict(_llama_config(m), attention_bias=m.qkv_bias, mlp_bias=m.mlp_bias)


def _mistral_mismatches(m: ModelSpec) -> list[str]:
    # MistralAttention / MistralMLP: bias=False everywhere
    return _llama_shape(m) + _want(m, qkv_bias=False, o_bias=False, mlp_bias=False)


def _mistral(m: ModelSpec) -> dict[str, Any]:
    return dict(_llama_config(m), sliding_window=None)


def _qwen2_mismatches(m: ModelSpec) -> list[str]:
    # Qwen2Attention: q/k/v bias=True, o_proj bias=False; Qwen2MLP without bias
    return _llama_shape(m) + _want(m, qkv_bias=True, o_bias=False, mlp_bias=False)


def _qwen2(m: ModelSpec) -> dict[str, Any]:
    return dict(_llama_config(m), use_sliding_window=False)


def _gpt2_mismatches(m: ModelSpec) -> list[str]:
    # GPT2Block: pre-norm LayerNorm with bias, Conv1D c_attn/c_proj/c_fc/c_proj with biases, learned
    # positions (wpe), one head per key (no GQA), head_dim = n_embd / n_head, final ln_f
    out = _want(m, mlp="plain", norm="layernorm", has_norm_bias=True, norm_placement="pre", residual_scale=1.0,
                block="sequential", positions="learned", final_norm=True, lm_head_bias=False, qkv_bias=True,
                o_bias=True, mlp_bias=True, kv_heads=m.n_heads)
    if m.dim_head * m.n_heads != m.d_model:
        out.append(f"head_dim={m.dim_head} (needs d_model / n_heads = {m.d_model // m.n_heads})")
    return out


def _gpt2(m: ModelSpec) -> dict[str, Any]:
    return dict(vocab_size=m.vocab_size, n_positions=m.max_seq_len, n_embd=m.d_model, n_layer=m.n_layers,
                n_head=m.n_heads, n_inner=m.d_ff, activation_function=_ACT_GPT[m.activation],
                layer_norm_epsilon=m.norm_eps, attn_pdrop=m.attn_dropout, resid_pdrop=m.resid_dropout,
                embd_pdrop=m.embd_dropout, tie_word_embeddings=m.tie_embeddings, bos_token_id=0, eos_token_id=0)


def _phi_mismatches(m: ModelSpec) -> list[str]:
    # PhiDecoderLayer: one LayerNorm, attention and MLP in parallel, biases on q/k/v/dense, fc1/fc2 and
    # lm_head, partial RoPE, final_layernorm; head_dim = hidden_size / num_attention_heads
    out = _want(m, mlp="plain", norm="layernorm", has_norm_bias=True, norm_placement="pre", residual_scale=1.0,
                block="parallel", positions="rope", final_norm=True, lm_head_bias=True, qkv_bias=True,
                o_bias=True, mlp_bias=True)
    if m.dim_head * m.n_heads != m.d_model:
        out.append(f"head_dim={m.dim_head} (needs d_model / n_heads = {m.d_model // m.n_heads})")
    return out


def _phi(m: ModelSpec) -> dict[str, Any]:
    return dict(vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.d_ff,
                num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads, num_key_value_heads=m.kv_heads,
                hidden_act=_ACT_GPT[m.activation], max_position_embeddings=m.max_seq_len,
                layer_norm_eps=m.norm_eps, partial_rotary_factor=m.rotary_pct, tie_word_embeddings=m.tie_embeddings,
                attention_dropout=m.attn_dropout, resid_pdrop=m.resid_dropout, embd_pdrop=m.embd_dropout,
                qk_layernorm=False)


_LLAMA_LORA = {"q": ("q_proj",), "k": ("k_proj",), "v": ("v_proj",), "o": ("o_proj",), "gate": ("gate_proj",),
               "up": ("up_proj",), "down": ("down_proj",)}


@dataclass(frozen=True)
class Family:
    """One Hugging Face ``model_type`` (see the module docstring)."""

    model_type: str
    mismatches: Callable[[ModelSpec], list[str]]
    config: Callable[[ModelSpec], dict[str, Any]]
    lora_modules: dict[str, tuple[str, ...]]
    #: memcalc targets that share one module (must be asked together)
    fused: tuple[tuple[str, ...], ...] = field(default=())
    #: a one-line description for error messages
    shape: str = ""
    #: further LoraConfig arguments the family needs (GPT-2's Conv1D stores weights (in, out))
    lora_kwargs: dict[str, Any] = field(default_factory=dict)
    #: the family's q, k, v projection is one module (GPT-2 c_attn): ModelSpec.fused_qkv must say so
    fused_qkv: bool = False
    #: memcalc targets reached through PEFT's ``target_parameters`` (MoE experts), not modules
    lora_params: dict[str, tuple[str, ...]] = field(default_factory=dict)


#: ModelSpec fields of the newer families (issue 12) and their defaults: a family registered here
#: builds none of them, so a model that sets one is not that family (it would trace another model)
_NEWER_FEATURES = (("fused_gate_up", False), ("qk_norm", "none"), ("attn_softcap", None), ("logit_softcap", None),
                   ("attn_sinks", False), ("sliding_window", None), ("embedding_scale", 1.0),
                   ("residual_multiplier", 1.0), ("logit_scale", 1.0), ("parallel_norms", 1), ("moe", None),
                   ("mla", None))


def _feature_mismatches(f: Family, m: ModelSpec) -> list[str]:
    """What ``m`` sets that family ``f`` does not build (the fields of :data:`_NEWER_FEATURES`, and a
    fused or separate q, k, v projection)."""
    out = [f"{k}={getattr(m, k)!r}" for k, default in _NEWER_FEATURES if getattr(m, k) != default]
    if m.fused_qkv != f.fused_qkv:
        out.append(f"fused_qkv={m.fused_qkv}")
    return out


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", _llama_mismatches, _llama, _LLAMA_LORA,
           shape="RMSNorm, gated MLP, RoPE, GQA, head_dim, attention_bias on q/k/v/o, mlp_bias"),
    Family("mistral", _mistral_mismatches, _mistral, _LLAMA_LORA, shape="llama without biases"),
    Family("qwen2", _qwen2_mismatches, _qwen2, _LLAMA_LORA, shape="llama with q/k/v biases only"),
    Family("gpt2", _gpt2_mismatches, _gpt2,
           {"qkv": ("c_attn",), "o": ("attn.c_proj",), "up": ("c_fc",), "down": ("mlp.c_proj",)},
           shape="LayerNorm, plain MLP, learned positions, all biases, fused Conv1D c_attn (fused_qkv)",
           lora_kwargs={"fan_in_fan_out": True}, fused_qkv=True),
    Family("phi", _phi_mismatches, _phi,
           {"q": ("q_proj",), "k": ("k_proj",), "v": ("v_proj",), "o": ("dense",), "up": ("fc1",),
            "down": ("fc2",)},
           shape="parallel block, one LayerNorm, partial RoPE, all biases incl. lm_head"),
)}


def preset_family(m: ModelSpec) -> Optional[Family]:
    """The family of a preset read from a shipped config.json when ``m`` is that preset's model
    (:mod:`.hf_presets`): its config is the published file, cut to ``m.n_layers``."""
    from . import hf_presets

    hit = hf_presets.find_preset(m)
    if hit is None:
        return None
    name, raw = hit
    mt = raw["model_type"]
    return Family(mt, lambda _m: [], lambda mm: hf_presets.config_kwargs(raw, mm.n_layers),
                  hf_presets.lora_modules(mt), shape=f"preset {name}, data/hf_configs", fused_qkv=m.fused_qkv,
                  lora_params=dict(hf_presets.EXPERT_PARAMS))


def choose_family(m: ModelSpec) -> Family:
    """The family that expresses ``m``: a preset's own config.json when ``m`` is such a preset's
    model (:func:`preset_family`), else one whose ``model_type`` is in the model's name first
    (``mistral-7b`` -> mistral), else the first in :data:`FAMILIES` order; a one-line
    :class:`UserError` naming the closest family's differences when none can."""
    pf = preset_family(m)
    if pf is not None:
        return pf
    name = m.name.lower().replace("-", "").replace("_", "")
    order = sorted(FAMILIES.values(), key=lambda f: f.model_type not in name)
    misses = {f.model_type: f.mismatches(m) + _feature_mismatches(f, m) for f in order}
    for f in order:
        if not misses[f.model_type]:
            return f
    near = min(order, key=lambda f: len(misses[f.model_type]))
    supported = "; ".join(f"{f.model_type} ({f.shape})" for f in FAMILIES.values())
    raise UserError(f"--framework hf: model {m.name!r} is none of the Hugging Face families memcalc builds "
                    f"(closest, {near.model_type}, differs in {', '.join(misses[near.model_type])}); "
                    f"supported: {supported}")


def peft_targets(family: Family, lora: LoraSpec) -> list[str]:
    """PEFT ``target_modules`` for memcalc's LoRA targets, in order, each module once."""
    asked = set(lora.targets)
    if "head" in asked:  # every CausalLM's output projection is the module lm_head
        rest = lora.model_copy(update={"targets": tuple(t for t in lora.targets if t != "head")}) if len(asked) > 1 else None
        return (peft_targets(family, rest) if rest is not None else []) + ["lm_head"]
    for group in family.fused:
        got = asked & set(group)
        if got and got != set(group):
            raise UserError(f"--framework hf: {family.model_type} fuses {', '.join(group)} in one module "
                            f"({family.lora_modules[group[0]][0]}); LoRA targets them all or none, "
                            f"not {', '.join(t for t in group if t in got)}")
    missing = [t for t in lora.targets if t not in family.lora_modules]
    if missing:
        raise UserError(f"--framework hf: {family.model_type} has no LoRA target {', '.join(missing)}; "
                        f"its targets: {', '.join(family.lora_modules)}")
    out: list[str] = []
    for t in lora.targets:
        for name in family.lora_modules[t]:
            if name not in out:
                out.append(name)
    return out


def hf_config(m: ModelSpec, family: Optional[Family] = None):
    """The ``transformers`` configuration of ``m`` (``AutoConfig.for_model``)."""
    from transformers import AutoConfig

    family = family or choose_family(m)
    return AutoConfig.for_model(family.model_type, **family.config(m))


def build_hf_model(m: ModelSpec, lora: Optional[LoraSpec], dtype, device: str = "meta", family: Optional[Family] = None):
    """The real model: ``AutoModelForCausalLM.from_config(cfg, dtype=dtype)`` built directly on
    ``device`` (on ``meta``: no weights), in train mode; with ``lora``, PEFT's
    ``get_peft_model(model, LoraConfig(r, lora_alpha, target_modules, lora_dropout))`` with PEFT's
    defaults (``autocast_adapter_dtype=True``: fp32 adapters over a 16-bit base). Returns
    ``(model, family)``."""
    import torch
    from transformers import AutoModelForCausalLM

    family = family or choose_family(m)
    cfg = hf_config(m, family)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if lora is not None:
        import warnings

        from peft import LoraConfig, get_peft_model

        from .hf_presets import patch_peft_meta_autocast

        patch_peft_meta_autocast()
        targets = peft_targets(family, lora)
        params = [p for t in lora.targets for p in family.lora_params.get(t, ())]
        extra = dict(family.lora_kwargs, **({"target_parameters": params} if params else {}))
        cfg = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=targets, lora_dropout=lora.dropout,
                         use_dora=lora.dora, **extra)
        with torch.device(device), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # PEFT calls transformers 5's deprecated aliases
            # PEFT's v4 -> v5 MoE conversion adds rank/alpha patterns for the fused expert parameter,
            # which no *module* matches (it is reached through target_parameters)
            warnings.filterwarnings("ignore", r"The following (rank|alpha)_pattern keys did not match", RuntimeWarning)
            model = get_peft_model(model, cfg)
    model.train()
    return model, family


def param_counts(model) -> tuple[int, int]:
    """(total, trainable) parameter elements of a built model (tied weights counted once)."""
    seen: set[int] = set()
    total = trainable = 0
    for p in model.parameters():  # parameters() yields a shared (tied) tensor once
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if p.requires_grad:
            trainable += p.numel()
    return total, trainable
