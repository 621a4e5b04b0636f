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

import os
import stat
from pathlib import Path
from typing import Union

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


__all__ = ["file_kind", "read_bounded"]
