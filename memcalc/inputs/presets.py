"""Model presets and model resolution: a preset name, a Hugging Face config.json, or a spec file.

Presets are ``data/models/<name>.yaml`` (read through :mod:`memcalc.inputs.data_files`, so
they work from any install); each holds :class:`~memcalc.core.spec.ModelSpec` fields and
a comment citing the published ``config.json`` it was written from. Their exact
parameter totals are pinned in ``tests/test_params.py``.

:func:`pydantic_error_line` turns a pydantic ``ValidationError`` into the one-line
message every user-facing loader raises (model files, training options, configs).
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ValidationError

from memcalc.core import spec as _spec
from memcalc.inputs.data_files import list_names, load_named, parse_text
from memcalc.core.errors import UserError
from memcalc.engine.params import count_params
from memcalc.core.spec import ModelSpec

_FOLDER = "models"
_SPEC_SUFFIXES = (".yaml", ".yml", ".json")

# Words used for the model class a ValidationError came from ("invalid model spec foo.yaml: ...").
_KIND = {
    "ModelSpec": "model spec",
    "TrainingSpec": "training spec",
    "LoraSpec": "LoRA spec",
    "KernelProfile": "kernel profile",
    "ExperimentSpec": "experiment",
    "GPU": "GPU entry",
}


# --------------------------------------------------------------------------- presets


def list_presets() -> list[str]:
    """Names of the shipped model presets (``data/models/*.yaml``), sorted."""
    return list_names(_FOLDER)


def _unknown_preset(name: str) -> UserError:
    valid = list_presets()
    close = difflib.get_close_matches(name.lower(), valid, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return UserError(
        f"unknown model preset {name!r}{hint}; valid: {', '.join(valid)} "
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
    return model_from_dict(raw, f"{_FOLDER}/{key}.yaml", default_name=key)


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
    presets = list_presets()
    if value in presets or (value.lower() in presets and not Path(value).is_file()):
        return load_preset(value)
    path = Path(value).expanduser()
    if path.is_file():
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
    if path.is_dir():
        cfg = path / "config.json"
        if cfg.is_file():
            return resolve_model(str(cfg))
        raise UserError(f"model directory {value} has no config.json")
    if _looks_like_path(value):
        raise UserError(f"model file not found: {value}")
    raise _unknown_preset(value)


# --------------------------------------------------------------------------- validation errors


def _unwrap(tp: Any) -> Optional[type[BaseModel]]:
    """The pydantic model class inside an annotation (``Optional[X]``, ``X | None``), if any."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    for arg in typing.get_args(tp):
        found = _unwrap(arg)
        if found is not None:
            return found
    return None


def _model_at(root: Optional[type[BaseModel]], loc: tuple[Any, ...]) -> Optional[type[BaseModel]]:
    """Walk ``loc`` (field names) from ``root`` down through nested models."""
    cls = root
    for part in loc:
        if cls is None or not isinstance(part, str) or part not in cls.model_fields:
            return None
        cls = _unwrap(cls.model_fields[part].annotation)
    return cls


def _root_class(exc: ValidationError) -> Optional[type[BaseModel]]:
    cls = getattr(_spec, exc.title, None)
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        return cls
    if exc.title == "GPU":
        from memcalc.inputs.gpus import GPU

        return GPU
    return None


def _short_repr(value: Any, limit: int = 60) -> str:
    r = repr(value)
    r = " ".join(r.split())
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _is_file_like(where: str) -> bool:
    return "/" in where or "\\" in where or where.lower().endswith(_SPEC_SUFFIXES)


def pydantic_error_line(exc: ValidationError, where: str) -> str:
    """One line for a pydantic ``ValidationError`` from loading ``where`` (a file, or e.g. "training options").

    * unknown key: ``unknown key 'n_layer' in foo.yaml; valid: <fields>; did you mean 'n_layers'?``
    * missing key: ``invalid model spec foo.yaml: missing required key 'd_ff'``
    * bad value: ``invalid model spec foo.yaml: n_layers = 0: Input should be greater than 0``
    * cross-field rule: ``invalid model spec foo.yaml: n_heads (12) must be divisible by n_kv_heads (5) ...``

    The kind ("model spec", "experiment", ...) is shown when ``where`` is a file or data
    name; further errors are counted as "(and N more)".
    """
    # Unknown keys first: a misspelt key also makes its intended field "missing".
    errors = sorted(exc.errors(include_url=False), key=lambda e: e.get("type") != "extra_forbidden")
    if not errors:  # pragma: no cover - pydantic always reports at least one
        return f"invalid {where}"
    root = _root_class(exc)
    err = errors[0]
    loc = tuple(err.get("loc", ()))
    dotted = ".".join(str(p) for p in loc)
    etype = err.get("type", "")
    if etype == "extra_forbidden":
        cls = _model_at(root, loc[:-1])
        line = f"unknown key {dotted!r} in {where}"
        rest = errors[1:]
        if cls is not None:
            valid = list(cls.model_fields)
            line += f"; valid: {', '.join(valid)}"
            close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.6)
            if close:
                line += f"; did you mean {close[0]!r}?"
                meant = loc[:-1] + (close[0],)
                rest = [e for e in rest if not (e.get("type") == "missing" and tuple(e.get("loc", ())) == meant)]
        if rest:
            line += f" (and {len(rest)} more)"
        return " ".join(line.split())
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    kind = _KIND.get(exc.title, exc.title)
    head = f"invalid {kind} {where}" if _is_file_like(where) else f"invalid {where}"
    msg = str(err.get("msg", ""))
    if etype == "value_error" and msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    elif etype == "assertion_error" and msg.startswith("Assertion failed, "):
        msg = msg[len("Assertion failed, "):]
    if etype == "missing":
        body = f"missing required key {dotted!r}"
    elif not loc:
        body = msg
    elif etype in ("value_error", "assertion_error") and isinstance(err.get("input"), dict):
        body = f"{dotted}: {msg}"  # a model-level rule of a nested spec
    else:
        body = f"{dotted} = {_short_repr(err.get('input'))}: {msg}"
    return " ".join(f"{head}: {body}{more}".split())
