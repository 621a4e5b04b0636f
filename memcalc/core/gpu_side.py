"""What a GPU holds beyond the step's own tensors, each part with its source (issue 28).

Three peaks a real run reports, from the step's allocations (the timeline, replayed through the
caching allocator, :mod:`memcalc.core.allocator`):

- **allocated** (``torch.cuda.max_memory_allocated``): the replay's allocated peak (whole blocks)
  plus the cuBLAS / cuBLASLt workspaces, which torch allocates through the caching allocator;
- **reserved** (``torch.cuda.max_memory_reserved``): the replay's reserved peak (``cudaMalloc``
  segments) plus the segments the workspaces take;
- **device total** (what ``nvidia-smi`` shows for the process): reserved + the CUDA context +
  NCCL's buffers (``cudaMalloc``'d by NCCL itself, outside the caching allocator) when the step is
  distributed. "Fits" compares the device total with the card's ``capacity_bytes``.

Every constant below names the source it was read from; no margin is added anywhere. What is
known to be left out is said in :data:`NOT_MODELLED` (the estimate prints it as an assumption).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from memcalc.core.allocator import CachingAllocatorSim
from memcalc.core.units import KiB, MiB

# -- cuBLAS / cuBLASLt workspaces ---------------------------------------------------------------
#: aten/src/ATen/cuda/CublasHandlePool.cpp ``parseChosenWorkspaceSize`` (torch 2.0 - 2.8, since
#: pytorch/pytorch PR #89027): without ``CUBLAS_WORKSPACE_CONFIG`` the workspace is ":4096:2:16:8",
#: i.e. ``4096 * 1024 * 2 + 16 * 1024 * 8`` bytes (2 x 4 MiB + 8 x 16 KiB) ...
CUBLAS_WORKSPACE_DEFAULT_BYTES = 4096 * KiB * 2 + 16 * KiB * 8
#: ... and ``4096 * 8 * 1024`` (32 MiB) on sm90 (Hopper: ``properties->major == 9 && minor == 0``).
#: (pytorch/pytorch PR #175344, 2026, extends 32 MiB to Blackwell; torch 2.8 keeps it to sm90.)
CUBLAS_WORKSPACE_HOPPER_BYTES = 4096 * 8 * KiB
#: the ROCm branch of the same function (torch 2.8): hipBLAS 32 MiB, 128 MiB on gfx94x (MI300X).
HIPBLAS_WORKSPACE_BYTES = 32 * MiB
HIPBLAS_WORKSPACE_GFX94_BYTES = 128 * MiB
#: CublasHandlePool.cpp ``parseCUDABlasLtWorkspaceSize``: ``CUBLASLT_WORKSPACE_SIZE`` default 1024 KiB
#: ("default size in KiB according to #73328"), 76 MiB for hipBLASLt on ROCm. ``getCUDABlasLtWorkspace``
#: allocates it per (handle, stream) through the caching allocator, in its own map
#: (``cublaslt_handle_stream_to_workspace``) unless ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1``.
CUBLASLT_WORKSPACE_BYTES = 1024 * KiB
HIPBLASLT_WORKSPACE_BYTES = 76 * MiB
#: Workspaces per step: one per (cuBLAS handle, stream) (``setWorkspaceForHandle`` /
#: ``getNewWorkspace``: ``c10::cuda::CUDACachingAllocator::get()->allocate(getChosenWorkspaceSize())``,
#: kept in ``cublas_handle_stream_to_workspace`` for the life of the process, so they count in
#: ``memory_allocated``). Handles are per thread (``thread_local ... PoolWindow``): the forward and
#: the optimizer run on the Python thread, the backward on the autograd engine's device thread
#: (torch/csrc/autograd/engine.cpp ``Engine::start_device_threads``), both on the current stream:
#: two handles, two workspaces.
CUBLAS_HANDLES = 2

# -- CUDA context -------------------------------------------------------------------------------
#: (rule, bytes, source). torch >= 1.13 sets ``CUDA_MODULE_LOADING=LAZY`` (pytorch/pytorch PR #86509),
#: and every torch memcalc emulates (2.1 - 2.13) is built with CUDA >= 11.8, so kernels load into the
#: context lazily. The one published measurement of the context alone (no tensor, nothing reserved)
#: on a recent torch: 426 MiB in nvidia-smi after ``torch.cuda.mem_get_info`` created it, PyTorch
#: 2.10.0+cu130 on an RTX 6000 Ada (unslothai/unsloth-zoo PR #1053, "Live measurements" table).
CUDA_CONTEXT_LAZY_BYTES = 426 * MiB
CUDA_CONTEXT_SOURCE = ("CUDA context 426 MiB: nvidia-smi after context creation, PyTorch 2.10+cu130, RTX 6000 Ada "
                       "(unslothai/unsloth-zoo PR #1053); lazy module loading (torch >= 1.13, PR #86509)")

# -- NCCL ---------------------------------------------------------------------------------------
#: NCCL src/init.cc ``computeBuffSizes`` defaults, the receive buffers of one connection (one peer
#: on one channel), one per protocol: LL ``NCCL_LL_LINES_PER_THREAD * NCCL_LL_MAX_NTHREADS *
#: NCCL_STEPS * sizeof(ncclLLFifoLine)`` = 8 x 512 x 8 x 16; LL128 ``NCCL_LL128_ELEMS_PER_THREAD *
#: NCCL_LL128_MAX_NTHREADS * NCCL_STEPS * 8`` = 120 x 640 x 8 x 8; Simple ``DEFAULT_BUFFSIZE``
#: (``NCCL_BUFFSIZE``) = 1 << 22. NCCL ``cudaMalloc``s them itself: in nvidia-smi, not in reserved.
NCCL_LL_BUFFSIZE = 8 * 512 * 8 * 16
NCCL_LL128_BUFFSIZE = 120 * 640 * 8 * 8
NCCL_SIMPLE_BUFFSIZE = 1 << 22
NCCL_CONNECTION_BYTES = NCCL_LL_BUFFSIZE + NCCL_LL128_BUFFSIZE + NCCL_SIMPLE_BUFFSIZE
#: The channel count is NCCL's topology search's (src/graph/search.cc), unknown without the machine:
#: counted here is one ring of the default process group with 2 channels, the fewest NCCL's ring
#: search returns (it doubles the rings it finds), each receiving from one peer. A lower bound: NVLink
#: machines run up to 32 channels, and tree/NVLS algorithms connect more peers.
NCCL_CHANNELS = 2

#: what the device total leaves out, said with every estimate
NOT_MODELLED = ("kernel images loaded lazily into the CUDA context as the step first runs them (cuBLAS, "
                "attention, torch's own kernels) and cuBLAS's handle state: not in the CUDA context figure")


def _segments_bytes(requests: list[int]) -> int:
    """The ``cudaMalloc`` segments the caching allocator reserves for ``requests`` made in order,
    alone (:class:`memcalc.core.allocator.CachingAllocatorSim`: 20 MiB for a request under 10 MiB,
    2 MiB small-pool segments for one of at most 1 MiB, else the request rounded to 2 MiB)."""
    sim = CachingAllocatorSim()
    for n in requests:
        sim.malloc(n)
    return sim.reserved


@dataclass(frozen=True)
class GpuSide:
    """The parts of one device's memory outside the step's tensors (integer bytes)."""

    device: str  # the card (display name) or architecture they are for
    workspace_requests: tuple[int, ...]  # each cuBLAS / cuBLASLt workspace allocation, in bytes
    cuda_context_bytes: int
    nccl_bytes: int
    sources: tuple[str, ...]

    @property
    def workspace_bytes(self) -> int:
        """What the workspaces add to ``memory_allocated`` (each request rounded to 512 bytes)."""
        return sum(-(-n // 512) * 512 for n in self.workspace_requests)

    @property
    def workspace_segment_bytes(self) -> int:
        """What the workspaces add to ``memory_reserved``: their own segments."""
        return _segments_bytes(list(self.workspace_requests))


def _workspaces(vendor: str, architecture: str, biased_linears: bool) -> tuple[tuple[int, ...], str]:
    """The workspace allocations of a step on this device, and where their sizes come from."""
    if vendor == "amd":
        ws = HIPBLAS_WORKSPACE_GFX94_BYTES if architecture.startswith("CDNA 3") else HIPBLAS_WORKSPACE_BYTES
        lt = HIPBLASLT_WORKSPACE_BYTES
        src = f"hipBLAS workspace {ws // MiB} MiB, hipBLASLt {lt // MiB} MiB (CublasHandlePool.cpp, ROCm branch)"
    else:
        ws = CUBLAS_WORKSPACE_HOPPER_BYTES if architecture == "Hopper" else CUBLAS_WORKSPACE_DEFAULT_BYTES
        lt = CUBLASLT_WORKSPACE_BYTES
        which = "32 MiB on Hopper" if ws == CUBLAS_WORKSPACE_HOPPER_BYTES else ":4096:2:16:8"
        src = f"cuBLAS workspace {ws:,} B ({which}, CublasHandlePool.cpp parseChosenWorkspaceSize)"
    reqs = [ws] * CUBLAS_HANDLES
    if biased_linears:  # addmm with a bias runs cublasLt's gemm_and_bias epilogue (aten Blas.cpp)
        reqs += [lt] * CUBLAS_HANDLES
        src += f" and a cuBLASLt workspace of {lt:,} B (biased linears)"
    return tuple(reqs), src + f", one per handle: {CUBLAS_HANDLES} handles (forward thread, autograd thread)"


def gpu_side(vendor: str, architecture: str, device: str, gpus: int = 1, biased_linears: bool = False) -> GpuSide:
    """The GPU side of a step on one card (``vendor``/``architecture`` as in ``data/gpus.yaml``;
    ``any``/``unspecified`` for a card given by its capacity: the CUDA defaults outside Hopper)."""
    reqs, ws_src = _workspaces(vendor, architecture, biased_linears)
    sources = [ws_src, CUDA_CONTEXT_SOURCE]
    if vendor == "amd":
        sources.append("no published ROCm context measurement: the CUDA figure stands in")
    nccl = 0
    if gpus > 1:
        nccl = NCCL_CHANNELS * NCCL_CONNECTION_BYTES
        sources.append(f"NCCL buffers {nccl:,} B: {NCCL_CHANNELS} channels x (LL {NCCL_LL_BUFFSIZE:,} + LL128 "
                       f"{NCCL_LL128_BUFFSIZE:,} + Simple {NCCL_SIMPLE_BUFFSIZE:,}) B (NCCL src/init.cc defaults; "
                       "a lower bound: the channel count is the topology's)")
    return GpuSide(device, reqs, CUDA_CONTEXT_LAZY_BYTES, nccl, tuple(sources))


#: the card the estimate's own totals are for when no single --gpu is given
REFERENCE_DEVICE = ("nvidia", "Hopper", "NVIDIA H100 80GB")


def reference_side(gpus: int = 1, biased_linears: bool = False) -> GpuSide:
    vendor, arch, name = REFERENCE_DEVICE
    return gpu_side(vendor, arch, name, gpus, biased_linears)


@dataclass(frozen=True)
class DeviceMemory:
    """The three peaks of a step on one card, and the parts of the device total (integer bytes)."""

    device: str
    allocated_peak_bytes: int  # max_memory_allocated: the step's blocks + workspaces
    reserved_peak_bytes: int  # max_memory_reserved: the step's segments + the workspaces'
    device_total_bytes: int  # nvidia-smi: reserved + CUDA context + NCCL
    parts: dict[str, int]  # sums to device_total_bytes

    def as_json(self) -> dict:
        return {"device": self.device, "allocated_peak_bytes": self.allocated_peak_bytes,
                "reserved_peak_bytes": self.reserved_peak_bytes, "device_total_bytes": self.device_total_bytes,
                "parts": dict(self.parts)}


def device_memory(step_allocated_bytes: int, step_reserved_bytes: Optional[int], side: GpuSide) -> DeviceMemory:
    """The peaks on ``side``'s card of a step whose own allocations peak at ``step_allocated_bytes``
    allocated and ``step_reserved_bytes`` reserved (the allocator replay; None without one: reserved
    taken as allocated, no fragmentation). The workspaces sit in segments of their own."""
    reserved_step = step_allocated_bytes if step_reserved_bytes is None else step_reserved_bytes
    allocated = step_allocated_bytes + side.workspace_bytes
    reserved = reserved_step + side.workspace_segment_bytes
    parts = {
        "step_allocated_bytes": step_allocated_bytes,
        "workspace_bytes": side.workspace_bytes,
        "allocator_overhead_bytes": reserved - allocated,
        "cuda_context_bytes": side.cuda_context_bytes,
        "nccl_bytes": side.nccl_bytes,
    }
    total = reserved + side.cuda_context_bytes + side.nccl_bytes
    assert sum(parts.values()) == total
    return DeviceMemory(side.device, allocated, reserved, total, parts)


def overhead_bytes(side: GpuSide) -> int:
    """The device total less the allocated step peak when reserved is taken as allocated (no replay):
    the workspaces' segments + the CUDA context + NCCL. A constant of the card and the step's GPU count."""
    return side.workspace_segment_bytes + side.cuda_context_bytes + side.nccl_bytes
