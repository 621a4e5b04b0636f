"""``validate --output FILE`` (validate/output.py, torch-free): written through a symlink, with
the umask's mode, atomically, and with every concurrent writer's records kept (issue 16)."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import stat
from pathlib import Path

import pytest

from memcalc.validate.output import RecordFile


def rec(config: str, k: int) -> dict:
    return {"config": config, "device": "meta", "measured_bytes": k}


def test_a_symlink_is_written_through(tmp_path: Path):
    target = tmp_path / "real.json"
    target.write_text("[]\n")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    RecordFile(str(link)).write([rec("a", 1)])
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert [r["config"] for r in json.loads(target.read_text())] == ["a"]


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])  # source: open(2), 0666 & ~umask
def test_a_new_file_follows_the_umask(tmp_path: Path, umask: int, mode: int):
    old = os.umask(umask)
    try:
        RecordFile(str(tmp_path / "out.json")).write([rec("a", 1)])
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out.json").stat().st_mode) == mode
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary or lock file left


def test_an_existing_file_keeps_its_mode(tmp_path: Path):
    out = tmp_path / "out.json"
    out.write_text("[]")
    out.chmod(0o640)
    RecordFile(str(out)).write([rec("a", 1)])
    assert stat.S_IMODE(out.stat().st_mode) == 0o640


def test_records_of_ended_runs_are_replaced_live_ones_kept(tmp_path: Path):
    out = tmp_path / "out.json"
    host = socket.gethostname()
    ended = {**rec("old", 0), "run_id": f"{host}:999999999:dead"}  # no such pid
    legacy = rec("legacy", 0)  # written before run ids
    live = {**rec("live", 0), "run_id": f"{host}:{os.getpid()}:other"}  # this process: alive
    out.write_text(json.dumps([ended, legacy, live]))
    f = RecordFile(str(out))
    f.write([rec("mine", 1)])
    f.write([rec("mine", 1), rec("mine2", 2)])
    assert [r["config"] for r in json.loads(out.read_text())] == ["live", "mine", "mine2"]


def _writer(path: str, name: str, n: int, started=None) -> None:
    f = RecordFile(path)
    if started is not None:  # every run has started (read the file) before any writes
        started.wait(30)
    mine = []
    for k in range(n):
        mine.append(rec(name, k))
        f.write(mine)


def test_concurrent_writers_keep_every_record(tmp_path: Path):
    out = str(tmp_path / "out.json")
    ctx = multiprocessing.get_context("fork")
    # runs that are all going at once (a run that starts after another has ended replaces that
    # one's records, by design: on a loaded machine a writer could otherwise start that late)
    started = ctx.Barrier(3)
    procs = [ctx.Process(target=_writer, args=(out, f"w{i}", 20, started)) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    got = json.loads(Path(out).read_text())
    assert sorted((r["config"], r["measured_bytes"]) for r in got) == sorted(
        (f"w{i}", k) for i in range(3) for k in range(20))
    assert len({r["run_id"] for r in got}) == 3


def test_a_write_that_fails_after_the_work_keeps_the_records(tmp_path: Path, monkeypatch, capsys):
    """The disk fills up mid-run (issue 32: the measured record was lost): the records go to a fallback
    file in the temporary folder, said on stderr, and later writes follow them there."""
    import errno

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    out = tmp_path / "r.json"
    f = RecordFile(str(out))
    f.write([rec("a", 1)])
    real_replace = os.replace

    def full_disk(src, dst):
        if str(dst) == str(out):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", full_disk)
    f.write([rec("a", 1), rec("b", 2)])
    f.write([rec("a", 1), rec("b", 2), rec("c", 3)])
    fallback = next((tmp_path / "tmp").glob("memcalc-validate-*.json"))
    assert [r["config"] for r in json.loads(fallback.read_text())] == ["a", "b", "c"]
    assert [r["config"] for r in json.loads(out.read_text())] == ["a"]
    assert f"No space left on device; the records go to {fallback}" in capsys.readouterr().err


def test_the_file_is_read_bounded(tmp_path: Path, monkeypatch):
    """validate/output.py _read goes through memcalc.core.files.read_bounded (issue 32: it read the whole
    file, unbounded, and a FIFO put in its place blocked forever): a FIFO or a file over MAX_RECORDS_BYTES
    holds no records and is replaced by this run's."""
    import memcalc.core.files as files

    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    assert RecordFile(str(fifo)).ended == set()  # returns at once (a blocking open waited for a writer)
    big = tmp_path / "big.json"
    big.write_text(json.dumps([rec("old", 1)] * 50))
    monkeypatch.setattr(files, "MAX_RECORDS_BYTES", 1000)  # source: files.MAX_RECORDS_BYTES, scaled down
    f = RecordFile(str(big))
    f.write([rec("a", 1)])
    assert [r["config"] for r in json.loads(big.read_text())] == ["a"]


def test_a_file_that_is_not_regular_is_never_replaced(tmp_path: Path, capsys):
    """RecordFile's atomic os.replace onto a FIFO (or, as root, /dev/full) swapped the node for a regular file
    (issue 32 fuzz: memcalc.measure(output="/dev/full") did): the records go to the fallback file instead."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    f = RecordFile(str(fifo))
    f.write([rec("a", 1)])
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert "not a regular file; the records go to" in capsys.readouterr().err
    assert [r["config"] for r in json.loads(Path(f.path).read_text())] == ["a"]
    os.unlink(f.path)
