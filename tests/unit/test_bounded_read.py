"""One bounded read for every file the user names (memcalc.core.files.read_bounded, issue 32): a FIFO,
a device or a directory is refused before a byte is read (a FIFO's blocking open waited for a writer
forever; /dev/zero streamed), a file past its bound is refused after reading one byte past it, and each
door names itself in the one line."""

from __future__ import annotations

import os
import re

import pytest
from conftest import cli_run, one_line_error

from memcalc.core.errors import UserError
from memcalc.core.files import read_bounded

#: a bound small enough that the over-bound row writes a few bytes
LIMIT_BYTES = 8


def _paths(tmp_path):
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    return {"fifo": str(fifo), "dir": str(tmp_path), "zero": "/dev/zero", "missing": str(tmp_path / "none.json")}


# (which path, message): source: memcalc/core/files.py read_bounded (fstat of the O_NONBLOCK descriptor)
READS = [
    ("fifo", "is a FIFO (named pipe), not a regular file"),
    ("dir", "is a directory, not a regular file"),
    ("zero", "/dev/zero is a character device, not a regular file"),
    ("missing", "none.json not found"),
]


@pytest.mark.parametrize("which,message", READS)
def test_read_bounded_refuses(tmp_path, which, message):
    with pytest.raises(UserError, match=re.escape(message)):
        read_bounded(_paths(tmp_path)[which], "file", LIMIT_BYTES)


def test_read_bounded_bound(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"x" * LIMIT_BYTES)
    assert read_bounded(p, "file", LIMIT_BYTES) == b"x" * LIMIT_BYTES
    p.write_bytes(b"x" * (LIMIT_BYTES + 1))
    with pytest.raises(UserError, match=f"file {p} is larger than {LIMIT_BYTES:,} bytes; keep it short"):
        read_bounded(p, "file", LIMIT_BYTES, "keep it short")
    with pytest.raises(UserError, match="a path holds no NUL byte"):
        read_bounded("a\0b", "file", LIMIT_BYTES)


# (args with {fifo}/{zero}, message): every door a user's file comes through, each naming itself
DOORS = [
    # source: memcalc/inputs/deepspeed_config.py load_json
    (["estimate", "--model", "gpt2", "--deepspeed", "{fifo}"], "--deepspeed {fifo} is a FIFO (named pipe)"),
    (["estimate", "--model", "gpt2", "--deepspeed", "{zero}"], "--deepspeed /dev/zero is a character device"),
    # source: memcalc/inputs/recipes/__init__.py _read (the adapter config named as itself, not --recipe)
    (["estimate", "--recipe", "{fifo}"], "--recipe {fifo} is a FIFO (named pipe)"),
    (["estimate", "--model", "gpt2", "--adapter-config", "{fifo}"], "--adapter-config {fifo} is a FIFO"),
    # source: memcalc/inputs/configs.py _raw; memcalc/inputs/presets.py resolve_model
    (["estimate", "--config", "{fifo}"], "config file {fifo} is a FIFO (named pipe)"),
    (["estimate", "--model", "{fifo}"], "model file {fifo} is a FIFO (named pipe)"),
    # source: memcalc/snapshot/reader.py read_snapshot
    (["compare", "{fifo}", "--model", "gpt2"], "snapshot {fifo} is a FIFO (named pipe)"),
    (["compare", "{zero}", "--model", "gpt2"], "snapshot /dev/zero is a character device"),
]


@pytest.mark.slow  # 8 command lines, about 50 ms each
def test_every_door_refuses_a_fifo_unread(tmp_path):
    paths = _paths(tmp_path)
    for args, message in DOORS:
        r = cli_run([a.format(**paths) for a in args])
        one_line_error(r, 2, message.format(**paths))
