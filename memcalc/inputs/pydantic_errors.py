"""One line for a pydantic ``ValidationError``: the message every user-facing loader raises
(model files, training options, configs, the GPU catalog)."""

from __future__ import annotations

import typing
from typing import Any, Optional

from pydantic import BaseModel, ValidationError

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
    """The memcalc model class the error was raised for (found by its title among the
    subclasses of ``BaseModel``, so that this module needs to import none of them)."""
    stack = list(BaseModel.__subclasses__())
    while stack:
        cls = stack.pop()
        if cls.__name__ == exc.title and cls.__module__.startswith("memcalc."):
            return cls
        stack.extend(cls.__subclasses__())
    return None


def _short_repr(value: Any, limit: int = 60) -> str:
    if isinstance(value, int) and value.bit_length() > 4 * limit:  # (repr past 4,300 digits raises ValueError)
        return f"an integer of about {int(value.bit_length() * 0.30103):,} digits"
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
            import difflib  # (here: only a misspelt name needs it, not an estimate's start-up)

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
