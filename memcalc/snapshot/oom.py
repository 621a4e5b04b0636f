"""``memcalc explain``: a CUDA out-of-memory message read, and the estimate of the same step set against it.

The message is PyTorch's (c10/cuda/CUDACachingAllocator.cpp, ``DeviceCachingAllocator::malloc``, torch
2.1 and later)::

    CUDA out of memory. Tried to allocate {alloc_size}. GPU {device} has a total capacity of
    {device_total} of which {device_free} is free. {proc_info}{allowed_info}Of the allocated memory
    {allocated_bytes + allocated_in_private_pools} is allocated by PyTorch, {private_pool_msg}and
    {reserved_bytes - allocated_bytes - allocated_in_private_pools} is reserved by PyTorch but
    unallocated. If reserved but unallocated memory is large try setting
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation. ...

where ``proc_info`` is ``reportProcessMemoryInfo`` ("Including non-PyTorch memory, this process has
{X} memory in use. ", or "Process {pid} has {X} memory in use. " per process), ``allowed_info`` is
"{X} allowed; " under ``torch.cuda.set_per_process_memory_fraction``, and ``private_pool_msg`` "with
{X} allocated in private pools (e.g., CUDA Graphs), ". Torch 2.0 and earlier wrote "Tried to allocate
{X} (GPU {d}; {T} total capacity; {A} already allocated; {F} free; {R} reserved in total by PyTorch)".
Every size is ``format_size``: "{n} bytes" up to 1024, else two decimals of KiB, MiB or GiB (2**10,
2**20, 2**30), so a parsed size is exact to half a unit of its last decimal.

"allocated by PyTorch" is the allocator's ``allocated_bytes`` (whole blocks, what
``torch.cuda.memory_allocated`` reports); "reserved but unallocated" is cached in segments but in no
live block: the request failed although that much was held, when no free piece of it was large enough
(fragmentation), which expandable segments remove (the message's own advice).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, Optional

from memcalc.core.errors import UserError
from memcalc.inputs.data_files import clip
from memcalc.inputs.gpus import MAX_CAPACITY_BYTES

_UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
_SIZE = r"(\d+(?:\.\d+)?) ?(bytes|KiB|MiB|GiB)"
#: torch >= 2.1 (module docstring)
_NEW = re.compile(
    rf"Tried to allocate {_SIZE}\. GPU (\d+) has a total capacity of {_SIZE} of which {_SIZE} is free\. (.*?)"
    rf"Of the allocated memory {_SIZE} is allocated by PyTorch, (?:with {_SIZE} allocated in private pools "
    rf"\(e\.g\., CUDA Graphs\), )?and {_SIZE} is reserved by PyTorch but unallocated")
#: torch <= 2.0
_OLD = re.compile(
    rf"Tried to allocate {_SIZE} \(GPU (\d+); {_SIZE} total capacity; {_SIZE} already allocated; {_SIZE} free; "
    rf"(?:{_SIZE} allowed; )?{_SIZE} reserved in total by PyTorch\)")
_THIS_PROCESS = re.compile(rf"Including non-PyTorch memory, this process has {_SIZE} memory in use")
_PROCESS = re.compile(rf"Process (\d+) has {_SIZE} memory in use")
_ALLOWED = re.compile(rf"{_SIZE} allowed;")
#: the longest message text read (an OOM message is under 1 KiB; a log around it may be longer)
MAX_MESSAGE_CHARS = 2**20
#: where PyTorch documents expandable segments (the message's own link, its section)
EXPANDABLE_SEGMENTS_DOC = "https://pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf"


#: the largest size read from a message: what ``--gpu SIZE`` takes at most (far above any device); a
#: message's "Tried to allocate 1e26 GiB" is no CUDA allocator's (its sizes are a device's ``size_t``
#: bytes) and is refused, never computed on
MAX_SIZE_BYTES = MAX_CAPACITY_BYTES
#: the largest GPU number read: c10's ``DeviceIndex`` is ``int8_t`` (c10/core/Device.h, torch 2.13), so a
#: larger "GPU N" is no CUDA device's
MAX_DEVICE = 127


def size_bytes(number: str, unit: str) -> int:
    """``format_size``'s text back in bytes (exact to half a unit of the last decimal); a size above
    MAX_SIZE_BYTES is a UserError (no GPU's allocator printed it)."""
    n = Decimal(number) * _UNITS[unit]
    if n > MAX_SIZE_BYTES:
        raise UserError(f"cannot read the message: a size of {clip(number, 24)} {unit} is more than "
                        f"{MAX_SIZE_BYTES // 2**40:,} TiB, which no GPU holds; give the message as PyTorch printed it")
    return int(n)


def _device(text: str) -> int:
    if len(text) > 3 or int(text) > MAX_DEVICE:
        raise UserError(f"cannot read the message: GPU {clip(text, 24)} is no CUDA device number (at most "
                        f"{MAX_DEVICE}); give the message as PyTorch printed it")
    return int(text)


def _consistent(m: OomMessage, total_unit: str) -> OomMessage:
    """``m`` when its parts fit in its device total (each within the half unit the total is rounded to);
    else a UserError naming the first part that does not: no CUDA allocator printed that message."""
    slack = _UNITS[total_unit] // 200  # format_size's two decimals: half a unit of the last one
    for name, value in (("free", m.free_bytes), ("allocated by PyTorch", m.allocated_bytes),
                        ("reserved but unallocated", m.reserved_unallocated_bytes), ("allowed", m.allowed_bytes),
                        ("in use by this process", m.process_bytes)):
        if value is not None and value > m.total_bytes + slack:
            raise UserError(f"cannot read the message: {value:,} bytes {name} is more than the GPU's total capacity "
                            f"({m.total_text}); give the message as PyTorch printed it")
    return m


@dataclass(frozen=True)
class OomMessage:
    """The numbers of one CUDA out-of-memory message (module docstring), in bytes."""

    requested_bytes: int
    device: int
    total_bytes: int
    free_bytes: int
    allocated_bytes: int  # "allocated by PyTorch" (private pools included)
    reserved_unallocated_bytes: int  # "reserved by PyTorch but unallocated"
    allowed_bytes: Optional[int] = None  # set_per_process_memory_fraction's cap
    process_bytes: Optional[int] = None  # "this process has X memory in use" (PyTorch's and the rest)
    other_processes_bytes: Optional[int] = None  # the "Process N has X" lines, summed
    total_text: str = ""  # the capacity as the message prints it, e.g. "79.15 GiB"

    @property
    def capacity_bytes(self) -> int:
        """What the allocator may use: the allowed fraction when one is set, else the device total."""
        return self.allowed_bytes if self.allowed_bytes is not None else self.total_bytes

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("requested_bytes", "device", "total_bytes", "free_bytes",
                                               "allocated_bytes", "reserved_unallocated_bytes", "allowed_bytes",
                                               "process_bytes", "other_processes_bytes")}


def _last(flat: str, pattern: re.Pattern[str], end: str) -> Optional[re.Match[str]]:
    """The last message of ``pattern`` in ``flat``: the text from the last "Tried to allocate" before
    the last ``end`` marker (a window of one message, so a long log of partial messages is read in
    linear time, never by a lazy match scanning the rest of the log from each of them)."""
    stop = flat.rfind(end)
    if stop < 0:
        return None
    start = flat.rfind("Tried to allocate", 0, stop)
    return pattern.search(flat, start, stop + len(end)) if start >= 0 else None


def parse_oom(text: str) -> OomMessage:
    """The last CUDA out-of-memory message in ``text`` (either format of the module docstring; line
    breaks and repeated spaces of a wrapped log are read as one space); a UserError when none is there."""
    flat = " ".join(text[:MAX_MESSAGE_CHARS].split())
    m = _last(flat, _NEW, "is reserved by PyTorch but unallocated")
    if m:
        g = m.groups()
        info = g[7]
        this = _THIS_PROCESS.search(info)
        others = [size_bytes(n, u) for _, n, u in _PROCESS.findall(info)]
        allowed = _ALLOWED.search(info)
        return _consistent(OomMessage(
            requested_bytes=size_bytes(g[0], g[1]), device=_device(g[2]), total_bytes=size_bytes(g[3], g[4]),
            free_bytes=size_bytes(g[5], g[6]), allocated_bytes=size_bytes(g[8], g[9]),
            reserved_unallocated_bytes=size_bytes(g[12], g[13]),
            allowed_bytes=size_bytes(allowed.group(1), allowed.group(2)) if allowed else None,
            process_bytes=size_bytes(this.group(1), this.group(2)) if this else None,
            other_processes_bytes=sum(others) if others else None, total_text=f"{g[3]} {g[4]}"), g[4])
    m = _last(flat, _OLD, "reserved in total by PyTorch)")
    if m:
        g = m.groups()
        allocated = size_bytes(g[5], g[6])
        return _consistent(OomMessage(
            requested_bytes=size_bytes(g[0], g[1]), device=_device(g[2]), total_bytes=size_bytes(g[3], g[4]),
            free_bytes=size_bytes(g[7], g[8]), allocated_bytes=allocated,
            reserved_unallocated_bytes=max(size_bytes(g[11], g[12]) - allocated, 0),
            allowed_bytes=size_bytes(g[9], g[10]) if g[9] else None, total_text=f"{g[3]} {g[4]}"), g[4])
    hint = "it names no CUDA out-of-memory error" if "out of memory" not in flat else \
        "its numbers are not in PyTorch's layout"
    raise UserError(f"cannot read the message: {hint} (expected 'CUDA out of memory. Tried to allocate 2.00 GiB. "
                    "GPU 0 has a total capacity of 79.15 GiB of which ... is free. ... Of the allocated memory ... "
                    "is allocated by PyTorch, and ... is reserved by PyTorch but unallocated.')")


def message_text(arg: str) -> str:
    """``arg`` itself when it holds the error's text, else the text of the file it names (read as every
    user file is: :func:`memcalc.inputs.data_files.read_user_file`, 1 MiB at most)."""
    if "out of memory" in arg or "Tried to allocate" in arg:
        return arg
    from memcalc.inputs.data_files import path_kind, read_user_file

    if path_kind(Path(arg)) != "file":  # a name the OS refuses (too long, a NUL byte) is no file either
        raise UserError(f"{clip(arg, 60)!r} is neither a CUDA out-of-memory message nor a file; give the error's "
                        "text, a file holding it, or - (stdin)")
    return read_user_file(Path(arg), "message file")


def capacity_flag(m: OomMessage) -> str:
    """The card as ``--gpu`` takes it: the capacity in GiB as the message prints it (the allowed
    fraction's when set)."""
    n = m.capacity_bytes
    return f"{Decimal(n) / 2**30:.2f}GiB" if m.allowed_bytes is not None or not m.total_text.endswith("GiB") \
        else m.total_text.replace(" ", "")


__all__ = ["EXPANDABLE_SEGMENTS_DOC", "MAX_DEVICE", "MAX_MESSAGE_CHARS", "MAX_SIZE_BYTES", "OomMessage",
           "capacity_flag", "message_text", "parse_oom", "size_bytes"]
