"""Read a Hugging Face ``config.json`` (offline, no transformers import) into a ModelSpec.

``model_type`` decides which keys are read; the defaults are those of the matching
``transformers`` configuration class (``LlamaConfig``, ``MistralConfig``,
``Qwen2Config``, ``GPT2Config``, ``PhiConfig``), so a config.json that omits a key
means what it means to transformers. The module layout each family implies (biases,
norms, tied head, parallel block) follows its ``modeling_*.py``:

* llama: q/k/v/o biases iff ``attention_bias``; MLP biases iff ``mlp_bias``; RMSNorm.
* mistral: no biases; RMSNorm; ``sliding_window`` changes no parameter.
* qwen2: q/k/v biases always (``Qwen2Attention``), none on o_proj or the MLP.
* gpt2: Conv1D projections with biases, LayerNorm with bias, learned positions
  (``n_positions``), ``n_inner`` or 4 * ``n_embd``, head tied unless ``tie_word_embeddings`` false.
* phi: one LayerNorm per layer, attention and MLP in parallel, biases on q/k/v/dense/fc1/fc2
  and on lm_head, ``partial_rotary_factor`` of each head rotated, final LayerNorm.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

from pydantic import ValidationError

from memcalc.core.errors import UserError
from memcalc.core.spec import ModelSpec

SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mistral", "phi", "qwen2")

# Hugging Face ACT2FN names -> ModelSpec.activation.
_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu_new",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "relu": "relu",
}

_REQUIRED = object()


class _Reader:
    """Typed access to config keys; a missing or mistyped key is a one-line UserError."""

    def __init__(self, cfg: dict[str, Any], where: str, model_type: str) -> None:
        self.cfg = cfg
        self.where = where
        self.model_type = model_type

    def _raw(self, key: str, default: Any) -> Any:
        value = self.cfg.get(key, default)
        if value is None:  # JSON null means "use the default" in transformers configs
            value = default
        if value is _REQUIRED:
            raise UserError(f"Hugging Face config {self.where} (model_type {self.model_type}) lacks {key!r}")
        return value

    def int(self, key: str, default: Any = _REQUIRED) -> Optional[int]:
        value = self._raw(key, default)
        if value is None:
            return None
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or value != int(value) or value <= 0):  # JSON admits NaN and Infinity
            raise UserError(f"{key} in {self.where} must be a positive integer, got {value!r}")
        return int(value)

    def float(self, key: str, default: Any = _REQUIRED, lo: float = 0.0, hi: float = math.inf) -> float:
        value = self._raw(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (lo <= value <= hi):
            raise UserError(f"{key} in {self.where} must be a number in [{lo:g}, {hi:g}], got {value!r}")
        return float(value)

    def bool(self, key: str, default: Any = _REQUIRED) -> bool:
        value = self._raw(key, default)
        if not isinstance(value, bool):
            raise UserError(f"{key} in {self.where} must be true or false, got {value!r}")
        return value

    def activation(self, key: str, default: str) -> str:
        value = self._raw(key, default)
        if not isinstance(value, str) or value not in _ACTIVATIONS:
            raise UserError(
                f"unsupported {key} {value!r} in {self.where}; valid: {', '.join(sorted(_ACTIVATIONS))}"
            )
        return _ACTIVATIONS[value]


def _llama_like(r: _Reader, *, max_pos: int, eps: float, qwen2: bool = False) -> dict[str, Any]:
    """Keys shared by LlamaConfig, MistralConfig and Qwen2Config."""
    heads = r.int("num_attention_heads")
    fields: dict[str, Any] = dict(
        n_layers=r.int("num_hidden_layers"),
        d_model=r.int("hidden_size"),
        n_heads=heads,
        n_kv_heads=r.int("num_key_value_heads", heads),
        head_dim=r.int("head_dim", None),
        d_ff=r.int("intermediate_size"),
        vocab_size=r.int("vocab_size"),
        max_seq_len=r.int("max_position_embeddings", max_pos),
        mlp="gated",
        activation=r.activation("hidden_act", "silu"),
        norm="rmsnorm",
        norm_eps=r.float("rms_norm_eps", eps),
        positions="rope",
        tie_embeddings=r.bool("tie_word_embeddings", False),
        attn_dropout=r.float("attention_dropout", 0.0, hi=0.999),
        final_norm=True,
    )
    if qwen2:
        fields.update(qkv_bias=True, o_bias=False, mlp_bias=False)
    else:
        attn_bias = r.bool("attention_bias", False)
        fields.update(qkv_bias=attn_bias, o_bias=attn_bias, mlp_bias=r.bool("mlp_bias", False))
    return fields


def _llama(r: _Reader) -> dict[str, Any]:
    # LlamaConfig defaults: max_position_embeddings 2048, rms_norm_eps 1e-6.
    return _llama_like(r, max_pos=2048, eps=1e-6)


def _mistral(r: _Reader) -> dict[str, Any]:
    # MistralConfig defaults: max_position_embeddings 4096 * 32, rms_norm_eps 1e-6.
    fields = _llama_like(r, max_pos=4096 * 32, eps=1e-6)
    fields.update(qkv_bias=False, o_bias=False, mlp_bias=False)  # MistralAttention/MLP: bias=False
    return fields


def _qwen2(r: _Reader) -> dict[str, Any]:
    # Qwen2Config defaults: max_position_embeddings 32768, rms_norm_eps 1e-6.
    return _llama_like(r, max_pos=32768, eps=1e-6, qwen2=True)


def _gpt2(r: _Reader) -> dict[str, Any]:
    if r.bool("add_cross_attention", False):
        raise UserError(f"{r.where}: GPT-2 with add_cross_attention is an encoder-decoder; not supported")
    d = r.int("n_embd", 768)
    n_pos = r.int("n_positions", 1024)
    return dict(
        n_layers=r.int("n_layer", 12),
        d_model=d,
        n_heads=r.int("n_head", 12),
        d_ff=r.int("n_inner", 4 * d),
        vocab_size=r.int("vocab_size", 50257),
        max_seq_len=n_pos,
        mlp="plain",
        activation=r.activation("activation_function", "gelu_new"),
        norm="layernorm",
        norm_eps=r.float("layer_norm_epsilon", 1e-5),
        positions="learned",
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        tie_embeddings=r.bool("tie_word_embeddings", True),
        final_norm=True,
        attn_dropout=r.float("attn_pdrop", 0.1, hi=0.999),
        resid_dropout=r.float("resid_pdrop", 0.1, hi=0.999),
        embd_dropout=r.float("embd_pdrop", 0.1, hi=0.999),
    )


def _phi(r: _Reader) -> dict[str, Any]:
    if r.bool("qk_layernorm", False):
        raise UserError(f"{r.where}: phi with qk_layernorm true has per-head q/k LayerNorms; not supported")
    heads = r.int("num_attention_heads", 32)
    return dict(
        n_layers=r.int("num_hidden_layers", 24),
        d_model=r.int("hidden_size", 2048),
        n_heads=heads,
        n_kv_heads=r.int("num_key_value_heads", heads),
        d_ff=r.int("intermediate_size", 8192),
        vocab_size=r.int("vocab_size", 51200),
        max_seq_len=r.int("max_position_embeddings", 2048),
        mlp="plain",
        activation=r.activation("hidden_act", "gelu_new"),
        norm="layernorm",
        norm_eps=r.float("layer_norm_eps", 1e-5),
        block="parallel",
        positions="rope",
        rotary_pct=r.float("partial_rotary_factor", 0.5, lo=1e-9, hi=1.0),
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        tie_embeddings=r.bool("tie_word_embeddings", False),
        lm_head_bias=True,
        final_norm=True,
        attn_dropout=r.float("attention_dropout", 0.0, hi=0.999),
        resid_dropout=r.float("resid_pdrop", 0.0, hi=0.999),
        embd_dropout=r.float("embd_pdrop", 0.0, hi=0.999),
    )


_READERS: dict[str, Callable[[_Reader], dict[str, Any]]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "gpt2": _gpt2,
    "phi": _phi,
}
assert tuple(sorted(_READERS)) == SUPPORTED_MODEL_TYPES


def from_hf_config(cfg: dict[str, Any], name: str, where: Optional[str] = None) -> ModelSpec:
    """The ModelSpec of a parsed Hugging Face ``config.json`` (``where`` names it in errors).

    Raises :class:`UserError` for an unknown ``model_type`` (listing the supported
    ones), a missing or mistyped key, or shapes ModelSpec rejects.
    """
    where = where or "config.json"
    if not isinstance(cfg, dict):
        raise UserError(f"{where} must be a JSON object, not {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    if model_type not in _READERS:
        raise UserError(
            f"unsupported model_type {model_type!r} in {where}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    fields = _READERS[model_type](_Reader(cfg, where, model_type))
    fields["name"] = name
    if fields.get("head_dim") is not None and fields["head_dim"] * fields["n_heads"] == fields["d_model"]:
        fields["head_dim"] = None  # the default, d_model / n_heads
    try:
        return ModelSpec(**fields)
    except ValidationError as e:
        from memcalc.inputs.pydantic_errors import pydantic_error_line

        raise UserError(pydantic_error_line(e, where)) from None
