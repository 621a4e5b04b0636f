"""``validate --output FILE``: the JSON list of records, rewritten after every record.

What the file holds, and how it is written:

- **Every writer's records.** Several ``memcalc validate`` runs may write one file at the same
  time (one per GPU, one per config). Each run has a ``run_id`` (``host:pid:random``) stored in
  its records. Every write takes an exclusive ``flock`` on the file's folder (no lock file is
  left behind), reads the file, keeps the records of *other* runs, puts this run's records
  after them and replaces the file; so no writer loses another's records, in any interleaving.
- **Earlier runs are replaced, not appended to.** Records already in the file when this run
  starts are dropped by its first write when the run that wrote them has ended (its process
  on this host is gone; records without a ``run_id``, or not a JSON list at all, count as
  ended); records of a run still going are kept. A run that starts while another writes the
  file keeps the other's records whichever finishes first.
- **Atomic.** The new content goes to a temporary file in the same folder, then ``os.replace``:
  a reader (or a run killed mid-write) sees the old list or the new one, never half of one.
- **Through a symlink.** ``FILE`` a symlink: the link's target is written (the link stays).
- **Regular files only.** ``FILE`` a FIFO or a device (``/dev/full``: root's replace would swap the node
  for a file) is not replaced: the records go to the fallback file below, as when a write fails.
- **Mode.** A new file gets ``0o666 & ~umask`` (what ``open(FILE, "w")`` gives); an existing
  file keeps its mode.

Torch-free (imported by the command, tested in the quick lane). ``flock`` needs a POSIX system;
elsewhere writes are not serialised.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import sys
import tempfile
import uuid
from contextlib import contextmanager
from typing import Iterator, Optional

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


def new_run_id() -> str:
    """``host:pid:random``: unique per run; the pid says whether the run is still going."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _alive(run_id: object) -> bool:
    """Whether the run that wrote a record may still be writing (its process exists on this host)."""
    if not isinstance(run_id, str) or run_id.count(":") < 2:
        return False
    host, pid, _ = run_id.rsplit(":", 2)
    if host != socket.gethostname():
        return True  # another machine (a shared folder): cannot tell, keep it
    try:
        os.kill(int(pid), 0)
    except PermissionError:  # another user's process
        return True
    except (ProcessLookupError, ValueError, OverflowError):
        return False
    return True


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _read(path: str) -> list:
    """The records in ``path``, read as every user file is (``memcalc.core.files.read_bounded``: a FIFO or
    a device refused unread, at most MAX_RECORDS_BYTES); a file that is not a JSON list, or cannot be read,
    holds none (``--output``'s check refused such a file before the run, unless ``--force``)."""
    from memcalc.core.errors import UserError
    from memcalc.core.files import MAX_RECORDS_BYTES, read_bounded

    try:
        data = json.loads(read_bounded(path, "--output", MAX_RECORDS_BYTES).decode("utf-8"))
    except (UserError, ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        return []
    return data if isinstance(data, list) else []


@contextmanager
def _locked(folder: str) -> Iterator[None]:
    if fcntl is None:
        yield
        return
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # a folder one may write but not read: no lock
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


class RecordFile:
    """The ``--output`` file of one run (see the module docstring)."""

    def __init__(self, path: str, run_id: Optional[str] = None) -> None:
        self.path = os.path.realpath(os.path.expanduser(path))  # a symlink: write its target
        self.folder = os.path.dirname(self.path)
        self.run_id = run_id or new_run_id()
        with _locked(self.folder):
            #: run ids in the file at the start whose runs have ended: their records are replaced
            self.ended = {r.get("run_id") if isinstance(r, dict) else None for r in _read(self.path)}
            self.ended = {i for i in self.ended if not _alive(i)}

    def write(self, records: list[dict]) -> None:
        """Replace this run's records in the file with ``records`` (each gets this ``run_id``). When the
        file cannot be written (a full disk, a folder made read-only mid-run), the records go to a
        fallback file in the temporary folder, said on stderr, and every later write goes there too:
        nothing already measured is lost."""
        try:
            self._write(records)
        except OSError as e:
            fallback = os.path.join(tempfile.gettempdir(), f"memcalc-validate-{self.run_id.replace(':', '-')}.json")
            if self.path == fallback:
                raise
            sys.stderr.write(f"memcalc: cannot write --output {self.path}: {e.strerror or e}; the records go to "
                             f"{fallback}\n")
            self.path, self.folder, self.ended = fallback, os.path.dirname(fallback), set()
            self._write(records)

    def _write(self, records: list[dict]) -> None:
        mine = [{**r, "run_id": self.run_id} for r in records]
        with _locked(self.folder):
            others = [r for r in _read(self.path)
                      if not (isinstance(r, dict) and r.get("run_id") == self.run_id)
                      and (r.get("run_id") if isinstance(r, dict) else None) not in self.ended]
            try:
                st = os.stat(self.path)
            except FileNotFoundError:
                mode = 0o666 & ~_umask()
            else:  # the replace below would swap a FIFO or a device node (as root: /dev/full) for a file
                if not stat.S_ISREG(st.st_mode):
                    raise OSError(errno.EINVAL, "not a regular file")
                mode = st.st_mode & 0o7777
            fd, tmp = tempfile.mkstemp(prefix=".validate-", suffix=".json", dir=self.folder)
            try:
                os.fchmod(fd, mode)  # mkstemp makes 0600
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(others + mine, f, indent=2)
                    f.write("\n")
                os.replace(tmp, self.path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
