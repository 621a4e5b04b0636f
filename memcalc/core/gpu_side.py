"""What a GPU holds beyond the step's own tensors, each part with its source (issue 28).

Three peaks a real run reports, from the step's allocations (the timeline, replayed through the
caching allocator, :mod:`memcalc.core.allocator`):

- **allocated** (``torch.cuda.max_memory_allocated``): the replay's allocated peak (whole blocks)
  plus the cuBLAS / cuBLASLt workspaces, which torch allocates through the caching allocator;
- **reserved** (``torch.cuda.max_memory_reserved``): the replay's reserved peak (``cudaMalloc``
  segments) plus the segments the workspaces take;
- **device total** (what ``nvidia-smi`` shows for the process): reserved + the CUDA context as
  created + what the step's first run loads into it (kernel images, loaded lazily, and cuBLAS /
  cuBLASLt handle state) + NCCL's buffers (``cudaMalloc``'d by NCCL itself, outside the caching
  allocator) when the step is distributed. "Fits" compares the device total with the card's
  ``capacity_bytes``.

Every constant below names the source it was read from; no margin is added anywhere. The context and
the step's loads are measurements (``data/reference/measured/``, the records of ``memcalc validate
--protocol``; ``tests/unit/test_measured_records.py`` re-estimates every step recorded there), chosen by
architecture; one with no measurement takes :data:`STAND_IN`'s, and the estimate says so. What is
ignored: the CUDA, driver and torch versions (every measurement is CUDA 13.0, torch 2.10 / 2.11);
what the step loads per kernel set (one figure per architecture, measured whole: steps of every kind
measured loaded the same bytes); kernels the measured steps never ran (a distributed step's NCCL
kernels, bitsandbytes', Liger's Triton kernels). What is known to be left out is said in
:data:`NOT_MODELLED` (the estimate prints it as an assumption).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from memcalc.core.allocator import CachingAllocatorSim
from memcalc.core.units import KiB, MiB

if TYPE_CHECKING:
    from memcalc.core.spec import ExperimentSpec

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

# -- CUDA context and what a step loads into it ------------------------------------------------------
#: torch >= 1.13 sets ``CUDA_MODULE_LOADING=LAZY`` (pytorch/pytorch PR #86509), and every torch memcalc
#: emulates (2.1 - 2.13) is built with CUDA >= 11.8, so a kernel's image is loaded into the context when
#: it first runs: what nvidia-smi shows beyond reserved is the context as created, then what the step's
#: first run loads on top (kernel images, cuBLAS / cuBLASLt handle state), outside the caching allocator.
#: Each figure below is a measurement; the architecture decides which one applies (the CUDA and driver
#: versions are ignored: both measurements are CUDA 13.0; a CUDA 12 context may differ by some MiB).
MEASURED_H200 = "data/reference/measured/protocol-cuda-nvidia-h200-20261128-070544.json"
#: the context on Hopper: nvidia-smi (NVML) used after ``torch.cuda.mem_get_info`` created it, less
#: before (nothing allocated): 548,995,072 B (523.56 MiB), H200, CUDA 13.0, torch 2.11, driver 580.159
#: (MEASURED_H200, case ``cuda-context``)
CUDA_CONTEXT_HOPPER_BYTES = 548_995_072
#: the context on Ada Lovelace: 426 MiB in nvidia-smi after ``torch.cuda.mem_get_info`` created it,
#: PyTorch 2.10.0+cu130 on an RTX 6000 Ada (unslothai/unsloth-zoo PR #1053, "Live measurements" table)
CUDA_CONTEXT_ADA_BYTES = 426 * MiB
CUDA_CONTEXT_LAZY_BYTES = CUDA_CONTEXT_ADA_BYTES  # the name the first figure had
#: what a training step loads into the device outside the caching allocator, on top of the context as
#: created: device used at the step's end (reserved at its peak) less max_memory_reserved less the
#: context = 747.5625 - 523.5625 = 224 MiB in every eager step case of MEASURED_H200 (6 reference
#: configs, hf-lora, chunked-loss: the same to the byte, 1B-parameter models from 2 to 16 layers, fp32
#: and bf16, full fine-tune and LoRA, with and without checkpointing); hf-qlora is left out (its
#: device used was read before its step: the records README's known faults).
STEP_LOADED_HOPPER_BYTES = 224 * MiB
#: torch.compile's steps load 64 KiB more: 747.625 MiB less reserved in each of MEASURED_H200's 5
#: compiled cases (inductor's Triton kernels, each its own module: suspected, not traced)
STEP_LOADED_COMPILE_BYTES = 64 * KiB

#: architecture -> (context bytes, its source); (step-loaded bytes, its source) for those measured
_CONTEXTS = {
    "Hopper": (CUDA_CONTEXT_HOPPER_BYTES, f"CUDA context {CUDA_CONTEXT_HOPPER_BYTES:,} B: measured on an H200, "
               f"CUDA 13.0, torch 2.11 ({MEASURED_H200}, case cuda-context)"),
    "Ada Lovelace": (CUDA_CONTEXT_ADA_BYTES, "CUDA context 426 MiB: nvidia-smi after context creation, PyTorch "
                     "2.10+cu130, RTX 6000 Ada (unslothai/unsloth-zoo PR #1053)"),
}
_STEP_LOADED = {
    "Hopper": (STEP_LOADED_HOPPER_BYTES, f"loaded by the step {STEP_LOADED_HOPPER_BYTES:,} B (kernel images, "
               "cuBLAS state): device used less reserved less the context in every eager step case of "
               f"{MEASURED_H200}"),
}
#: an architecture with no measurement of its own: the H200's (the larger context measured, and the only
#: step measured), so that the device total is not low where nothing was measured
STAND_IN = "Hopper"
CUDA_CONTEXT_SOURCE = _CONTEXTS[STAND_IN][1]

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
NOT_MODELLED = ("the CUDA, driver and torch versions (the context and the step's loads are CUDA 13.0 measurements); "
                "the step's loads per kernel set (one figure per architecture, measured whole); kernels the "
                "measured steps never ran (NCCL's, bitsandbytes', Triton's); NCCL channels beyond 2")


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
    cuda_context_bytes: int  # the context as created
    nccl_bytes: int
    sources: tuple[str, ...]
    step_loaded_bytes: int = 0  # what the step's first run loads into the context (kernel images, handles)

    @property
    def workspace_bytes(self) -> int:
        """What the workspaces add to ``memory_allocated`` (each request rounded to 512 bytes)."""
        return sum(-(-n // 512) * 512 for n in self.workspace_requests)

    @property
    def workspace_segment_bytes(self) -> int:
        """What the workspaces add to ``memory_reserved``: their own segments."""
        return _segments_bytes(list(self.workspace_requests))

    @property
    def outside_allocator_bytes(self) -> int:
        """What the device holds outside the caching allocator: the context, what the step loads, NCCL."""
        return self.cuda_context_bytes + self.step_loaded_bytes + self.nccl_bytes


def _workspaces(vendor: str, architecture: str, lt_threads: int) -> tuple[tuple[int, ...], str]:
    """The workspace allocations of a step on this device, and where their sizes come from.

    ``lt_threads``: the threads that run a biased linear's forward (addmm with a 1-D bias runs cuBLASLt's
    ``gemm_and_bias`` epilogue, aten/src/ATen/native/cuda/Blas.cpp ``addmm_out_cuda_impl``), each with its
    own cuBLASLt handle (CublasHandlePool.cpp ``getCurrentCUDABlasLtHandle``: a thread_local pool window)
    and so its own workspace (``cublaslt_handle_stream_to_workspace``, keyed by handle and stream). The
    backward of addmm is two plain ``mm`` (derivatives.yaml ``mm_mat1_backward`` / ``mm_mat2_backward``)
    and a sum for the bias: cuBLAS, not cuBLASLt, so the autograd thread has no cuBLASLt workspace unless
    activation checkpointing recomputes the forward there (torch/utils/checkpoint.py: the recomputation
    runs inside backward). Measured: a biased linear's step adds 1,048,576 B, one cuBLASLt workspace
    (MEASURED_H200, case cublas-workspace: 65 MiB against the 66 MiB two would make)."""
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
    src += f", one per handle: {CUBLAS_HANDLES} handles (forward thread, autograd thread)"
    n_lt = min(int(lt_threads), CUBLAS_HANDLES)
    if n_lt:
        reqs += [lt] * n_lt
        which_lt = "the forward's thread" if n_lt == 1 else "the forward's and the recomputing autograd thread"
        src += f"; {n_lt} cuBLASLt workspace(s) of {lt:,} B (biased linears' addmm on {which_lt})"
    return tuple(reqs), src


#: compute capability -> the architecture as ``data/gpus.yaml`` names it (7.5 Turing and 8.9 Ada Lovelace
#: by their minor; else by the major: 7 Volta, 8 Ampere, 9 Hopper, 10 / 12 Blackwell)
_BY_CAPABILITY = {(7, 5): "Turing", (8, 9): "Ada Lovelace"}
_BY_MAJOR = {7: "Volta", 8: "Ampere", 9: "Hopper", 10: "Blackwell", 12: "Blackwell"}


def architecture_of(capability: tuple[int, int]) -> str:
    """The architecture of a card of compute ``capability`` (``unspecified`` for one not listed). Hopper's
    32 MiB cuBLAS workspace follows (CublasHandlePool.cpp tests ``major == 9 && minor == 0``)."""
    return _BY_CAPABILITY.get(tuple(capability), _BY_MAJOR.get(capability[0], "unspecified"))  # type: ignore[arg-type]


def context_of(architecture: str) -> tuple[int, str]:
    """The CUDA context as created on ``architecture`` and its source (:data:`STAND_IN`'s where unmeasured)."""
    ctx, src = _CONTEXTS.get(architecture, _CONTEXTS[STAND_IN])
    return ctx, src if architecture in _CONTEXTS else f"{src}; no context measured on {architecture}: it stands in"


def _context(vendor: str, architecture: str, compiled: bool) -> tuple[int, int, list[str]]:
    """The CUDA context as created, what the step loads on top, and their sources (the measured
    architecture's, else :data:`STAND_IN`'s, said)."""
    ctx, ctx_src = _CONTEXTS.get(architecture, _CONTEXTS[STAND_IN])
    loaded, loaded_src = _STEP_LOADED.get(architecture, _STEP_LOADED[STAND_IN])
    sources = [ctx_src, loaded_src]
    missing = [what for what, table in (("context", _CONTEXTS), ("step's loads", _STEP_LOADED))
               if architecture not in table]
    if vendor == "amd":
        sources.append(f"no ROCm measurement of the context or the step's loads: the {STAND_IN} (H200) figure "
                       "stands in")
    elif missing:
        sources.append(f"no {' or '.join(missing)} measured on {architecture}: the {STAND_IN} (H200) figure stands in")
    if compiled:
        sources.append(f"torch.compile's step loads {STEP_LOADED_COMPILE_BYTES:,} B more (its compiled cases there)")
    return ctx, loaded + (STEP_LOADED_COMPILE_BYTES if compiled else 0), sources


def gpu_side(vendor: str, architecture: str, device: str, gpus: int = 1, biased_linears: int = 0,
             compiled: bool = False) -> GpuSide:
    """The GPU side of a step on one card (``vendor``/``architecture`` as in ``data/gpus.yaml``;
    ``any``/``unspecified`` for a card given by its capacity: the CUDA defaults outside Hopper).
    ``biased_linears``: the threads that run a biased linear's forward (:func:`_workspaces`; True = 1);
    ``compiled``: a torch.compile step (:data:`STEP_LOADED_COMPILE_BYTES`)."""
    reqs, ws_src = _workspaces(vendor, architecture, int(biased_linears))
    ctx, loaded, ctx_sources = _context(vendor, architecture, compiled)
    sources = [ws_src, *ctx_sources]
    nccl = 0
    if gpus > 1:
        nccl = NCCL_CHANNELS * NCCL_CONNECTION_BYTES
        sources.append(f"NCCL buffers {nccl:,} B: {NCCL_CHANNELS} channels x (LL {NCCL_LL_BUFFSIZE:,} + LL128 "
                       f"{NCCL_LL128_BUFFSIZE:,} + Simple {NCCL_SIMPLE_BUFFSIZE:,}) B (NCCL src/init.cc defaults; "
                       "a lower bound: the channel count is the topology's)")
    return GpuSide(device, reqs, ctx, nccl, tuple(sources), loaded)


#: the card the estimate's own totals are for when no single --gpu is given
REFERENCE_DEVICE = ("nvidia", "Hopper", "NVIDIA H100 80GB")


def reference_side(gpus: int = 1, biased_linears: int = 0, compiled: bool = False) -> GpuSide:
    vendor, arch, name = REFERENCE_DEVICE
    return gpu_side(vendor, arch, name, gpus, biased_linears, compiled)


@dataclass(frozen=True)
class DeviceMemory:
    """The three peaks of a step on one card, and the parts of the device total (integer bytes)."""

    device: str
    allocated_peak_bytes: int  # max_memory_allocated: the step's blocks + workspaces
    reserved_peak_bytes: int  # max_memory_reserved: the step's segments + the workspaces'
    device_total_bytes: int  # nvidia-smi: reserved + CUDA context + what the step loads + NCCL
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
        "step_loaded_bytes": side.step_loaded_bytes,
        "nccl_bytes": side.nccl_bytes,
    }
    total = reserved + side.outside_allocator_bytes
    assert sum(parts.values()) == total
    return DeviceMemory(side.device, allocated, reserved, total, parts)


def overhead_bytes(side: GpuSide) -> int:
    """The device total less the allocated step peak when reserved is taken as allocated (no replay):
    the workspaces' segments + the CUDA context + what the step loads + NCCL. A constant of the card and
    the step's GPU count."""
    return side.workspace_segment_bytes + side.outside_allocator_bytes


# -- the side of one experiment (memcalc.estimate.peak re-exports these) ---------------------------------
def biased_linears(exp: ExperimentSpec) -> int:
    """The threads that run a biased linear's forward, each with a cuBLASLt workspace of its own
    (:func:`_workspaces`): none without biases; the Python thread; and the
    autograd thread too when checkpointing recomputes the layers' linears in backward (every policy
    but ``selective``, which recomputes the attention core alone)."""
    m = exp.model
    if not (m.qkv_bias or m.o_bias or m.mlp_bias or m.lm_head_bias):
        return 0
    return 2 if exp.training.checkpoint not in ("none", "selective") else 1


def _exp_side(exp: ExperimentSpec, vendor: str, arch: str, name: str) -> GpuSide:
    """The GPU side of one rank: NCCL's buffers whenever the step runs on more than one GPU, whichever the
    dimensions (data-parallel ``gpus`` x ``tp`` x ``cp`` x ``pp``; expert parallelism is within ``gpus``)."""
    tr = exp.training
    world = tr.gpus * tr.tp * tr.cp * tr.pp
    return gpu_side(vendor, arch, name, world, biased_linears(exp), tr.compile)


def step_side(exp: ExperimentSpec, side: Optional[GpuSide] = None) -> GpuSide:
    """``side`` (a card's: :func:`memcalc.core.gpu_side.gpu_side`), else the reference card's for
    ``exp``'s GPU count, linears and compilation."""
    return side if side is not None else _exp_side(exp, *REFERENCE_DEVICE)


def card_side(exp: ExperimentSpec, card) -> GpuSide:
    """The GPU side of ``exp`` on ``card`` (a ``data/gpus.yaml`` entry: vendor, architecture, display_name;
    a card without them, such as a bare capacity, is any vendor's of unspecified architecture)."""
    return _exp_side(exp, getattr(card, "vendor", "any"), getattr(card, "architecture", "unspecified"),
                 getattr(card, "display_name", card.name))
