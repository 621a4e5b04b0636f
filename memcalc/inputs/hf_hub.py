"""Hugging Face model ids (``ORG/NAME``): their ``config.json`` from the local hub cache, or fetched.

Only ``config.json`` is read; no weights, no ``huggingface_hub`` import (memcalc's
dependencies stay numpy/pydantic/rich/typer/pyyaml). The cache layout, the environment
variables and the error codes follow huggingface_hub 1.x:

- ``constants.py``: the cache is ``$HF_HUB_CACHE``, else ``$HUGGINGFACE_HUB_CACHE``, else
  ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else
  ``~/.cache/huggingface/hub``; the endpoint ``$HF_ENDPOINT`` (default
  ``https://huggingface.co``); offline mode ``$HF_HUB_OFFLINE`` or ``$TRANSFORMERS_OFFLINE``
  set to 1/ON/YES/TRUE; the token file ``$HF_TOKEN_PATH``, else ``$HF_HOME/token``.
- ``utils/_auth.py`` ``get_token``: ``$HF_TOKEN``, else ``$HUGGING_FACE_HUB_TOKEN``, else
  the token file that ``hf auth login`` writes.
- ``file_download.py`` ``try_to_load_from_cache``: a repo's folder is
  ``models--ORG--NAME``; ``refs/main`` holds the commit of ``main``; the file is
  ``snapshots/<commit>/config.json`` (a link into ``blobs/``).
- ``utils/_http.py`` ``hf_raise_for_status``: the Hub's ``X-Error-Code`` header says
  ``GatedRepo``, ``RepoNotFound`` or ``EntryNotFound``.

Fetching is on by default, as in ``transformers``/``huggingface_hub``
(``from_pretrained("ORG/NAME")`` downloads unless ``HF_HUB_OFFLINE=1``): a user who types a
Hub id expects the Hub, and clusters without network already set ``HF_HUB_OFFLINE=1`` for
those libraries, which stops memcalc too. It is one small request with a short timeout,
and the file is written into the cache, so the next run with that id is offline.
``$HF_HUB_ENDPOINT`` is read as an alias of ``$HF_ENDPOINT``.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import socket
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from memcalc.core.errors import UserError
from memcalc.core.files import read_bounded

#: seconds to wait for the Hub before giving up (connect and each read)
FETCH_TIMEOUT_S = 10.0
#: the largest config.json accepted from the Hub (published ones are a few KiB)
MAX_CONFIG_BYTES = 4 * 2**20
#: the most read of ``refs/main`` (a 40-character commit hash) or the token file (a ~40-character token)
MAX_REF_BYTES = 4096
DEFAULT_ENDPOINT = "https://huggingface.co"
_TRUE = {"1", "ON", "YES", "TRUE"}

# huggingface_hub utils/_validators.py validate_repo_id: REPO_ID_REGEX, no "--" or "..", at most 96 characters
_REPO_ID = re.compile(r"^(\b[\w\-.]+\b)/(\b[\w\-.]+\b)$")
_MAX_REPO_ID = 96

#: the opener used for the Hub request; tests replace it (no network in tests)
urlopen: Callable[..., Any] = urllib.request.urlopen


def is_repo_id(value: str) -> bool:
    """``value`` has the form of a Hugging Face model id ``ORG/NAME`` (huggingface_hub's rules).

    The caller first checks that it is no existing file and has no spec-file suffix.
    """
    return (len(value) <= _MAX_REPO_ID and value.count("/") == 1 and "--" not in value and ".." not in value
            and _REPO_ID.match(value) is not None)


def _env_path(name: str) -> Optional[Path]:
    v = os.environ.get(name)
    return Path(os.path.expandvars(v)).expanduser() if v else None


def hf_home() -> Path:
    """``$HF_HOME``, else ``$XDG_CACHE_HOME/huggingface``, else ``~/.cache/huggingface``."""
    xdg = _env_path("XDG_CACHE_HOME") or Path("~/.cache").expanduser()
    return _env_path("HF_HOME") or xdg / "huggingface"


def hub_cache() -> Path:
    """The hub cache folder (``$HF_HUB_CACHE``, ``$HUGGINGFACE_HUB_CACHE``, ``$HF_HOME/hub``, ...)."""
    return _env_path("HF_HUB_CACHE") or _env_path("HUGGINGFACE_HUB_CACHE") or hf_home() / "hub"


def offline() -> bool:
    """``$HF_HUB_OFFLINE`` (or ``$TRANSFORMERS_OFFLINE``) is 1/ON/YES/TRUE: never contact the Hub."""
    v = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return v is not None and v.strip().upper() in _TRUE


def endpoint() -> str:
    """``$HF_ENDPOINT`` (or ``$HF_HUB_ENDPOINT``), default ``https://huggingface.co``, without a trailing /."""
    return (os.environ.get("HF_ENDPOINT") or os.environ.get("HF_HUB_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def token() -> Optional[str]:
    """``$HF_TOKEN``, ``$HUGGING_FACE_HUB_TOKEN``, else the file ``hf auth login`` wrote; None if none."""
    t = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if not t:
        path = _env_path("HF_TOKEN_PATH") or hf_home() / "token"
        try:
            t = read_bounded(path, "token file", MAX_REF_BYTES).decode("utf-8")
        except (UserError, UnicodeDecodeError):
            return None
    t = t.replace("\r", "").replace("\n", "").strip()
    return t or None


def repo_folder(repo_id: str) -> str:
    """``models--ORG--NAME`` (huggingface_hub ``repo_folder_name``)."""
    return "--".join(["models", *repo_id.split("/")])


def repo_id_of(config: Path) -> Optional[str]:
    """``ORG/NAME`` of a cached ``models--ORG--NAME/snapshots/<rev>/config.json``, else None."""
    parts = config.parent.parent.parent.name.split("--")
    return f"{parts[1]}/{parts[2]}" if len(parts) == 3 and parts[0] == "models" else None


# --------------------------------------------------------------------------- the cache


def _repo_dir(cache: Path, repo_id: str) -> Optional[Path]:
    """The repo's cache folder: exact name, else the one equal ignoring case (ids are case-insensitive on the Hub)."""
    exact = cache / repo_folder(repo_id)
    try:
        if exact.is_dir():
            return exact
        want = repo_folder(repo_id).lower()
        for entry in cache.iterdir():
            if entry.name.lower() == want and entry.is_dir():
                return entry
    except OSError:
        pass
    return None


def cached_config(repo_id: str) -> Optional[Path]:
    """``config.json`` of ``repo_id`` in the hub cache, or None.

    The revision is the one ``refs/main`` names when it has a config.json; else the snapshot
    with the newest config.json (by modification time).
    """
    repo = _repo_dir(hub_cache(), repo_id)
    if repo is None:
        return None
    snapshots = repo / "snapshots"
    try:  # a commit hash: 40 characters; a FIFO or device here is refused unread, as any file is
        main = read_bounded(repo / "refs" / "main", "refs/main", MAX_REF_BYTES).decode("utf-8").strip()
    except (UserError, UnicodeDecodeError):
        main = ""
    if main and "/" not in main and main not in (".", ".."):
        cfg = snapshots / main / "config.json"
        if cfg.is_file():
            return cfg
    found: list[tuple[float, str, Path]] = []
    try:
        for snap in snapshots.iterdir():
            cfg = snap / "config.json"
            if cfg.is_file():
                found.append((cfg.stat().st_mtime, snap.name, cfg))
    except OSError:
        return None
    return max(found)[2] if found else None


def _git_blob_sha1(data: bytes) -> str:
    """The git object id of ``data`` (what the Hub sends as the ETag of a file not in LFS)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".memcalc-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def store_config(repo_id: str, commit: str, etag: Optional[str], data: bytes) -> Path:
    """Write a fetched config.json into the cache the way huggingface_hub does: the bytes in
    ``blobs/<etag>``, ``snapshots/<commit>/config.json`` linking to it (a copy where links are
    not allowed), ``refs/main`` = ``commit``. Raises OSError when the cache is not writable."""
    repo = hub_cache() / repo_folder(repo_id)
    blob_id = etag if etag and re.fullmatch(r"[0-9a-fA-F]{40,64}", etag) else _git_blob_sha1(data)
    blob = repo / "blobs" / blob_id
    snap = repo / "snapshots" / commit
    for d in (blob.parent, snap, repo / "refs"):
        d.mkdir(parents=True, exist_ok=True)
    if not blob.is_file():
        _write_atomic(blob, data)
    target = snap / "config.json"
    if not target.exists():
        try:
            target.symlink_to(os.path.relpath(blob, snap))
        except OSError:
            _write_atomic(target, data)
    _write_atomic(repo / "refs" / "main", commit.encode())
    return target


# --------------------------------------------------------------------------- the Hub


@dataclass(frozen=True)
class Fetched:
    """A config.json fetched from the Hub: its bytes, where it was stored in the cache, or why not."""

    data: bytes
    url: str
    stored: Optional[Path]
    not_stored: Optional[str] = None


def _how_to_pass(repo_id: str) -> str:
    return f"download {endpoint()}/{repo_id}/resolve/main/config.json and pass --model path/to/config.json"


def not_found_line(repo_id: str, why: str) -> str:
    """The one line for an id that no preset has, the cache lacks and the Hub did not give."""
    return (f"--model {repo_id}: no preset has this Hugging Face id (see `memcalc models`), it is not in the "
            f"Hugging Face cache ({hub_cache()}), {why}; {_how_to_pass(repo_id)}")


def _http_error(repo_id: str, e: urllib.error.HTTPError, had_token: bool) -> UserError:
    code = (e.headers.get("X-Error-Code") if e.headers is not None else None) or ""
    if code == "GatedRepo" or (not code and e.code in (401, 403)):
        login = ("your token has no access to it: accept its license on the model page" if had_token
                 else "accept its license on the model page, then log in (`hf auth login`) or set HF_TOKEN")
        return UserError(f"--model {repo_id} is gated or private on the Hugging Face Hub (HTTP {e.code}): "
                         f"{login}, or {_how_to_pass(repo_id)}")
    if code == "RepoNotFound" or (not code and e.code == 404):
        private = "" if had_token else " (or it is private: log in with `hf auth login` or set HF_TOKEN)"
        return UserError(not_found_line(repo_id, f"and the Hub has no model {repo_id} (HTTP {e.code}){private}"))
    if code == "EntryNotFound":
        return UserError(f"--model {repo_id}: the Hugging Face repo has no config.json (HTTP {e.code}); "
                         "pass a config.json of the model with --model path/to/config.json")
    return UserError(not_found_line(repo_id, f"and the Hub answered HTTP {e.code} {e.reason or ''}".rstrip()))


def fetch_config(repo_id: str) -> Fetched:
    """GET ``{endpoint}/{repo_id}/resolve/main/config.json`` (with the token, if any), then store it in the cache.

    Every failure is a one-line UserError: offline mode, no network or a timeout, 401/403
    (gated or private), 404 (no such model), another status, a body that is too large.
    """
    if offline():
        raise UserError(not_found_line(repo_id, "and HF_HUB_OFFLINE is set, so the Hub was not asked"))
    url = f"{endpoint()}/{repo_id}/resolve/main/config.json"
    tok = token()
    headers = {"User-Agent": "memcalc (config.json only)"}
    if tok:
        headers["Authorization"] = f"Bearer {tok}"
    try:
        with urlopen(urllib.request.Request(url, headers=headers), timeout=FETCH_TIMEOUT_S) as resp:
            data = resp.read(MAX_CONFIG_BYTES + 1)
            commit = resp.headers.get("X-Repo-Commit") or ""
            etag = (resp.headers.get("X-Linked-Etag") or resp.headers.get("ETag") or "").removeprefix("W/").strip('"')
    except urllib.error.HTTPError as e:
        raise _http_error(repo_id, e, bool(tok)) from None
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        if isinstance(reason, (socket.timeout, TimeoutError)):
            reason = f"no answer within {FETCH_TIMEOUT_S:g} s"
        raise UserError(not_found_line(repo_id, f"and the Hub could not be reached at {endpoint()} ({reason})")) from None
    if len(data) > MAX_CONFIG_BYTES:
        raise UserError(f"--model {repo_id}: the Hub's config.json is over {MAX_CONFIG_BYTES >> 20} MiB; "
                        f"not a model config; {_how_to_pass(repo_id)}")
    if not re.fullmatch(r"[0-9a-f]{40}", commit):  # the cache's folders are named by commit
        return Fetched(data, url, None, "the answer had no X-Repo-Commit header")
    try:
        return Fetched(data, url, store_config(repo_id, commit, etag, data))
    except OSError as e:  # a read-only cache: use the bytes, fetch again next time
        return Fetched(data, url, None, f"the cache {hub_cache()} is not writable: {e.strerror or e}")
