"""The Python API's keyword types, checked as the CLI's parser checks its flags.

The CLI never sees a wrong type: typer parses every flag from text. A Python caller can pass
anything, so :func:`check_types` holds each keyword to the type its ``Options`` field (or the API
function's signature) declares and raises :class:`~memcalc.core.errors.UserError` naming the keyword
for any other: a boolean is ``True``/``False`` only (``lora="false"`` is not false), an integer is not a
boolean or a float, a version is a string (``torch=2.10`` would be the float 2.1), a list of names is
a list or tuple of strings.
"""

from __future__ import annotations

import functools
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Union

from memcalc.core.errors import UserError
from memcalc.inputs.data_files import clip


def _args(hint: Any) -> tuple[Any, ...]:
    """The alternatives of ``Optional[X]`` / ``Union[X, Y]`` / ``X | Y`` (just ``(hint,)`` otherwise)."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of type ``hint`` (the few kinds the API's keywords use)."""
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    origin = typing.get_origin(hint)
    if origin in (list, tuple, Sequence) or hint in (list, tuple):
        inner = [a for a in typing.get_args(hint) if a is not Ellipsis] or [Any]
        return isinstance(value, (list, tuple)) and all(_matches(v, inner[0]) for v in value)
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        return isinstance(value, Mapping)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _kind(hint: Any) -> str:
    """How a type reads in an error: ``an integer``, ``True or False``, ``a string or None``."""
    names = {bool: "True or False", int: "an integer", float: "a number", str: "a string", type(None): "None"}
    parts = []
    for a in _args(hint):
        if a in names:
            parts.append(names[a])
        elif typing.get_origin(a) in (list, tuple, Sequence):
            parts.append("a list of strings")
        elif typing.get_origin(a) in (dict, Mapping) or a in (dict, Mapping):
            parts.append("a dict")
        else:
            parts.append(getattr(a, "__name__", str(a)))
    return " or ".join(dict.fromkeys(parts))


def check_types(values: Mapping[str, Any], hints: Mapping[str, Any]) -> None:
    """Raise :class:`UserError` for the first keyword in ``values`` whose value is not of its type in
    ``hints`` (keywords without a hint are not checked; ranges are the resolver's, as for the CLI)."""
    for name, value in values.items():
        hint = hints.get(name)
        if hint is None:
            continue
        if not any(_matches(value, a) for a in _args(hint)):
            shown = clip(repr(value), 60)
            raise UserError(f"{name}= must be {_kind(hint)}, not {type(value).__name__} {shown}")


@functools.cache
def _option_hints() -> dict[str, Any]:
    """The type of each :class:`~memcalc.inputs.resolve.Options` keyword, with the spellings a Python caller
    may use besides (evaluated once: ``typing.get_type_hints`` evaluates every string annotation anew, ~1 ms,
    and "to make it fit" resolves a dozen setups)."""
    from memcalc.inputs.resolve import Options

    hints = typing.get_type_hints(Options)
    hints.update(params=Union[str, int, float, None], recipe=Union[str, list[str], tuple[str, ...], None],
                 lora_targets=Union[str, list[str], tuple[str, ...], None], seq=Union[int, str, None])
    return hints


def check_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The API's Options keywords, each of the type its :class:`~memcalc.inputs.resolve.Options` field
    declares, with the spellings a Python caller uses made the CLI's: ``params`` may be a number (as
    ``--params`` reads ``7e9``), ``recipe`` one path, ``lora_targets`` a list of names; and the aliases
    of :mod:`memcalc.core.aliases` (``seq="4k"``, ``optimizer="paged_adamw_8bit"``) made memcalc's names."""
    check_types(kwargs, _option_hints())  # model= a dict or PretrainedConfig was made a path by the API's _resolve
    from memcalc.core.aliases import canonical

    out = canonical(kwargs)  # the users' spellings (paged_adamw_8bit, bfloat16, 4k, transformers), with a note each
    if isinstance(out.get("recipe"), str):
        out["recipe"] = [out["recipe"]]
    if isinstance(out.get("lora_targets"), (list, tuple)):  # ["q", "v"] as --lora-targets q,v
        out["lora_targets"] = ",".join(out["lora_targets"])
    return out


def check_args(func: Any, **values: Any) -> None:
    """``func``'s own keywords (those that are not Options) of the types its signature declares."""
    namespace = vars(sys.modules[func.__module__])
    hints = {k: eval(func.__annotations__[k], namespace) if isinstance(func.__annotations__[k], str)
             else func.__annotations__[k] for k in values}
    check_types(values, hints)


def option_choices() -> dict[str, tuple[str, ...]]:
    """The choices the CLI's options check (Literal types), checked here with the same tuples."""
    from memcalc.core.choices import FRAMEWORKS, LORA_DTYPES, LOSSES, PRECISIONS
    from memcalc.core.optimizers import IMPLS, OPTIMIZER_NAMES

    return {"precision": PRECISIONS, "optimizer": OPTIMIZER_NAMES, "optimizer_impl": IMPLS, "loss": LOSSES,
            "framework": FRAMEWORKS, "lora_dtype": LORA_DTYPES}


def flag_name(name: str) -> str:
    """``lora_rank`` -> ``--lora-rank``."""
    return "--" + name.replace("_", "-")


def check_choice(name: str, value: Any, valid: Sequence[str]) -> Any:
    """``value`` (an enum member's value, or as given) when it is one of ``valid`` or None; UserError otherwise."""
    value = getattr(value, "value", value)  # an enum member (a caller's own)
    if value is not None and value not in valid:
        raise UserError(f"unknown {flag_name(name)} {value!r}; valid: {', '.join(valid)}")
    return value
