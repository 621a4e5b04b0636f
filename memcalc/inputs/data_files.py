"""Access to the shipped data files (``data/`` in the repository, ``memcalc.data`` when installed).

Works from an editable or a non-editable install: files are read where the import system found
the ``memcalc.data`` package (:func:`data_root`), never through a path relative to the source tree.
The shipped YAML files (the GPU catalog, the presets, the reference configs) are parsed when read.
"""

from __future__ import annotations

import json
import re
from importlib import import_module
from importlib.machinery import SourceFileLoader, SourcelessFileLoader
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memcalc.core.errors import UserError
from memcalc.core.files import read_bounded

if TYPE_CHECKING:
    from importlib.abc import Traversable  # importlib.resources.abc from Python 3.11


def data_root() -> Traversable:
    """The root of the shipped data files: ``importlib.resources.files("memcalc.data")``. For a
    package loaded from a folder (a file loader, as in an editable or a wheel install) that is the
    folder of its ``__init__``, which is returned without importing ``importlib.resources`` and its
    readers (zipfile among them: about 4 ms of an estimate's start-up; CPython's
    ``FileLoader.get_resource_reader`` gives a ``FileReader``, whose ``files()`` is that folder);
    anything else (a zip import) goes through ``importlib.resources``.
    ``tests/unit/test_estimate_imports.py`` compares the two."""
    spec = import_module("memcalc.data").__spec__
    if spec is not None and isinstance(spec.loader, (SourceFileLoader, SourcelessFileLoader)) and spec.origin:
        return Path(spec.origin).parent
    from importlib import resources

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


def _yaml():
    """PyYAML, imported when a YAML file is parsed."""
    import yaml

    return yaml


#: the longest --model / --config value taken as a name or path (Linux PATH_MAX)
MAX_NAME_CHARS = 4096


def check_name(value: str, flag: str) -> None:
    """A UserError for a name or path too long to be one (before any file-system call)."""
    if len(value) > MAX_NAME_CHARS:
        raise UserError(f"{flag} value is {len(value):,} characters long; "
                        f"a name or path has at most {MAX_NAME_CHARS:,}")


def shorten(value: str, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters for an error line."""
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 4] + "...'"


def clip(text: str, limit: int = 40) -> str:
    """``text`` as typed, cut to ``limit`` characters for an error line."""
    return text if len(text) <= limit else text[: limit - 4] + "..."


def path_kind(path: Path) -> str:
    """'file', 'dir', 'other' (a FIFO, a device, a socket: :func:`read_user_file` refuses it with its
    kind named) or 'none'; a path the OS refuses to look up (a component over 255 bytes) is 'none'."""
    try:
        return "file" if path.is_file() else "dir" if path.is_dir() else "other" if path.exists() else "none"
    except (OSError, ValueError):  # ENAMETOOLONG; ValueError: an embedded NUL byte
        return "none"


#: Limits on a config, model spec or config.json file (a real one is a few KiB, a few levels
#: deep, with a few hundred values): the file's size, the values it holds once YAML aliases are
#: expanded (a "billion laughs" file holds 10**9 from a few lines), and its nesting depth.
MAX_FILE_BYTES = 2**20
MAX_VALUES = 100_000
MAX_DEPTH = 64


def read_user_file(path: Path, what: str) -> str:
    """The text of a file the user named, refused (one line) over MAX_FILE_BYTES, not a regular file
    (a FIFO or a device: refused before a byte is read, :func:`memcalc.core.files.read_bounded`) or not
    UTF-8."""
    data = read_bounded(path, what, MAX_FILE_BYTES, "a config or model spec is a few KiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"cannot read {what} {clip(str(path), 200)}: not UTF-8 text (byte {e.start})") from None


def check_size(value: Any, where: str) -> None:
    """A UserError when parsed data, with every alias expanded, holds more than MAX_VALUES values
    or nests deeper than MAX_DEPTH. Walks the object graph (aliases are shared objects, so each is
    counted at every place it is used) and stops at the first limit: never slow."""
    stack = [(value, 1)]
    count = 0
    while stack:
        v, depth = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise UserError(f"{where} holds more than {MAX_VALUES:,} values once its YAML aliases are expanded; "
                            "a config or model spec holds a few hundred")
        if depth > MAX_DEPTH:
            raise UserError(f"{where} nests deeper than {MAX_DEPTH} levels")
        if isinstance(v, dict):
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)


def _flow_depth(text: str) -> int:
    """The deepest nesting of ``[``/``{`` in the text (brackets inside strings count too: an
    over-estimate, which only matters past MAX_DEPTH)."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return 0  # the common case, without the scan
    depth = top = 0
    for c in re.sub(r"[^\[\]{}]+", "", text):
        depth = depth + 1 if c in "[{" else max(0, depth - 1)
        top = max(top, depth)
    return top


def parse_text(text: str, where: str) -> Any:
    """Parse YAML or JSON text; a syntax error becomes one-line UserError naming the file, and so
    does text over the limits (see ``check_size``)."""
    if len(text) > MAX_FILE_BYTES:
        raise UserError(f"{where} is larger than {MAX_FILE_BYTES // 2**20} MiB; a config or model spec is a few KiB")
    if not where.endswith(".json") and _flow_depth(text) > MAX_DEPTH:  # libyaml recurses in C: checked first
        raise UserError(f"{where} nests deeper than {MAX_DEPTH} levels")
    yaml = None if where.endswith(".json") else _yaml()
    syntax_errors = (json.JSONDecodeError,) if yaml is None else (json.JSONDecodeError, yaml.YAMLError)
    try:
        if yaml is None:
            data = json.loads(text)
        else:  # libyaml's loader when PyYAML was built with it (several times faster), else the pure one
            data = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except RecursionError:
        raise UserError(f"{where} nests deeper than {MAX_DEPTH} levels") from None
    except syntax_errors as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise UserError(f"malformed {where}{at}: {first}") from None
    except ValueError as e:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise UserError(f"malformed {where}: {clip(str(e), 120)}") from None
    check_size(data, where)
    return data
