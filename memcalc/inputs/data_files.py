"""Access to the shipped data files (``data/`` in the repository, ``memcalc.data`` when installed).

Works from an editable or a non-editable install: files are read through
``importlib.resources``, never through a path relative to the source tree.
"""

from __future__ import annotations

import json
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import yaml

from memcalc.core.errors import UserError


def data_root() -> Traversable:
    """The root of the shipped data files."""
    return resources.files("memcalc.data")


def list_names(folder: str) -> list[str]:
    """Names (file stems) of the YAML/JSON files in a data sub-folder, sorted."""
    root = data_root() / folder
    names = []
    for entry in root.iterdir():
        n = entry.name
        if n.endswith((".yaml", ".yml", ".json")) and not n.startswith("_"):
            names.append(n.rsplit(".", 1)[0])
    return sorted(names)


def load_named(folder: str, name: str) -> Any:
    """Parse ``data/<folder>/<name>.yaml`` (or .json)."""
    root = data_root() / folder
    for ext in (".yaml", ".yml", ".json"):
        entry = root / f"{name}{ext}"
        if entry.is_file():
            return parse_text(entry.read_text(encoding="utf-8"), f"{folder}/{name}{ext}")
    raise FileNotFoundError(f"{folder}/{name}")


def load_file(name: str) -> Any:
    """Parse a top-level data file such as ``gpus.yaml``."""
    entry = data_root() / name
    return parse_text(entry.read_text(encoding="utf-8"), name)


#: libyaml's loader when PyYAML was built with it (several times faster), else the pure one
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


#: the longest --model / --config value taken as a name or path (Linux PATH_MAX)
MAX_NAME_CHARS = 4096


def check_name(value: str, flag: str) -> None:
    """A UserError for a name or path too long to be one (before any file-system call)."""
    if len(value) > MAX_NAME_CHARS:
        raise UserError(f"{flag} value is {len(value):,} characters long; a name or path has at most {MAX_NAME_CHARS:,}")


def shorten(value: str, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters for an error line."""
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 4] + "...'"


def clip(text: str, limit: int = 40) -> str:
    """``text`` as typed, cut to ``limit`` characters for an error line."""
    return text if len(text) <= limit else text[: limit - 4] + "..."


def path_kind(path: Path) -> str:
    """'file', 'dir' or 'none'; a path the OS refuses to look up (a component over 255 bytes) is 'none'."""
    try:
        return "file" if path.is_file() else "dir" if path.is_dir() else "none"
    except (OSError, ValueError):  # ENAMETOOLONG; ValueError: an embedded NUL byte
        return "none"


def parse_text(text: str, where: str) -> Any:
    """Parse YAML or JSON text; a syntax error becomes one-line UserError naming the file."""
    try:
        if where.endswith(".json"):
            return json.loads(text)
        return yaml.load(text, Loader=_LOADER)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise UserError(f"malformed {where}{at}: {first}") from None
