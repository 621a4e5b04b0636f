"""Shared pieces of the Hugging Face config readers: the llama-style decoder fields and the
sliding-window pattern. Defaults are the transformers 5.23 configuration classes' (each
family module passes its own); the layout follows each family's ``modeling_*.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from memcalc.core.errors import UserError

if TYPE_CHECKING:  # the reader class lives in memcalc.inputs.hf_config (typed key access)
    from memcalc.inputs.hf_config import _Reader

Fields = dict[str, Any]


def decoder(r: "_Reader", *, vocab: int, hidden: int, inter: int, layers: int, heads: int,
            kv_heads: Optional[int] = None, head_dim: Optional[int] = None, max_pos: int = 2048,
            eps: float = 1e-6, eps_key: str = "rms_norm_eps", act: str = "silu", act_key: str = "hidden_act",
            tie: bool = False, norm: str = "rmsnorm") -> Fields:
    """The fields every llama-style decoder config gives (``*Config`` attribute names).

    ``kv_heads`` None: the default is num_attention_heads. ``head_dim`` None: the default is
    hidden_size // num_attention_heads (``getattr(config, "head_dim", hidden // heads)`` in the
    modeling files); a family whose config class declares head_dim passes its default.
    """
    n_heads = r.int("num_attention_heads", heads)
    d = r.int("hidden_size", hidden)
    fields: Fields = dict(
        n_layers=r.int("num_hidden_layers", layers),
        d_model=d,
        n_heads=n_heads,
        n_kv_heads=r.int("num_key_value_heads", kv_heads if kv_heads is not None else n_heads),
        head_dim=r.int("head_dim", head_dim if head_dim is not None else d // n_heads),
        d_ff=r.int("intermediate_size", inter),
        vocab_size=r.int("vocab_size", vocab),
        max_seq_len=r.int("max_position_embeddings", max_pos),
        mlp="gated",
        activation=r.activation(act_key, act),
        norm=norm,
        norm_eps=r.float(eps_key, eps),
        positions="rope",
        tie_embeddings=r.bool("tie_word_embeddings", tie),
        attn_dropout=r.float("attention_dropout", 0.0, hi=0.999),
        final_norm=True,
    )
    return fields


def attention_bias(r: "_Reader", default: bool = False, o: bool = True) -> Fields:
    """``attention_bias`` on q, k, v (and o unless the family's o_proj never has one)."""
    b = r.bool("attention_bias", default)
    return dict(qkv_bias=b, o_bias=b and o)


def rotary(r: "_Reader", default: float = 1.0) -> float:
    """The rotated fraction of each head: ``partial_rotary_factor`` (top level, or inside
    ``rope_parameters`` as transformers 5 stores it)."""
    rp = r.cfg.get("rope_parameters")
    if isinstance(rp, dict) and "partial_rotary_factor" in rp and "partial_rotary_factor" not in r.cfg:
        v = rp["partial_rotary_factor"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
            raise UserError(f"rope_parameters.partial_rotary_factor in {r.where} must be a number in (0, 1], got {v!r}")
        return float(v)
    return r.float("partial_rotary_factor", default, lo=1e-9, hi=1.0)


def sliding(r: "_Reader", *, default_window: Optional[int], default_every: int, n_layers: int,
            enabled_key: Optional[str] = None, pattern_key: Optional[str] = None) -> Fields:
    """``sliding_window`` and which layers slide, from ``layer_types`` (transformers 5) or the
    family's pattern key; an irregular layer_types is refused (ModelSpec knows only
    "every N-th layer attends fully").

    ``enabled_key`` (Qwen ``use_sliding_window``): false means no layer slides whatever the window.
    """
    if "sliding_window" in r.cfg:  # an explicit null disables the window (transformers keeps None)
        window = None if r.cfg["sliding_window"] in (None, 0) else r.int("sliding_window")
        r.seen.add("sliding_window")
    else:
        window = default_window
    if enabled_key is not None and not r.bool(enabled_key, False):
        if "layer_types" in r.cfg:
            r.seen.add("layer_types")
        return dict(sliding_window=None, full_attention_every=0)
    every = default_every
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
            raise UserError(f"layer_types in {r.where}: unsupported {bad[0]!r}; valid: full_attention, sliding_attention")
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
