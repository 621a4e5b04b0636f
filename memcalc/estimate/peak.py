"""estimate(experiment) -> Estimate: the peak over the step's timeline, and what sets it.

Runs the steady-state step on the simulator and takes the first step (where optimizer state is
created) from it, or simulates that too under DeepSpeed; the reported peak is the higher of the two, as a
``torch.cuda.max_memory_allocated`` reading over a run would be. The memory a GPU must have is
the device total of :mod:`memcalc.core.gpu_side`: the caching allocator's replayed reserved peak,
the cuBLAS workspaces, the CUDA context and NCCL's buffers, each from its source.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Callable, Optional

from memcalc.core.allocator import CachingAllocatorSim
from memcalc.core.gpu_side import (NOT_MODELLED, GpuSide, card_side, device_memory, overhead_bytes, reference_side,
                                   step_side)
from memcalc.core.dtypes import DType
from memcalc.core.optimizers import OPTIMIZERS, OptimizerRecord
from memcalc.engine.fsdp import fsdp_active, host_offload_bytes, optimizer_training
from memcalc.engine.loading import load_phase
from memcalc.engine.observers import PeakAbove
from memcalc.engine.sharding import offload_param
from memcalc.core.ring_attention import gpus_note
from memcalc.engine.blocks.notes import family_notes
from memcalc.estimate.techniques import technique_assumptions, technique_extra, technique_notes
from memcalc.engine.optimizers import state_dtype
from memcalc.engine.params import count_params
from memcalc.engine.result import KINDS, Estimate, SimResult
from memcalc.engine.timeline import first_step_within_steady
from memcalc.core.spec import DEFAULT_LOSS_CHUNKS, ExperimentSpec, KernelProfile, ModelSpec, TrainingSpec
from memcalc.estimate.step import first_step, steady_step


def _is_array(x) -> bool:
    """Whether ``x`` is a numpy array, without importing numpy (``estimate`` never needs it: an
    array can only exist once the plan has imported numpy)."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, np.ndarray)


def largest_peak_within(capacity_bytes: int, side: Optional[GpuSide] = None) -> int:
    """The highest allocated peak whose :func:`required_bytes` fit ``capacity_bytes`` (-1 if none):
    a step whose running total passes it does not fit, whatever the rest of the step does."""
    return max(capacity_bytes - overhead_bytes(side or reference_side()), -1)


def required_bytes(peak_bytes, side: Optional[GpuSide] = None):
    """The device total for an allocated step peak (the step's own tensors) without an allocator
    replay (reserved taken as allocated): peak + the workspaces' segments + CUDA context + NCCL on
    ``side``'s card (:func:`memcalc.core.gpu_side.device_memory`; default: the reference card, one
    GPU). Ints stay exact ints; an array of peaks gives a float64 array (whole numbers), for
    :mod:`memcalc.plan`'s fits."""
    extra = overhead_bytes(side or reference_side())
    if _is_array(peak_bytes):
        import numpy as np

        return np.asarray(peak_bytes, dtype=np.float64) + extra
    return int(peak_bytes) + extra


def bytes_per_param(exp: ExperimentSpec) -> dict[str, float]:
    """Bytes per trainable parameter of weights, gradients, master copy and optimizer state
    (LoRA: of the adapters, in :attr:`ExperimentSpec.adapter_dtype`; fp32 adapters step as fp32).
    Under FSDP2 / FSDP1 with ``--master-weights`` the shards and gradient shards are fp32 and the optimizer
    steps them (no separate master copy: :func:`memcalc.engine.fsdp.optimizer_training`)."""
    tr = optimizer_training(exp.training)
    adt = exp.adapter_dtype
    if adt is not None and adt.bits == 32 and tr.weight_dtype.bits != 32 and not tr.master_weights:
        tr = tr.model_copy(update={"precision": "fp32"})
    w = tr.weight_dtype.bits / 8
    opt = OPTIMIZERS[tr.optimizer].state_bytes_per_param(state_dtype(tr).bits / 8)
    return {
        "weights": w,
        "gradients": w,
        "master_weights": 4.0 if tr.master_weights else 0.0,
        "optimizer_state": opt,
    }


@dataclass(frozen=True)
class _Setup:
    """What the no-effect rules read: the training options, the model, the profile, the optimizer."""

    tr: TrainingSpec
    model: ModelSpec
    profile: KernelProfile
    opt: OptimizerRecord

    def changed(self, name: str) -> bool:
        """Whether the training option ``name`` was set away from its default."""
        return getattr(self.tr, name) != type(self.tr).model_fields[name].default

    def deepspeed(self) -> bool:
        """DeepSpeed ZeRO-2/3 runs, on one GPU too (memcalc.engine.sharding.uses_deepspeed)."""
        return self.tr.sharding == "deepspeed" and self.tr.zero >= 2

    def lora_without_qlora(self, name: str) -> bool:
        """Whether LoRA's QLoRA-only option ``name`` was set away from its default without QLoRA."""
        lo = self.tr.lora
        return lo is not None and not lo.qlora and getattr(lo, name) != type(lo).model_fields[name].default


#: KernelProfile.liger_ops's default: every kernel Liger's apply functions apply
_LIGER_DEFAULT = KernelProfile.model_fields["liger_ops"].default
#: the pipeline's fields, which pp 1 leaves inert
_PP_FIELDS = ("pp_schedule", "microbatches", "pp_stages_per_rank", "pp_first_stage_less_layers",
              "pp_last_stage_less_layers")


def _have(s: _Setup) -> str:
    """The verb for the pipeline fields ``s`` sets."""
    return "has" if sum(map(s.changed, _PP_FIELDS)) == 1 else "have"


#: (when, note) of each option that changes nothing in a setup, in the order the notes are shown
#: (the setup-dependent entries of ``memcalc.core.contract.CONDITIONAL``)
NO_EFFECT: list[tuple[Callable[[_Setup], bool], Callable[[_Setup], str]]] = [
    (lambda s: s.tr.zero >= 1 and s.tr.gpus * s.tr.cp == 1 and not s.deepspeed(),
     lambda s: f"zero {s.tr.zero} has no effect with one GPU: nothing to shard (set gpus)"),
    (lambda s: s.tr.zero == 1 and s.tr.gpus > 1 and s.tr.offload_optimizer,
     lambda s: "zero 1 has no effect with offload_optimizer: the optimizer state it shards is on the CPU"),
    (lambda s: s.changed("sharding") and (s.tr.gpus * s.tr.cp == 1 or s.tr.zero == 0) and not s.deepspeed(),
     lambda s: f"sharding {s.tr.sharding} has no effect with zero {s.tr.zero} on {s.tr.gpus} GPU"
               f"{'s' if s.tr.gpus > 1 else ''}: nothing is sharded"),
    (lambda s: s.tr.zero == 1 and s.tr.gpus > 1 and s.tr.sharding in ("fsdp2", "fsdp1"),
     lambda s: f"zero 1 under {s.tr.sharding}: FSDP has no stage 1 (it always shards the parameters); estimated "
               "as DDP + ZeroRedundancyOptimizer, the ZeRO paper's stage 1 (optimizer state sharded, whole "
               "weights and gradients; DDP's gradient buckets not modelled)"),
    (lambda s: s.tr.gpus > 1 and s.tr.zero == 0 and s.tr.ep == 1,
     lambda s: f"gpus {s.tr.gpus} has no effect without ZeRO but NCCL's buffers: plain data parallelism keeps a "
               "whole copy on every GPU (the estimate is per GPU)"),
    (lambda s: s.tr.gpus > s.tr.ep > 1 and s.tr.zero == 0,
     lambda s: f"gpus {s.tr.gpus} beyond ep {s.tr.ep} changes nothing per GPU without ZeRO: each group of "
               f"{s.tr.ep} ranks holds the rest of the model whole and 1/{s.tr.ep} of the experts (engine."
               "expert_parallel)"),
    (lambda s: s.tr.deepspeed is not None and s.tr.deepspeed.offload_param
     and (s.tr.zero < 3 or s.tr.sharding != "deepspeed"),
     lambda s: "offload_param has no effect without DeepSpeed ZeRO-3: DeepSpeed reads it at stage 3 only "
               "(runtime/zero/offload_config.py)"),
    (lambda s: s.tr.sequence_parallel and s.tr.tp == 1,
     lambda s: "sequence_parallel has no effect with tp 1: there is no tensor-parallel group to shard the "
               "sequence over (set tp)"),
    (lambda s: s.tr.ep == 1 and s.tr.ep_capacity_factor != 1.0,
     lambda s: f"ep_capacity_factor {s.tr.ep_capacity_factor:g} has no effect with ep 1: no all-to-all dispatch "
               "receives rows (set ep)"),
    (lambda s: s.tr.pp == 1 and any(s.changed(f) for f in _PP_FIELDS),
     lambda s: f"{', '.join(f for f in _PP_FIELDS if s.changed(f))} {_have(s)} no effect with pp 1: there is no "
               "pipeline to schedule or split (set pp)"),
    (lambda s: s.tr.checkpoint != "every-k" and s.changed("checkpoint_every"),
     lambda s: f"checkpoint_every {s.tr.checkpoint_every} has no effect with checkpoint {s.tr.checkpoint}: "
               "it is the K of every-k"),
    # (learned positions beyond max_seq_len are refused: engine.timeline)
    (lambda s: s.tr.seq > s.model.max_seq_len and s.model.positions != "learned",
     lambda s: f"seq {s.tr.seq:,} is beyond {s.model.name}'s max_seq_len {s.model.max_seq_len:,} "
               f"({s.model.positions} positions): the model was not trained on sequences that long; the memory "
               "estimate still holds"),
    (lambda s: s.tr.checkpoint == "every-k" and s.tr.checkpoint_every >= s.model.n_layers > 1,
     lambda s: f"checkpoint every-{s.tr.checkpoint_every} with {s.model.n_layers} layers checkpoints layer 0 only "
               f"(layers i with i % {s.tr.checkpoint_every} == 0); the other {s.model.n_layers - 1} keep their "
               "activations"),
    (lambda s: s.tr.memory_budget is not None and s.tr.compile and not s.tr.compile_partitions,
     lambda s: f"memory_budget {s.tr.memory_budget:g} has no effect with checkpoint {s.tr.checkpoint}: "
               "torch.compile recomputes the checkpointed regions whole"),
    (lambda s: s.changed("optimizer_impl") and s.opt.step == "none" and len(s.opt.impls) > 1,
     lambda s: f"optimizer_impl {s.tr.optimizer_impl} has no effect with {s.opt.name}: its step makes no temporaries"),
    (lambda s: s.tr.lora is not None and s.tr.lora.quant is not None,
     lambda s: f"quant {s.tr.lora.quant if s.tr.lora else ''}: read from source, not traced (gptqmodel's kernels "
               "need CUDA): the packed layout of gptqmodel's QuantLinear, and its torch training kernel's "
               "dequantized 16-bit weight saved per linear for backward (gptqmodel nn_modules/qlinear/torch.py, "
               "torch_awq.py; docs/techniques.md)"),
    (lambda s: s.changed("galore_rank") and s.opt.step != "galore",
     lambda s: f"galore_rank {s.tr.galore_rank} has no effect with {s.opt.name}: it is GaLore's projection rank "
               "(optimizer galore-adamw)"),
    (lambda s: s.tr.offload_optimizer and s.opt.state == "none" and not s.tr.master_weights,
     lambda s: f"offload_optimizer has no effect with {s.opt.name}: it has no optimizer state"),
    (lambda s: s.lora_without_qlora("quant_block"),
     lambda s: "lora quant_block has no effect without qlora: the base is not quantised"),
    (lambda s: s.lora_without_qlora("double_quant"),
     lambda s: "lora double_quant has no effect without qlora: the base is not quantised"),
    (lambda s: s.lora_without_qlora("bnb_saves_input"),
     lambda s: "lora bnb_saves_input has no effect without qlora: the base is not quantised"),
    (lambda s: s.tr.lora is not None and s.tr.lora.dtype is not None and s.tr.weight_dtype == DType.fp32,
     lambda s: f"lora dtype {s.tr.lora.dtype} has no effect with precision {s.tr.precision}: the weights are fp32, "
               "so are the adapters"),
    # QLoRA under PEFT's recipe (profiles.FRAMEWORKS hf): what the profile's qlora_fp32_cast means for this run
    (lambda s: s.tr.lora is not None and s.tr.lora.qlora and s.profile.qlora_fp32_cast,
     lambda s: "QLoRA: PEFT's prepare_model_for_kbit_training makes the embedding, norms and head fp32, so the "
               "residual stream runs in fp32 and each 4-bit linear casts its input to bf16 and its output back "
               + ("(under autocast, as Trainer's bf16=True runs it)" if s.tr.is_amp else
                  "(without autocast attention runs in fp32 too: Trainer's bf16=True autocasts, --precision "
                  "amp-bf16)")
               + "; TRL >= 0.20 does not call it (--framework trl; or profile qlora_fp32_cast: false)"),
    (lambda s: s.profile.kernels != "liger" and s.profile.liger_ops != _LIGER_DEFAULT,
     lambda s: f"liger_ops {', '.join(s.profile.liger_ops)} has no effect without --kernels liger"),
    (lambda s: s.profile.cross_entropy == "full" and s.profile.loss_chunks != DEFAULT_LOSS_CHUNKS,
     lambda s: f"loss_chunks {s.profile.loss_chunks} has no effect with the full cross-entropy "
               "(--loss chunked uses it)"),
    (lambda s: s.profile.cross_entropy != "trl-fused" and s.profile.loss_tokens != 1.0,
     lambda s: f"loss_tokens {s.profile.loss_tokens:g} has no effect with the {s.profile.cross_entropy} cross-entropy: "
               "it runs on every position, ignored labels included (--framework trl projects only the loss tokens)"),
]


def no_effect_notes(exp: ExperimentSpec) -> list[str]:
    """The options that change nothing in this setup, one line each (:data:`NO_EFFECT`)."""
    s = _Setup(exp.training, exp.model, exp.profile, OPTIMIZERS[exp.training.optimizer])
    return [note(s) for when, note in NO_EFFECT if when(s)]


def _host_extra(exp: ExperimentSpec, trainable: int) -> dict[str, int]:
    """The host memory entries of ``Estimate.extra``: offloaded optimizer state (DeepSpeed / plain), FSDP2's
    CPUOffloadPolicy shards, DeepSpeed ZeRO-3's offloaded parameter partitions."""
    tr = exp.training
    return {**({"host_optimizer_bytes": host_optimizer_bytes(exp, trainable)}
               if tr.offload_optimizer and not fsdp_active(tr) else {}),
            **({"host_offload_bytes": host_offload_bytes(exp)} if tr.offload_optimizer and fsdp_active(tr) else {}),
            **({"host_param_bytes": _host_param_bytes(exp)} if offload_param(exp) else {})}


def _host_param_bytes(exp: ExperimentSpec) -> int:
    """DeepSpeed ZeRO-3 ``offload_param``'s pinned host partitions (memcalc.engine.deepspeed.host_param_bytes)."""
    from memcalc.engine.deepspeed import host_param_bytes
    from memcalc.engine.params import param_inventory
    from memcalc.engine.tensor_parallel import local_experiment

    return host_param_bytes(exp, [p.numel for p in param_inventory(local_experiment(exp).model, exp.training.lora)])


def host_optimizer_bytes(exp: ExperimentSpec, trainable_params: int) -> int:
    """Bytes of host (CPU) memory that ``offload_optimizer`` moves off each GPU: the optimizer
    state and fp32 master weights of the trainable parameters, at the registry's bytes per
    parameter (``bytes_per_param``), divided over the ranks under ZeRO >= 1 (DeepSpeed's
    ZeRO-Offload keeps each rank's partition on the host: Ren et al. 2021, section 4.1). 0
    without offload. Ignores pinned staging buffers and the host copy of the gradients."""
    tr = exp.training
    if not tr.offload_optimizer:
        return 0
    bpp = bytes_per_param(exp)
    total = math.ceil(trainable_params * (bpp["optimizer_state"] + bpp["master_weights"]))
    div = tr.gpus if tr.zero >= 1 else 1
    return -(-total // div)


def replay_allocator(events: list[tuple[int, int]], step_start: int, warm: bool,
                     capacity: Optional[int] = None, stop_above: Optional[int] = None) -> tuple[int, int]:
    """Replay the simulated allocations through the CUDA caching allocator model
    (``memcalc.core.allocator``): its ``max_memory_allocated`` (whole blocks, so at least the sum of
    live tensors) and ``max_memory_reserved`` (cudaMalloc segments). Setup allocations
    (weights, optimizer state) run once; with ``warm`` the step runs twice and the second,
    which starts from the cache the first left (a steady-state step), is measured. With ``capacity``
    (the bytes the allocator may reserve on a card), (-1, -1) when a segment does not fit even after the
    cached ones are released (``CachingAllocatorSim.out_of_memory``: torch's OutOfMemoryError).
    ``stop_above`` (without ``capacity``): raise :class:`memcalc.engine.observers.PeakAbove` as soon as
    the allocator reserves more than that: without a capacity no segment is ever released, so reserved
    only grows, and the reserved peak this returns (the measured run's) is at least what was reserved at
    any point of the replay."""
    alloc = CachingAllocatorSim(capacity)
    limit = math.inf if stop_above is None else stop_above
    blocks: dict = {}  # id -> its block (memcalc.core.allocator._Block)

    malloc, free, pop = alloc.malloc, alloc.free, blocks.pop

    def run(evs: list[tuple[int, int]]) -> None:
        for uid, n in evs:
            if n:
                blocks[uid] = malloc(n)
                if alloc.out_of_memory:
                    return
                if alloc.reserved > limit:
                    raise PeakAbove(alloc.reserved, 0)
            else:
                free(pop(uid))

    run(events[:step_start])
    step = events[step_start:]
    if warm:
        before = {uid: b.size for uid, b in blocks.items()}
        run(step)
        # what the first step leaves alive (allocated in it, never freed in it) is its own: the steady step
        # the timeline simulates starts from the setup's tensors alone, so the second run starts from them
        # too, with the cache (the free blocks and segments) the first run left; a set-up tensor the step
        # replaced (a pipeline receive buffer at a V's turn: memcalc.engine.pipeline_zb.pass_back) is the
        # first step's tensor of its size that took its place
        left = [u for u in blocks if u not in before]
        for uid in [u for u in before if u not in blocks]:
            size = before[uid]
            took = next(u for u in left if blocks[u].size == size)
            left.remove(took)
            blocks[uid] = blocks.pop(took)
        for uid in left:
            alloc.free(blocks.pop(uid))
    alloc.reset_peak()
    run(step)
    return (-1, -1) if alloc.out_of_memory else (alloc.peak_allocated, alloc.peak_reserved)


def setup_cache_events(exp: ExperimentSpec) -> list[tuple[int, int]]:
    """The allocator events of the model's set-up that the step's replay starts from: torchtune's QLoRA
    build and ``load_state_dict`` (:func:`memcalc.engine.loading.load_phase`: each weight made in 16 bits
    and quantized on the GPU, twice), then every block it still holds freed, so that the step's own
    set-up allocations (the same weights) take their place in the segments the load left. torchtune's
    recipes never release that cache: ``_setup_model`` ends with ``training.get_memory_stats`` (its
    ``reset_peak_memory_stats``) and no ``torch.cuda.empty_cache`` (recipes/lora_finetune_single_device.py
    at v0.6.1, l.422-492; the same at 0914d5c, 2024-04-15), so ``max_memory_reserved`` in training is at
    least what the load reserved. Empty for other frameworks and without QLoRA (a load that writes each
    weight once reserves what the step's weights do)."""
    tr = exp.training
    if exp.profile.framework != "torchtune" or tr.lora is None or not tr.lora.qlora:
        return []
    ld = load_phase(exp, events=True)
    evs = list(ld.events or [])
    return evs + [(uid, 0) for uid, _n in ld._held.values()]


def runs_within(est: Estimate, allocator_bytes: int) -> Optional[bool]:
    """Whether the step's allocations run with at most ``allocator_bytes`` reserved, the caching
    allocator releasing its cached segments before it gives up (c10/cuda/CUDACachingAllocator.cpp
    ``release_cached_blocks`` then retry, before OutOfMemoryError): the steady and the first step
    replayed with that capacity. None without the replay's events (``estimate(replay=False)``)."""
    if not est.replays:
        return None
    return all(replay_allocator(ev, start, warm, allocator_bytes)[0] >= 0 for ev, start, warm in est.replays)


def _replayed(steady, first, exp: ExperimentSpec, stop_above: Optional[int] = None) -> tuple[tuple, int, int]:
    """The steady step (warm: run twice, the second measured) and the first step replayed through the
    caching allocator: their inputs (:attr:`Estimate.replays`) and the higher allocated and reserved peaks.
    Each starts from the cache the model's set-up leaves (:func:`setup_cache_events`). ``stop_above``:
    :class:`memcalc.engine.observers.PeakAbove` as soon as either reserves more (:func:`replay_allocator`)."""
    pre = setup_cache_events(exp)
    replays = ((pre + (steady.events or []), len(pre) + steady.step_start, True),
               (pre + (first.events or []), len(pre) + first.step_start, False))
    (a_steady, r_steady), (a_first, r_first) = (replay_allocator(*r, stop_above=stop_above) for r in replays)
    return replays, max(a_steady, a_first), max(r_steady, r_first)


def _by_kind(split: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """The peak by kind (in KINDS' order) and, within each, by component (largest first)."""
    return {k: dict(sorted(split[k].items(), key=lambda kv: -kv[1])) for k in KINDS if k in split}


def replayed_device_total(exp: ExperimentSpec, steady: SimResult, side: Optional[GpuSide] = None,
                          stop_above: Optional[int] = None) -> int:
    """``estimate(exp, replay=True, side=side, stop_above=stop_above).device_total_bytes`` from its steady step
    (``stop_above`` checked by the caller; one derived by :func:`memcalc.engine.twins.fused_events_of`: only
    its events are read), as :func:`estimate` works it out (:func:`memcalc.plan.simulations.device_total`)."""
    _, step_alloc, step_reserved = _replayed(steady, first_step(exp, steady, True, stop_above), exp, stop_above)
    return device_memory(step_alloc, step_reserved, step_side(exp, side)).device_total_bytes


def estimate(exp: ExperimentSpec, timeline: bool = True, replay: bool | None = None,
             side: Optional[GpuSide] = None, flops: bool = True, stop_above: Optional[int] = None) -> Estimate:
    """Predict the allocated peak of one training step of ``exp`` (see module docstring).

    ``replay`` (default: as ``timeline``) also replays the caching allocator over the steady
    step and the first step, for the step's own allocated and reserved peaks; the device totals
    are for ``side``'s card (default: the reference card, :func:`step_side`). Without ``flops`` the
    FLOPs that checkpointing recomputes (``extra["recompute"]``, a graph of the forward) are not
    counted: a caller that needs the bytes alone (estimate's "to make it fit"). ``stop_above``: raise
    :class:`memcalc.engine.observers.PeakAbove` as soon as a simulated step's running total, or with
    ``replay`` the bytes its allocator replay reserves, passes this many bytes (a caller that only asks
    whether the step fits a card: :func:`largest_peak_within`; the device total is the reserved peak plus
    :func:`memcalc.core.gpu_side.overhead_bytes`, so a step that reserves more does not fit)."""
    replay = timeline if replay is None else replay
    steady = steady_step(exp, timeline, stop_above)
    first = first_step(exp, steady, replay, stop_above)
    alloc_extra: dict = {}
    replays, step_alloc, step_reserved = _replayed(steady, first, exp, stop_above) if replay else ((), None, None)
    techniques = technique_extra(steady, first)  # offloaded activations' host bytes, paged state
    alloc_extra.update(techniques)
    if steady.stages is not None:  # pipeline parallelism: every rank's stage and peak (memcalc.engine.pipeline)
        from memcalc.engine.pipeline import pipeline_extra

        alloc_extra["pipeline"] = pipeline_extra(exp, steady.stages)
    load = load_phase(exp)  # before the step (memcalc.engine.loading): QLoRA quantizes while it loads
    alloc_extra.update({"load_peak_bytes": load.peak_bytes, "load_peak_label": load.peak_label})
    assert first.peak_bytes <= steady.peak_bytes or not first_step_within_steady(exp), (
        f"{exp.name}: first step {first.peak_bytes} > steady step {steady.peak_bytes} bytes "
        "(memcalc.engine.timeline.first_step_within_steady does not hold)")
    top = steady if steady.peak_bytes >= first.peak_bytes else first
    which = "steady state" if top is steady else "first step"
    counts = count_params(exp.model, exp.training.lora)
    peak = top.peak_bytes
    kinds = {k: top.peak_kinds.get(k, 0) for k in KINDS}
    gside = step_side(exp, side)
    dev = device_memory(peak if step_alloc is None else step_alloc, step_reserved, gside)
    # torch.cuda.max_memory_allocated over the whole process (no reset_peak_memory_stats after set-up): the
    # load has run no matmul yet (no cuBLAS workspace), so its peak is the load phase's own
    alloc_extra["run_peak_bytes"] = max(dev.allocated_peak_bytes, load.peak_bytes)
    assumptions = [
        f"device total on {gside.device}: " + "; ".join(gside.sources),
        ("reserved: the caching-allocator replay of the step (c10/cuda/CUDACachingAllocator.cpp: 512-byte blocks, "
         "small pool up to 1 MiB in 2 MiB segments, 20 MiB segments under 10 MiB, larger rounded to 2 MiB; no "
         "expandable segments), the workspaces in segments of their own" if step_reserved is not None else
         "reserved taken as allocated (no allocator replay), the workspaces in segments of their own"),
        f"not in the device total: {NOT_MODELLED}",
        f"kernel profile {exp.profile.name}: PyTorch {exp.profile.torch_version} on {exp.profile.device}, "
        f"RMSNorm {exp.profile.rmsnorm}, attention {exp.profile.attention}",
        f"every allocation rounded up to {exp.profile.allocator_round_bytes} bytes, as the CUDA caching allocator does",
    ]
    prof = exp.profile
    if prof.cross_entropy == "chunked":
        assumptions.append(
            f"cross-entropy in {prof.loss_chunks} chunks of the logits rows (torchtune CEWithChunkedOutputLoss): "
            "each chunk's fp32 copy lives only for its own loss; every chunk's log-probabilities stay "
            "saved for backward, whose gradients are concatenated back to full size")
    if prof.cross_entropy == "trl-fused":
        assumptions.append(
            f"TRL's fused LM head (add_fused_lm_head, ChunkedLogProbFunction, trl 1.16): no logits tensor; the head "
            f"runs in tiles of 4096 tokens x 32768 vocabulary columns on the {prof.loss_tokens:.0%} of positions whose "
            "label is not -100 (--loss-tokens)")
    compiled = None
    tr = exp.training
    if tr.compile_partitions:
        from memcalc.compile.compiled import compiled_plan

        plan = compiled_plan(exp)
        compiled = {
            "memory_budget": plan.budget,
            "decided_by": plan.how,
            "saved_bytes": plan.saved_bytes,
            "default_saved_bytes": plan.default_saved_bytes,
            "recomputed_in_backward_bytes": sum(plan.held.values()),
            "recompute_flops": plan.recompute_flops,
            "forward_flops": plan.forward_flops,
        }
        assumptions.append(
            "torch.compile: one graph from the embedding to the "
            + ("loss" if tr.compile_scope == "model" else "logits (the loss eager after it)")
            + "; the saved set is AOTAutograd's min-cut partition at the memory budget; the backward "
            "recomputes the forward chain first and keeps what later layers read; all gradients "
            "leave the compiled backward together" if tr.compile_scope != "layer" else
            "torch.compile per layer (compile_scope layer): each decoder layer one graph, its saved set "
            "AOTAutograd's min-cut partition of that layer at the memory budget (its backward keeps nothing "
            "for another layer's); the embedding, the final norm and the head eager")
    recompute = None
    if compiled:
        recompute = {"flops": compiled["recompute_flops"], "forward_flops": compiled["forward_flops"],
                     "by": f"torch.compile, memory budget {compiled['memory_budget']:g}"}
    elif tr.checkpoint != "none" and flops:
        from memcalc.compile.graph import checkpoint_recompute_flops

        rf, ff = checkpoint_recompute_flops(exp)
        recompute = {"flops": rf, "forward_flops": ff, "by": f"activation checkpointing {tr.checkpoint}"}
    assumptions += technique_assumptions(exp, steady)
    if prof.framework == "unsloth":  # Unsloth's step is not traced: say which numbers are read, which traced
        from memcalc.core.unsloth import provenance

        prov = provenance(exp)
        alloc_extra["provenance"] = prov
        assumptions += [prov["note"], *(f"{m['mechanism']}: {m['how']} from source, {m['rule']}"
                                         for m in prov["mechanisms"])]
    if tr.compile and not compiled:
        assumptions.append(
            f"torch.compile with checkpointing ({tr.checkpoint}): checkpointed regions are recomputed "
            "whole, as in eager mode" + ("; gradients leave the compiled backward together"
                                         if tr.compile_scope != "layer" else
                                         " (each layer compiled inside its checkpoint, the head eager)"))
    return Estimate(
        experiment=exp,
        params=counts.total,
        trainable_params=counts.trainable,
        peak_bytes=peak,
        peak_phase=top.peak_phase,
        peak_label=f"{top.peak_label} ({which})",
        components=dict(sorted(top.peak_categories.items(), key=lambda kv: -kv[1])),
        components_by_kind=kinds,
        by_kind=_by_kind(top.peak_by_kind),
        phases=dict(steady.phases),
        first_step_peak_bytes=first.peak_bytes,
        first_step_peak_phase=first.peak_phase,
        timeline=steady.timeline,
        bytes_per_param=bytes_per_param(exp),
        cuda_context_bytes=gside.cuda_context_bytes,
        step_allocated_bytes=peak if step_alloc is None else step_alloc,
        step_reserved_bytes=step_reserved,
        allocated_peak_bytes=dev.allocated_peak_bytes,
        reserved_peak_bytes=dev.reserved_peak_bytes,
        device_total_bytes=dev.device_total_bytes,
        device_parts=dev.parts,
        device=dev.device,
        replays=replays,
        assumptions=assumptions,
        notes=no_effect_notes(exp) + family_notes(exp) + technique_notes(techniques)
        + list(filter(None, [gpus_note(exp.training)])),
        extra={"max_activation_bytes": steady.max_activation_bytes, "steady_peak_bytes": steady.peak_bytes, "first_step_peak_bytes": first.peak_bytes, "peak_step": which,
               **alloc_extra, **({"compiled": compiled} if compiled else {}),
               **_host_extra(exp, counts.trainable),
               **({"recompute": recompute} if recompute else {})},
    )


__all__ = ["estimate", "largest_peak_within", "required_bytes", "step_side", "card_side", "Estimate", "DType"]
