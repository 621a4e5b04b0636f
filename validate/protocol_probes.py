"""What only a GPU can tell, beside the step cases of ``validate --protocol`` (``protocol.py``): the
machine, the device's used memory, the CUDA context, the cuBLAS workspaces and the caching
allocator on a fixed request pattern. Each probe returns ``(status, reason, comparisons, details)``
for a :class:`memcalc.inputs.measured.MeasuredRecord`; off CUDA each is ``skipped`` with the reason,
its prediction still stated.

The device's used memory (:class:`DeviceUsed`) is NVML's ``nvmlDeviceGetMemoryInfo(handle).used``
(nvidia-ml-py) or, without it, ``nvidia-smi --query-gpu=memory.used`` (MiB): what nvidia-smi shows,
the figure memcalc's device total predicts (memcalc.core.gpu_side). It is read once before this
process creates its CUDA context (``device_used_before_bytes``: other processes and the driver's own)
and subtracted from every later reading.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from typing import Any, Optional

import torch

from memcalc.core.allocator import CachingAllocatorSim, round_size
from memcalc.core.gpu_side import REFERENCE_DEVICE, GpuSide, architecture_of, context_of, gpu_side
from memcalc.core.units import MiB
from memcalc.inputs.measured import comparison

ProbeResult = tuple[str, str, list, dict[str, Any]]

NO_CUDA = "needs a CUDA device: {what} exists only on a GPU (the prediction is stated; nothing traced on {device})"


def _nvml_index() -> int:
    """The NVML index of CUDA device 0: CUDA_VISIBLE_DEVICES' first entry when it is a number, else 0."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


class DeviceUsed:
    """The device's used memory, from NVML or nvidia-smi (``source`` None: neither is available)."""

    def __init__(self) -> None:
        self.source: Optional[str] = None
        self.driver: Optional[str] = None
        self.name: Optional[str] = None  # the card's name, read without making a CUDA context
        self._handle: Any = None
        self._index = _nvml_index()
        try:
            import pynvml  # type: ignore[import-not-found]  # nvidia-ml-py

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(self._index)
            drv, name = pynvml.nvmlSystemGetDriverVersion(), pynvml.nvmlDeviceGetName(self._handle)
            self.driver = drv.decode() if isinstance(drv, bytes) else str(drv)
            self.name = name.decode() if isinstance(name, bytes) else str(name)
            self.source = "nvml"
        except Exception:  # not installed, no driver: try nvidia-smi
            self._handle = None
            smi = self._smi("driver_version")
            if smi is not None:
                self.source, self.driver, self.name = "nvidia-smi", smi, self._smi("name")
        self.before = self.used()

    def _smi(self, field: str) -> Optional[str]:
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return None
        try:
            out = subprocess.run([exe, f"--query-gpu={field}", "--format=csv,noheader,nounits", "-i", str(self._index)],
                                 capture_output=True, text=True, timeout=20, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
        return out.splitlines()[0].strip() if out else None

    def used(self) -> Optional[int]:
        """The device's used bytes now (nvidia-smi: MiB resolution)."""
        if self.source == "nvml":
            import pynvml  # type: ignore[import-not-found]

            return int(pynvml.nvmlDeviceGetMemoryInfo(self._handle).used)
        if self.source == "nvidia-smi":
            v = self._smi("memory.used")
            return int(float(v)) * MiB if v is not None else None
        return None

    def since_start(self) -> Optional[int]:
        """Used bytes now less those used before this process's CUDA context."""
        now = self.used()
        return None if now is None or self.before is None else now - self.before


def library_versions() -> dict[str, Optional[str]]:
    """memcalc, transformers, peft and bitsandbytes versions (None: not installed)."""
    from importlib import metadata

    out: dict[str, Optional[str]] = {}
    for name in ("memcalc", "transformers", "peft", "bitsandbytes"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def environment(device: str, used: Optional[DeviceUsed], gpu: bool = True) -> dict[str, Any]:
    """The :class:`memcalc.inputs.measured.Environment` of this run (``gpu``: the card's name and memory,
    which makes the CUDA context: read after the context probe)."""
    env: dict[str, Any] = {"device": device, "torch_version": torch.__version__, "cuda_version": torch.version.cuda,
                           "libraries": library_versions(), "python_version": platform.python_version()}
    if device == "cuda" and gpu:
        cap = torch.cuda.get_device_capability()
        env.update(gpu_name=torch.cuda.get_device_name(), gpu_capability=f"{cap[0]}.{cap[1]}",
                   gpu_total_bytes=int(torch.cuda.mem_get_info()[1]))
    if used is not None:
        env.update(driver_version=used.driver, device_used_source=used.source, device_used_before_bytes=used.before)
    return env


def card_side(device: str, biased_linears: int = 0, compiled: bool = False) -> GpuSide:
    """memcalc's GPU side for the card the protocol runs on, by its architecture
    (:func:`memcalc.core.gpu_side.architecture_of` its compute capability);
    the reference card (H100) on meta."""
    if device != "cuda":
        from memcalc.core.gpu_side import reference_side

        return reference_side(1, biased_linears, compiled)
    arch = architecture_of(torch.cuda.get_device_capability())
    return gpu_side("nvidia", arch, torch.cuda.get_device_name(), 1, biased_linears, compiled)


# -- the CUDA context -----------------------------------------------------------------------------
def context_probe(device: str, used: Optional[DeviceUsed]) -> ProbeResult:
    """The CUDA context: the device's used memory once ``torch.cuda.mem_get_info`` has created it, less
    what was used before, beside memcalc's context for this card's architecture
    (:func:`memcalc.core.gpu_side.context_of`; on meta the reference card's, Hopper)."""
    how = "measured: device used after context creation - before (nothing allocated); predicted: {}"
    if device != "cuda":
        ctx, src = context_of(REFERENCE_DEVICE[1])
        return ("skipped", NO_CUDA.format(what="a CUDA context", device=device),
                [comparison("context", ctx, None, how.format(src))], {})
    free, total = torch.cuda.mem_get_info()  # creates the primary context
    arch = architecture_of(torch.cuda.get_device_capability())
    ctx, src = context_of(arch)
    details = {"mem_get_info_used_bytes": int(total - free), "memory_reserved_bytes": int(torch.cuda.memory_reserved()),
               "architecture": arch}
    measured = used.since_start() if used is not None else None
    reason = ("" if measured is not None else
              "neither NVML (nvidia-ml-py) nor nvidia-smi: the used memory before is unknown")
    return "ok", reason, [comparison("context", ctx, measured, how.format(src))], details


# -- the caching allocator ------------------------------------------------------------------------
#: (tag, bytes) a request, ("free", tag) a release: every size class of the allocator (small pool,
#: the 20 MiB segment under 10 MiB, a large request rounded to 2 MiB), a split, a merge, a reuse
ALLOCATOR_PATTERN: tuple[tuple[str, Any], ...] = (
    ("a", 300_000), ("b", 700_000), ("c", 3_000_000), ("d", 9_000_000), ("free", "c"), ("e", 2_500_000),
    ("f", 25_000_000), ("free", "a"), ("g", 200_000), ("free", "f"), ("h", 12_000_000), ("i", 12_000_000),
    ("free", "d"), ("j", 5_000_000), ("free", "b"), ("k", 1_048_576), ("free", "h"), ("l", 40_000_000),
)


def allocator_probe(device: str) -> ProbeResult:
    """:data:`ALLOCATOR_PATTERN` through memcalc's :class:`CachingAllocatorSim` and (CUDA) through
    PyTorch's caching allocator (``torch.empty`` of uint8): the allocated and reserved peaks of each."""
    sim = CachingAllocatorSim()
    blocks: dict[str, Any] = {}
    for tag, arg in ALLOCATOR_PATTERN:
        if tag == "free":
            sim.free(blocks.pop(arg))
        else:
            blocks[tag] = sim.malloc(arg)
    how = "the request pattern's peaks: memcalc.core.allocator replay vs max_memory_allocated/reserved deltas"
    if device != "cuda":
        return ("skipped", NO_CUDA.format(what="PyTorch's CUDA caching allocator", device=device),
                [comparison("allocator_allocated", sim.peak_allocated, None, how),
                 comparison("allocator_reserved", sim.peak_reserved, None, how)], {})
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    a0, r0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    live: dict[str, torch.Tensor] = {}
    for tag, arg in ALLOCATOR_PATTERN:
        if tag == "free":
            del live[arg]
        else:
            live[tag] = torch.empty(arg, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    peak_a, peak_r = torch.cuda.max_memory_allocated() - a0, torch.cuda.max_memory_reserved() - r0
    details = {"allocated_before_bytes": int(a0), "reserved_before_bytes": int(r0),
               "pattern": [list(p) for p in ALLOCATOR_PATTERN]}
    live.clear()
    torch.cuda.empty_cache()
    return "ok", "", [comparison("allocator_allocated", sim.peak_allocated, int(peak_a), how),
                      comparison("allocator_reserved", sim.peak_reserved, int(peak_r), how)], details


# -- the cuBLAS workspaces ------------------------------------------------------------------------
def _linear_step(bias: bool, n: int = 1024) -> int:
    """memory_allocated grown by one bf16 linear's forward (F.linear: addmm with a bias) and backward
    (its matmuls on the autograd engine's thread), less the tensors it leaves (the weight's gradient)."""
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True) if bias else None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.nn.functional.linear(x, w, b).float().sum().backward()
    torch.cuda.synchronize()
    left = sum(round_size(p.grad.numel() * p.grad.element_size())
               for p in (w, b) if p is not None and p.grad is not None)
    return int(torch.cuda.memory_allocated() - before - left)


def clear_workspaces() -> bool:
    """Free the cuBLAS workspaces (``torch._C._cuda_clearCublasWorkspaces``, where torch has it) and empty
    the cache, so that the next case's first step allocates its own, as a fresh process would."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        torch.cuda.synchronize()
        clear()
    torch.cuda.empty_cache()
    return clear is not None


def workspace_probe(device: str) -> ProbeResult:
    """The cuBLAS / cuBLASLt workspaces a training step leaves allocated: after
    ``torch._C._cuda_clearCublasWorkspaces()`` (where torch has it), an unbiased bf16 linear's forward
    and backward, then a biased one's, each beside memcalc's workspaces (memcalc.core.gpu_side) for
    unbiased and biased linears."""
    plain, biased = card_side(device, False), card_side(device, True)
    how = "memory_allocated left by a linear's forward + backward, less its gradients; predicted: memcalc.core.gpu_side"
    preds = [("workspace", plain.workspace_bytes), ("workspace", biased.workspace_bytes)]
    details: dict[str, Any] = {"predicted_requests_bytes": list(biased.workspace_requests),
                               "predicted_sources": list(biased.sources)}
    if device != "cuda":
        return ("skipped", NO_CUDA.format(what="cuBLAS's workspace", device=device),
                [comparison(m, p, None, how) for m, p in preds], details)
    cleared = clear_workspaces()
    first = _linear_step(False)
    second = _linear_step(True)
    clear_workspaces()  # the later cases allocate their own
    details.update(unbiased_step_bytes=first, biased_step_added_bytes=second, cleared=cleared,
                   env={k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE",
                                                       "TORCH_CUBLASLT_UNIFIED_WORKSPACE")})
    reason = "" if cleared else "torch has no _cuda_clearCublasWorkspaces: workspaces of earlier cases stay"
    return "ok", reason, [comparison("workspace", plain.workspace_bytes, first, how + " (unbiased linear)"),
                          comparison("workspace", biased.workspace_bytes, first + second,
                                     how + " (then a biased linear)")], details


def snapshot_start(device: str) -> bool:
    """Start recording the allocator's history (CUDA): Python frames only, as C++ frames are symbolized
    when the snapshot is dumped, which can take minutes on a long trace."""
    if device != "cuda":
        return False
    torch.cuda.memory._record_memory_history(max_entries=100000, stacks="python")
    return True


def snapshot_stop(path: str) -> None:
    torch.cuda.memory._dump_snapshot(path)
    torch.cuda.memory._record_memory_history(enabled=None)


def warn(line: str) -> None:
    print(f"memcalc validate --protocol: {line}", file=sys.stderr, flush=True)
