"""Reading pieces the family adapters share: the llama-style decoder keys, biases, partial rotary,
the sliding-window pattern, Qwen's sliding refusal, expert counts, Gemma's activation and softcaps;
and the inverse pieces (ModelSpec -> configuration keywords) of the Llama-like families.

Defaults are the family's (``Family.defaults``, its transformers 5.23 configuration class's); the
layout follows each family's ``modeling_*.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from memcalc.core.errors import UserError
from memcalc.inputs.hf_families.base import Fields

if TYPE_CHECKING:
    from memcalc.core.spec import ModelSpec
    from memcalc.inputs.hf_families.reader import Reader


def decoder(r: Reader, *, eps_key: str = "rms_norm_eps", act_key: str = "hidden_act",
            norm: str = "rmsnorm") -> Fields:
    """The fields every llama-style decoder config gives (``*Config`` attribute names), with the
    family's defaults (``r.default``); the shape keys a family gives no default for are required.

    ``num_key_value_heads`` without a default: num_attention_heads. ``head_dim`` without one:
    hidden_size // num_attention_heads (``getattr(config, "head_dim", hidden // heads)`` in the
    modeling files). Further fallbacks (LlamaConfig's): max_position_embeddings 2048, the norm's eps
    1e-6, silu, untied head, attention_dropout 0.
    """
    n_heads = r.int("num_attention_heads")
    d = r.int("hidden_size")
    fields: Fields = dict(
        n_layers=r.int("num_hidden_layers"),
        d_model=d,
        n_heads=n_heads,
        n_kv_heads=r.int("num_key_value_heads", r.default("num_key_value_heads", n_heads)),
        head_dim=r.int("head_dim", r.default("head_dim", d // n_heads)),
        d_ff=r.int("intermediate_size"),
        vocab_size=r.int("vocab_size"),
        max_seq_len=r.int("max_position_embeddings", r.default("max_position_embeddings", 2048)),
        mlp="gated",
        activation=r.activation(act_key, r.default(act_key, "silu")),
        norm=norm,
        norm_eps=r.float(eps_key, r.default(eps_key, 1e-6)),
        positions="rope",
        tie_embeddings=r.bool("tie_word_embeddings", r.default("tie_word_embeddings", False)),
        attn_dropout=r.float("attention_dropout", r.default("attention_dropout", 0.0), hi=0.999),
        final_norm=True,
    )
    return fields


def attention_bias(r: Reader, o: bool = True) -> Fields:
    """``attention_bias`` (default: the family's, else false) on q, k, v (and o unless the family's
    o_proj never has one)."""
    b = r.bool("attention_bias", r.default("attention_bias", False))
    return dict(qkv_bias=b, o_bias=b and o)


def rotary(r: Reader) -> float:
    """The rotated fraction of each head: ``partial_rotary_factor`` (top level, or inside
    ``rope_parameters`` as transformers 5 stores it; default: the family's, else 1)."""
    rp = r.cfg.get("rope_parameters")
    if isinstance(rp, dict) and "partial_rotary_factor" in rp and "partial_rotary_factor" not in r.cfg:
        v = rp["partial_rotary_factor"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
            raise UserError(f"rope_parameters.partial_rotary_factor in {r.where} must be a number in (0, 1], got {v!r}")
        return float(v)
    return r.float("partial_rotary_factor", r.default("partial_rotary_factor", 1.0), lo=1e-9, hi=1.0)


def sliding(r: Reader, *, n_layers: int, every: int = 0, enabled_key: Optional[str] = None,
            pattern_key: Optional[str] = None) -> Fields:
    """``sliding_window`` (default: the family's, else none) and which layers slide, from
    ``layer_types`` (transformers 5) or the family's pattern key (``every``: its default, 0 = every
    layer slides); an irregular layer_types is refused (ModelSpec knows only "every N-th layer
    attends fully").

    ``enabled_key`` (Qwen ``use_sliding_window``): false means no layer slides whatever the window.
    """
    if "sliding_window" in r.cfg:  # an explicit null disables the window (transformers keeps None)
        window = None if r.cfg["sliding_window"] in (None, 0) else r.int("sliding_window")
        r.seen.add("sliding_window")
    else:
        window = r.default("sliding_window", None)
    if enabled_key is not None and not r.bool(enabled_key, False):
        if "layer_types" in r.cfg:
            r.seen.add("layer_types")
        return dict(sliding_window=None, full_attention_every=0)
    default_every = every
    if pattern_key is not None and pattern_key in r.cfg:
        every = r.int(pattern_key, default_every) or 0
    lt = r.cfg.get("layer_types")
    r.seen.add("layer_types")
    if isinstance(lt, list) and lt:
        if len(lt) != n_layers:
            raise UserError(f"layer_types in {r.where} lists {len(lt)} layers; num_hidden_layers is {n_layers}")
        full = [t == "full_attention" for t in lt]
        bad = [t for t in lt if t not in ("full_attention", "sliding_attention")]
        if bad:
            raise UserError(f"layer_types in {r.where}: unsupported {bad[0]!r}; "
                            "valid: full_attention, sliding_attention")
        if all(full):
            return dict(sliding_window=None, full_attention_every=0)
        if not any(full):
            every = 0
        else:
            every = full.index(True) + 1
            if full != [(i + 1) % every == 0 for i in range(n_layers)]:
                raise UserError(f"layer_types in {r.where} is not 'every {every}-th layer attends fully'; "
                                "memcalc models only that pattern")
    if window is None:
        return dict(sliding_window=None, full_attention_every=0)
    if every == 1:  # every layer full
        return dict(sliding_window=None, full_attention_every=0)
    return dict(sliding_window=window, full_attention_every=every)


def no_qwen_sliding(r: Reader) -> None:
    """Qwen's ``use_sliding_window`` (full attention on the first max_window_layers, sliding after) is
    refused; its window keys are then read."""
    if r.bool("use_sliding_window", False):
        raise UserError(f"{r.where}: use_sliding_window true (full attention on the first max_window_layers, "
                        "sliding after) is not supported")
    r.seen.update(("sliding_window", "max_window_layers", "layer_types"))


def experts(r: Reader, *keys: str) -> int:
    """The number of routed experts under the first of ``keys`` present (configs name it variously;
    default: the family's under the first key)."""
    default = r.default(keys[0])
    for k in keys:
        if k in r.cfg:
            for other in keys:
                r.seen.add(other)
            return r.int(k, default)
    return default


def no_mlp_only_layers(r: Reader) -> None:
    v = r.cfg.get("mlp_only_layers")
    r.seen.add("mlp_only_layers")
    if v:
        raise UserError(f"{r.where}: mlp_only_layers {v!r} (dense layers at listed positions) is not supported")


def gemma_act(r: Reader) -> str:
    """``hidden_activation`` (Gemma-2/3), else ``hidden_act``; GemmaConfig maps the legacy "gelu"
    of the first releases to gelu_pytorch_tanh."""
    key = "hidden_activation" if "hidden_activation" in r.cfg else "hidden_act"
    if r.cfg.get(key) == "gelu":
        r.seen.add(key)
        return "gelu_tanh"
    return r.activation(key, "gelu_pytorch_tanh")


def cap(r: Reader, key: str) -> Optional[float]:
    """A softcap (``attn_logit_softcapping``, ``final_logit_softcapping``): null is none; default: the family's."""
    default = r.default(key, None)
    if key in r.cfg and r.cfg[key] is None:
        r.seen.add(key)
        return None
    return r.float(key, default, lo=1e-9) if (key in r.cfg or default is not None) else None


# --- the inverse: ModelSpec -> configuration keywords (the validator's hand-written families) ---

#: ModelSpec.activation -> transformers' ACT2FN name (gelu_new: NewGELUActivation, the composite
#: chain; gelu_tanh: gelu_pytorch_tanh, one fused kernel)
HF_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "gelu_new": "gelu_new",
                  "relu": "relu"}


def want(m: ModelSpec, **expected: Any) -> list[str]:
    """``field=value (needs expected)`` for each field of ``m`` (or property) that differs."""
    out = []
    for k, v in expected.items():
        have = getattr(m, k)
        if have != v:
            out.append(f"{k}={have!r} (needs {v!r})")
    return out


def llama_shape(m: ModelSpec) -> list[str]:
    """LlamaDecoderLayer and its siblings: pre-norm RMSNorm (no bias), gated MLP, full RoPE, no
    residual or embedding dropout, a final norm, no head bias."""
    return want(m, mlp="gated", norm="rmsnorm", has_norm_bias=False, norm_placement="pre", residual_scale=1.0,
                block="sequential", positions="rope", rotary_pct=1.0, final_norm=True, lm_head_bias=False,
                resid_dropout=0.0, embd_dropout=0.0)


def llama_config(m: ModelSpec) -> dict[str, Any]:
    """LlamaConfig's shape keywords (shared by Mistral, Qwen2)."""
    return dict(vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.d_ff,
                num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads, num_key_value_heads=m.kv_heads,
                head_dim=m.dim_head, hidden_act=HF_ACTIVATIONS[m.activation], max_position_embeddings=m.max_seq_len,
                rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tie_embeddings, attention_dropout=m.attn_dropout)


def head_dim_is_default(m: ModelSpec) -> list[str]:
    """GPT-2 / Phi: head_dim is always hidden_size // num_attention_heads."""
    if m.dim_head * m.n_heads != m.d_model:
        return [f"head_dim={m.dim_head} (needs d_model / n_heads = {m.d_model // m.n_heads})"]
    return []
