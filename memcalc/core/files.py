"""Reading a file the user names, bounded: one path for every reader (recipes, configs, model files,
``--deepspeed``, the Hugging Face cache, snapshots, measured records, OOM message files).

The file is opened with ``O_NONBLOCK`` and checked with ``fstat`` on the open descriptor before a
byte is read: a FIFO (whose blocking open waits for a writer forever), a character or block device
(``/dev/zero`` streams without end), a socket or a directory is refused, and what is read is the file
that was checked (no window between a ``stat`` and an ``open``). A regular file is read to at most one
byte past its bound, whatever its reported size (``/proc`` files report 0). Every failure is one
:class:`~memcalc.core.errors.UserError` line naming the file.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path
from typing import Optional, Union

from memcalc.core.errors import UserError
from memcalc.core.units import GiB, KiB, MiB

#: what the error lines show of a path at most
SHOWN_CHARS = 200


def file_kind(mode: int) -> str:
    """What a non-regular file is, for an error line ("a FIFO (named pipe)", "a directory", ...)."""
    for test, name in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a regular file"


def _shown(path: Union[str, Path]) -> str:
    text = str(path)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 4] + "..."


def read_bounded(path: Union[str, Path], what: str, limit_bytes: int, too_large: str = "") -> bytes:
    """The bytes of the regular file ``path``, at most ``limit_bytes`` of them; else one UserError line:
    ``{what} PATH not found``, ``... is a FIFO (named pipe), not a regular file``, ``cannot read
    {what} PATH: <the OS's reason>``, or ``{what} PATH is larger than N bytes`` followed by
    ``too_large`` (what a real one holds, how to make it smaller)."""
    shown = _shown(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise UserError(f"{what} {shown} not found") from None
    except OSError as e:
        raise UserError(f"cannot read {what} {shown}: {e.strerror or e}") from None
    except ValueError:  # an embedded NUL byte
        raise UserError(f"cannot read {what} {shown!r}: a path holds no NUL byte") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UserError(f"{what} {shown} is {file_kind(mode)}, not a regular file; give a file path")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit_bytes + 1)
    except OSError as e:  # EIO, EISDIR on an odd filesystem
        raise UserError(f"cannot read {what} {shown}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > limit_bytes:
        raise UserError(f"{what} {shown} is larger than {_size(limit_bytes)}" + (f"; {too_large}" if too_large else ""))
    return data


def _size(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n:,} bytes"


#: folders whose entries are kernel interfaces, not files (a write there fails after the work, or worse: an
#: atomic replace by root swaps /dev/full for a regular file); /dev/shm is a tmpfs of regular files
_KERNEL_FOLDERS = ("/proc", "/sys", "/dev")
_FILE_FOLDERS = ("/dev/shm",)
#: the largest existing ``--output`` file read to see whether it is a JSON list of records (measured.py's bound)
MAX_RECORDS_BYTES = 256 * MiB
#: what each output (``--html``, ``--output`` / ``output=``, ``--snapshot``) writes, and accepts to replace
_OURS = {"html": "a memcalc HTML report", "output": "a JSON list of validate records",
         "snapshot": "a memory snapshot (pickle)"}


def check_output_path(path: Optional[str], flag: str, force: bool = False) -> None:
    """An output file that cannot or should not be written is a one-line error before any work starts:
    an empty path, a NUL byte, a symlink loop or a name the OS refuses, a directory, a missing or
    unwritable folder, an unwritable file, something that is not a regular file (a FIFO would block, a
    device fail after the work), a path under /proc, /sys or /dev, or an existing file memcalc did not
    write (unless ``force``). ``flag`` names the output as the caller gave it (``--html``, ``output=``)."""
    if path is None:
        return
    if not path.strip():
        raise UserError(f"cannot write {flag} {path!r}: an empty path; give a file path")
    if "\x00" in path:
        raise UserError(f"cannot write {flag} {_shown(path)!r}: a path holds no NUL byte")
    try:
        p = Path(os.path.realpath(Path(path).expanduser()))  # a symlink is written through: check its target
        with contextlib.suppress(FileNotFoundError):
            os.stat(p)  # a symlink loop (ELOOP), a name too long: the OS's reason, below
        if p.is_dir():
            raise UserError(f"cannot write {flag} {path}: it is a directory; give a file path")
        if _under(p, _KERNEL_FOLDERS) and not _under(p, _FILE_FOLDERS):
            raise UserError(f"cannot write {flag} {path}: {p} is a kernel interface, not a file; give a file path")
        if p.exists() and not stat.S_ISREG(p.stat().st_mode):
            raise UserError(f"cannot write {flag} {path}: it is {file_kind(p.stat().st_mode)}, not a regular "
                            "file; give a file path")
        if not p.parent.is_dir():
            raise UserError(f"cannot write {flag} {path}: folder {p.parent} does not exist")
        if not os.access(p.parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
            raise UserError(f"cannot write {flag} {path}: permission denied")
        kind = flag.strip("-=")
        if not force and p.exists() and p.stat().st_size and not _written_by_memcalc(p, kind):
            raise UserError(f"{flag} {path} exists and is not {_OURS[kind]}; give another path, or "
                            f"{'--force' if flag.startswith('--') else 'remove it'} to replace it")
    except OSError as e:  # a name the OS refuses (too long)
        raise UserError(f"cannot write {flag} {_shown(path)}: {e.strerror or e}") from None


def _under(p: Path, folders: tuple[str, ...]) -> bool:
    return any(str(p) == d or str(p).startswith(d + "/") for d in folders)


def _written_by_memcalc(p: Path, kind: str) -> bool:
    """Whether the existing regular file ``p`` is what ``kind`` writes: an HTML report with memcalc's footer,
    a JSON list (validate's records), a pickle (a snapshot)."""
    import json

    with open(p, "rb") as f:
        head = f.read(16)
        if kind == "snapshot":
            return head[:1] == b"\x80"  # pickle protocol 2+
        if kind == "html":
            f.seek(max(0, p.stat().st_size - 4096))
            return head.startswith(b"<!DOCTYPE html>") and b"Generated by memcalc" in f.read()
        f.seek(0)
        if p.stat().st_size > MAX_RECORDS_BYTES:
            return False
        try:
            return isinstance(json.loads(f.read().decode("utf-8")), list)
        except ValueError:
            return False


__all__ = ["MAX_RECORDS_BYTES", "check_output_path", "file_kind", "read_bounded"]
