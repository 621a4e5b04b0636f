"""Model presets and model resolution: a preset name, a Hugging Face config.json, or a spec file.

Presets are ``data/models/<name>.yaml`` (read through :mod:`memcalc.inputs.data_files`, so
they work from any install); each holds :class:`~memcalc.core.spec.ModelSpec` fields and
a comment citing the published ``config.json`` it was written from. Their exact
parameter totals are pinned in ``tests/test_params.py``.

"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Optional

from pydantic import ValidationError

from memcalc.inputs.data_files import check_name, list_names, load_named, parse_text, path_kind, shorten
from memcalc.core.errors import UserError
from memcalc.engine.params import count_params
from memcalc.core.spec import ModelSpec
from memcalc.inputs.pydantic_errors import pydantic_error_line

_FOLDER = "models"
_SPEC_SUFFIXES = (".yaml", ".yml", ".json")



# --------------------------------------------------------------------------- presets


def list_presets() -> list[str]:
    """Names of the shipped model presets (``data/models/*.yaml``), sorted."""
    return list_names(_FOLDER)


def _unknown_preset(name: str) -> UserError:
    valid = list_presets()
    close = difflib.get_close_matches(name.lower(), valid, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return UserError(
        f"unknown model preset {shorten(name)}{hint}; valid: {', '.join(valid)} "
        "(or a path to a Hugging Face config.json or a model spec .yaml/.json)"
    )


def load_preset(name: str) -> ModelSpec:
    """The preset called ``name`` (exact, or differing only in case).

    Raises :class:`UserError` listing the valid names, with a close-match suggestion.
    """
    valid = list_presets()
    key = name if name in valid else name.strip().lower()
    if key not in valid:
        raise _unknown_preset(name)
    raw = load_named(_FOLDER, key)
    if isinstance(raw, dict):
        raw = {k: v for k, v in raw.items() if k not in _META_KEYS}
        if "hf_config" in raw:
            return _preset_from_hf_config(raw, key)
    return model_from_dict(raw, f"{_FOLDER}/{key}.yaml", default_name=key)


#: preset keys that describe the preset, not the model (stripped before the spec is built)
_META_KEYS = ("hf_id",)
_HF_FOLDER = "hf_configs"


def _preset_from_hf_config(raw: dict[str, Any], key: str) -> ModelSpec:
    """A preset that names a shipped Hugging Face config (``hf_config: ORG--NAME.json`` in
    ``data/hf_configs``): the spec is that config read by :mod:`memcalc.inputs.hf_config`, so the
    preset and the published file cannot drift apart."""
    from memcalc.inputs.hf_config import from_hf_config

    where = f"{_FOLDER}/{key}.yaml"
    extra = sorted(set(raw) - {"hf_config", "name"})
    if extra:
        raise UserError(f"{where}: a preset with hf_config takes only hf_config, name and {', '.join(_META_KEYS)}; "
                        f"got {', '.join(extra)}")
    stem = str(raw["hf_config"]).removesuffix(".json")
    try:
        cfg = load_named(_HF_FOLDER, stem)
    except FileNotFoundError:
        raise UserError(f"{where}: hf_config {raw['hf_config']!r} is not in data/{_HF_FOLDER}") from None
    return from_hf_config(cfg, str(raw.get("name", key)), where=f"{_HF_FOLDER}/{stem}.json", strict=True)


def preset_summary(name: str) -> dict[str, Any]:
    """One row of the ``memcalc models`` table: name, exact parameter count and shapes."""
    m = load_preset(name)
    return {
        "name": name,
        "params": count_params(m).total,
        "n_layers": m.n_layers,
        "d_model": m.d_model,
        "n_heads": m.n_heads,
        "n_kv_heads": m.kv_heads,
        "d_ff": m.d_ff,
        "vocab_size": m.vocab_size,
        "max_seq_len": m.max_seq_len,
    }


# --------------------------------------------------------------------------- resolution


def model_from_dict(raw: Any, where: str, default_name: Optional[str] = None) -> ModelSpec:
    """Build a ModelSpec from parsed ModelSpec fields; every problem is a one-line UserError.

    ``default_name`` is used when the mapping has no ``name``.
    """
    if not isinstance(raw, dict):
        raise UserError(f"{where} must be a mapping of model fields, not {type(raw).__name__}")
    raw = dict(raw)
    if default_name is not None and "name" not in raw:
        raw["name"] = default_name
    try:
        return ModelSpec(**raw)
    except ValidationError as e:
        raise UserError(pydantic_error_line(e, where)) from None
    except TypeError as e:  # a non-string key, e.g. `1: 2` in YAML
        raise UserError(f"invalid model spec {where}: {e}") from None


def _looks_like_path(value: str) -> bool:
    return "/" in value or "\\" in value or value.lower().endswith(_SPEC_SUFFIXES)


def _hf_name(raw: dict[str, Any], path: Path) -> str:
    """A report name for a Hugging Face config: its ``_name_or_path``, else its folder or file stem."""
    given = raw.get("_name_or_path")
    if isinstance(given, str) and given.strip():
        return given.strip().rstrip("/").rsplit("/", 1)[-1]
    if path.stem == "config" and path.resolve().parent.name:
        return path.resolve().parent.name
    return path.stem


def resolve_model(value: str) -> ModelSpec:
    """A model from ``--model VALUE``.

    In order: a preset name (``memcalc models``); a path to a Hugging Face
    ``config.json`` (any JSON/YAML mapping with ``model_type``, read offline by
    :func:`memcalc.inputs.hf_config.from_hf_config`); a path to a YAML/JSON file of
    ModelSpec fields (``name`` defaults to the file stem).
    """
    if not isinstance(value, str) or not value.strip():
        raise UserError(f"empty --model value {value!r}; give a preset name or a file path (see `memcalc models`)")
    value = value.strip()
    check_name(value, "--model")
    presets = list_presets()
    if value in presets or (value.lower() in presets and path_kind(Path(value)) != "file"):
        return load_preset(value)
    path = Path(value).expanduser()
    kind = path_kind(path)
    if kind == "file":
        if not path.name.lower().endswith(_SPEC_SUFFIXES):
            raise UserError(f"model file {value} must be .json, .yaml or .yml")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read model file {value}: {e}") from None
        where = str(value)
        raw = parse_text(text, where)
        if not isinstance(raw, dict):
            raise UserError(f"{where} must be a mapping (model fields or a Hugging Face config.json), "
                            f"not {type(raw).__name__}")
        if "model_type" in raw:
            from memcalc.inputs.hf_config import from_hf_config

            return from_hf_config(raw, _hf_name(raw, path), where=where)
        return model_from_dict(raw, where, default_name=path.stem)
    if kind == "dir":
        cfg = path / "config.json"
        if cfg.is_file():
            return resolve_model(str(cfg))
        raise UserError(f"model directory {value} has no config.json")
    if _looks_like_path(value):
        raise UserError(f"model file not found: {value if len(value) <= 200 else shorten(value, 200)}")
    raise _unknown_preset(value)
