"""Optimizer state and the optimizer step's temporaries, per optimizer and implementation.

State sizes follow each optimizer's ``_init_group``/``_init_state``; temporaries
follow the step's code (torch/optim/adamw.py ``_multi_tensor_adamw`` /
``_single_tensor_adamw`` / fused kernel; Forgather's ``_adafactor``;
bitsandbytes' 8-bit blockwise Adam; lion-pytorch's ``update_fn``). The step
counter (a scalar) and scalar hyper-parameters are ignored. Which layout and step an
optimizer has is its record in :mod:`memcalc.core.optimizers`; the functions here are
keyed by those kinds (``STATE_LAYOUTS``, ``STEP_KINDS``), never by optimizer name.
"""

from __future__ import annotations

from typing import Callable, Optional, get_args

from memcalc.core.dtypes import DType
from memcalc.core.optimizers import (BNB_BLOCK, BNB_MIN_8BIT_SIZE, BNB_PAGED_MIN_NUMEL, OPTIMIZERS, TORCHAO,
                                     TORCHAO_PLAIN_TEMP_PER_ELEM, StateLayout, StepKind, galore_target,
                                     torchao_quantized)
from memcalc.engine.galore import galore_state, galore_step
from memcalc.core.expert_parallel import expert_divisors
from memcalc.engine.sharding import shard
from memcalc.engine.sim import Param, Sim, T
from memcalc.core.spec import TrainingSpec

STATE = "optimizer_state"
TMP = "temporaries"


def state_dtype(tr: TrainingSpec) -> DType:
    """torch.optim keeps state like the parameter (``zeros_like(p)``); with master weights the
    moments are fp32 (the ZeRO-paper 16 bytes/param layout)."""
    return DType.fp32 if tr.master_weights else tr.weight_dtype


def for_param(p: Param, tr: TrainingSpec) -> TrainingSpec:
    """The training setup as it applies to one parameter: an fp32 parameter under a 16-bit policy
    (LoRA adapters kept in fp32 over a 16-bit base, PEFT's default) steps as under fp32: its state
    (``zeros_like(p)``) and step temporaries are fp32."""
    if p.weight.itemsize_bits == 32 and tr.weight_dtype != DType.fp32 and not tr.master_weights:
        return tr.model_copy(update={"precision": "fp32"})
    return tr


def state_bytes(p: Param, shape_rows: int, tr: TrainingSpec) -> list[tuple[str, int]]:
    """State tensors of one trainable parameter, as (category, bytes): the master copy (fp32)
    with master weights, then the optimizer's state by its registry layout (``STATE_LAYOUTS``)."""
    tr = for_param(p, tr)
    out: list[tuple[str, int]] = []
    if tr.master_weights:
        out.append(("master weights", DType.fp32.nbytes(p.numel)))
    rec = OPTIMIZERS[tr.optimizer]
    if rec.paged:
        return out + _paged_state(p.numel, rec.state, rec.moments)
    out += [("optimizer state", b) for b in STATE_LAYOUTS[rec.state](p.numel, shape_rows, rec.moments, tr)]
    return out


#: the category of state bytes in CUDA unified memory (not allocated through the caching allocator)
PAGED = "paged optimizer state"


def _paged_state(n: int, layout: str, moments: int) -> list[tuple[str, int]]:
    """bitsandbytes paged Adam state of one parameter (bitsandbytes/optim/optimizer.py
    ``Optimizer2State.init_state``): ``state1``/``state2`` from ``get_state_buffer`` -- paged
    (cudaMallocManaged, category :data:`PAGED`) for parameters of at least ``BNB_PAGED_MIN_NUMEL``
    elements, an ordinary device tensor below; fp32 for 32-bit state and for tensors under
    ``min_8bit_size``, else uint8 plus an fp32 ``absmax`` per 256-element block (``torch.zeros`` on
    the device: never paged). Ignored: the shared 256-entry quantisation maps."""
    cat = PAGED if n >= BNB_PAGED_MIN_NUMEL else "optimizer state"
    if layout == "fp32" or n < BNB_MIN_8BIT_SIZE:
        return [(cat, 4 * n)] * moments
    return [(cat, n)] * moments + [("optimizer state", 4 * -(-n // BNB_BLOCK))] * moments


def _no_state(n: int, rows: int, moments: int, tr: TrainingSpec) -> list[int]:
    """SGD without momentum: no state."""
    return []


def _like_param(n: int, rows: int, moments: int, tr: TrainingSpec) -> list[int]:
    """``moments`` tensors shaped like the parameter (``zeros_like(p)``) in the state dtype."""
    return [state_dtype(tr).nbytes(n)] * moments


def _factored(n: int, rows: int, moments: int, tr: TrainingSpec) -> list[int]:
    """Adafactor's factored second moment in the parameter's dtype: a row and a column vector
    for matrices, a full vector otherwise (Forgather ``_init_state``)."""
    cols = n // rows if rows else 0
    if rows and cols > 1 and rows > 1:
        return [tr.weight_dtype.nbytes(rows), tr.weight_dtype.nbytes(cols)]
    return [tr.weight_dtype.nbytes(n)]


def _blockwise_8bit(n: int, rows: int, moments: int, tr: TrainingSpec) -> list[int]:
    """bitsandbytes: uint8 moments plus an fp32 absmax per block; small tensors
    (below ``min_8bit_size``) keep fp32 moments."""
    if n < BNB_MIN_8BIT_SIZE:
        return [4 * n] * moments
    return [n + 4 * -(-n // BNB_BLOCK)] * moments


#: state layout (``OptimizerRecord.state``) -> bytes of each state tensor of one parameter
def _fp32(n: int, rows: int, moments: int, tr: TrainingSpec) -> list[int]:
    """bitsandbytes 32-bit state (``optim_bits=32``): fp32 moments whatever the parameter's dtype."""
    return [4 * n] * moments


def _torchao(layout: str) -> Callable[[int, int, int, TrainingSpec], list[int]]:
    """torchao low-bit state (torchao 0.14.1 adam.py ``_AdamBase._new_buffer``): per moment, for a quantized
    parameter (:func:`memcalc.core.optimizers.torchao_quantized`) the subclass's own tensors as
    ``OptimState{4bit,8bit,Fp8}.zeros`` allocates them (codes, one fp32 ``scale`` per block, the ``qmap``
    table: each its own allocation), else ``torch.zeros_like(p)`` in the parameter's dtype."""
    ao = TORCHAO[layout]

    def state(n: int, rows: int, moments: int, tr: TrainingSpec) -> list[int]:
        if not torchao_quantized(n, layout):
            return [state_dtype(tr).nbytes(n)] * moments
        one = [int(n * ao.code_bytes), 4 * (n // ao.block)] + ([ao.qmap_bytes] if ao.qmap_bytes else [])
        return one * moments
    return state


STATE_LAYOUTS: dict[str, Callable[[int, int, int, TrainingSpec], list[int]]] = {
    "none": _no_state, "like_param": _like_param, "factored": _factored, "blockwise_8bit": _blockwise_8bit,
    "fp32": _fp32, **{k: _torchao(k) for k in TORCHAO},
}


def per_param_temps(p: Param, shape_rows: int, tr: TrainingSpec) -> list[tuple[str, int]]:
    """The step's temporaries for one parameter as a sequence of events:
    ("alloc", bytes) or ("free", index of the alloc). Used by per-parameter steps
    (for-loop implementations and a step fused into backward)."""
    tr = for_param(p, tr)
    ev: list[tuple[str, int]] = []
    if tr.master_weights:
        ev.append(("alloc", 4 * p.numel))  # grad.float() for the fp32 master step
    STEP_KINDS[OPTIMIZERS[tr.optimizer].step](ev, p.numel, shape_rows, tr)
    return ev


def _no_temps(ev: list[tuple[str, int]], n: int, rows: int, tr: TrainingSpec) -> None:
    """SGD (no weight decay) and bitsandbytes' one in-place kernel: no temporaries."""


def _adam_temps(ev: list[tuple[str, int]], n: int, rows: int, tr: TrainingSpec) -> None:
    """Adam/AdamW on one tensor, by implementation."""
    sdt = state_dtype(tr)
    impl = OPTIMIZERS[tr.optimizer].effective_impl(tr.optimizer_impl)
    if impl == "fused" or (tr.master_weights and impl == "foreach"):
        pass  # one fused multi-tensor kernel (torch fused=True; DeepSpeed/apex FusedAdam on masters)
    elif impl == "foreach":
        # _multi_tensor_adam on this one tensor: _foreach_sqrt makes a copy, then div_/add_ in place
        ev.append(("alloc", sdt.nbytes(n)))
    else:  # _single_tensor_adam: denom = (exp_avg_sq.sqrt() / bc2).add_(eps): two, then one
        i = len(ev)
        ev += [("alloc", sdt.nbytes(n)), ("alloc", sdt.nbytes(n)), ("free", i)]


def _lion_temps(ev: list[tuple[str, int]], n: int, rows: int, tr: TrainingSpec) -> None:
    """lion-pytorch ``update_fn``: update = exp_avg.clone().lerp_(grad).sign_()."""
    ev.append(("alloc", state_dtype(tr).nbytes(n)))


def _adafactor_temps(ev: list[tuple[str, int]], n: int, rows: int, tr: TrainingSpec) -> None:
    """Forgather _adafactor: grad32 = grad.float(); update = grad32**2 + eps1;
    update = grad32 * outer(rsqrt(r), rsqrt(c)); rms(update); 16-bit params:
    update = p.float() - lr * update."""
    wdt = tr.weight_dtype
    if wdt != DType.fp32:
        ev.append(("alloc", 4 * n))  # grad32
    i_pow = len(ev)
    ev.append(("alloc", 4 * n))
    i_upd = len(ev)
    ev += [("alloc", 4 * n), ("free", i_pow)]
    i_first = len(ev)  # outer(rsqrt(r), rsqrt(c)) for matrices, r32.sqrt() for vectors: n fp32 either way
    ev.append(("alloc", 4 * n))
    ev += [("alloc", 4 * n), ("free", i_first), ("free", i_upd)]  # the new update; the old one dies
    i_sq = len(ev)
    ev += [("alloc", 4 * n), ("free", i_sq)]  # rms: update.square()
    if wdt != DType.fp32:
        i_pf = len(ev)
        ev.append(("alloc", 4 * n))
        i_lr = len(ev)
        ev.append(("alloc", 4 * n))
        ev += [("alloc", 4 * n), ("free", i_pf), ("free", i_lr)]


def _torchao_temps(ev: list[tuple[str, int]], n: int, rows: int, tr: TrainingSpec) -> None:
    """torchao's ``single_param_adam`` on one parameter (adam.py, compiled per parameter): its peak, as
    :attr:`memcalc.core.optimizers.TorchaoLowBit.temp_per_elem` (quantized state) or
    ``TORCHAO_PLAIN_TEMP_PER_ELEM`` by the parameter's width (``zeros_like`` state), alive at once and
    freed when the parameter's step returns."""
    layout = OPTIMIZERS[tr.optimizer].state
    if torchao_quantized(n, layout):
        ao = TORCHAO[layout]
        b = int(ao.temp_per_elem * n) + ao.temp_const
    else:
        b = TORCHAO_PLAIN_TEMP_PER_ELEM[state_dtype(tr).bits // 8] * n
    i = len(ev)
    ev += [("alloc", b), ("free", i)]


#: step kind (``OptimizerRecord.step``) -> appends one parameter's step events
STEP_KINDS: dict[str, Callable[[list[tuple[str, int]], int, int, TrainingSpec], None]] = {
    "none": _no_temps, "adam": _adam_temps, "lion": _lion_temps, "adafactor": _adafactor_temps,
    "torchao": _torchao_temps,
    "galore": _no_temps,  # its own loop: memcalc.engine.galore (OptimizerSim.step_all / step_param)
}

assert set(STATE_LAYOUTS) == set(get_args(StateLayout)), "a state layout without a simulation"
assert set(STEP_KINDS) == set(get_args(StepKind)), "a step kind without a simulation"


def foreach_temps(trainable: list[Param], tr: TrainingSpec) -> int:
    """The whole-group temporary of a foreach step: ``_foreach_sqrt(exp_avg_sqs)`` for Adam/AdamW
    (one state-sized copy of every tensor at once); none for SGD(-momentum) without weight decay."""
    return sum(foreach_temp_sizes(trainable, tr))


def foreach_temp_sizes(trainable: list[Param], tr: TrainingSpec) -> list[int]:
    """:func:`foreach_temps` tensor by tensor: ``_foreach_sqrt`` returns one new tensor per state tensor
    (torch/optim/adam.py ``_multi_tensor_adam``: ``exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)``,
    then ``_foreach_div_`` / ``_foreach_add_`` in place), each its own caching-allocator request."""
    if OPTIMIZERS[tr.optimizer].step == "adam" and tr.optimizer_impl == "foreach":
        dtypes: dict[int, DType] = {}  # for_param depends on the parameter only through its width
        sizes = []
        for p in trainable:
            bits = p.weight.itemsize_bits
            dt = dtypes.get(bits)
            if dt is None:
                dt = dtypes[bits] = state_dtype(for_param(p, tr))
            sizes.append(dt.nbytes(p.numel))
        return sizes
    return []


def uses_foreach(tr: TrainingSpec) -> bool:
    """foreach applies to torch.optim's Adam/AdamW/SGD (the registry's ``has_foreach``); the
    others, and master-weight steps (which cast each gradient to fp32 for its master), step per
    parameter."""
    return tr.optimizer_impl == "foreach" and not tr.master_weights and OPTIMIZERS[tr.optimizer].has_foreach


class OptimizerSim:
    """Creates state and runs step temporaries on the simulator."""

    def __init__(self, sim: Sim, tr: TrainingSpec, params: list[Param], rows_of: dict[str, int]) -> None:
        self.sim = sim
        self.tr = tr
        self.params = [p for p in params if p.trainable]
        self.rows_of = rows_of
        self.state: dict[str, list[T]] = {}
        # ZeRO-1+ shards state (and so the step's work) over the ranks; offload moves both to the CPU
        self.div = tr.gpus if tr.zero >= 1 else 1
        # expert parallelism: the routed experts' state is sharded over gpus / ep (engine.expert_parallel)
        self.div_of: dict[str, int] = expert_divisors(tr, self.params, self.div)
        self.on_gpu = not tr.offload_optimizer
        self.paged_bytes = 0  # bitsandbytes paged state: unified memory, outside the allocator (PAGED)
        # state_bytes / per_param_temps depend on the parameter only through its size, rows and
        # width: computed once per (numel, rows, bits) -- a deep stack repeats a few shapes
        self._states: dict[tuple[int, int, int], list[tuple[str, int]]] = {}
        self._temps: dict[tuple[int, int, int], list[tuple[str, int]]] = {}
        # when a list (a steady-state step recording its events): (index into the simulator's events,
        # the state blocks) where a first step would create each parameter's state, i.e. the first
        # create_state call for it inside the step (memcalc.engine.twins.first_step_of)
        self.created_at: Optional[list[tuple[int, list[T]]]] = None
        self.events: list[tuple[int, int]] = []  # with created_at: the step's events (observers.AllocEvents)
        self._created: set[str] = set()
        #: GaLore: the projected weights, name -> (rows, columns) (memcalc.engine.galore); None otherwise
        self.galore: Optional[dict[str, tuple[int, int]]] = None
        if OPTIMIZERS[tr.optimizer].step == "galore":
            shapes = {p.name: (rows_of[p.name], p.numel // rows_of[p.name]) for p in self.params if rows_of.get(p.name)}
            self.galore = {name: mn for name, mn in shapes.items() if galore_target(name, mn)}

    def _by_shape(self, cache: dict, fn: Callable[[Param, int, TrainingSpec], list[tuple[str, int]]],
                  p: Param) -> list[tuple[str, int]]:
        rows = self.rows_of[p.name]
        key = (p.numel, rows, p.weight.itemsize_bits)
        got = cache.get(key)
        if got is None:
            got = cache[key] = fn(p, rows, self.tr)
        return got

    def _state_of(self, p: Param) -> list[tuple[str, int]]:
        if self.galore is not None and p.name in self.galore:
            m, n = self.galore[p.name]
            rank, width = self.tr.galore_rank, p.weight.itemsize_bits // 8
            return [("optimizer state", b) for b in galore_state(m, n, rank, width)]
        return self._by_shape(self._states, state_bytes, p)

    def _temps_of(self, p: Param) -> list[tuple[str, int]]:
        return self._by_shape(self._temps, per_param_temps, p)

    def create_state(self, p: Param) -> None:
        if p.name in self.state:
            if self.created_at is not None and p.name not in self._created:
                self._created.add(p.name)
                self.created_at.append((len(self.events), self.state[p.name]))
            return
        if not self.on_gpu:
            self.state[p.name] = []
            return
        st = self._state_of(p)
        div = self.div_of.get(p.name, self.div)
        alloc = self.sim.alloc
        out = []
        for cat, b in st:
            if cat == PAGED:
                self.paged_bytes += shard(b, div)
            else:
                out.append(alloc(shard(b, div), STATE, cat, False, p.name))
        self.state[p.name] = out

    def create_all(self) -> None:
        """:meth:`create_state` for every parameter in order, the allocations made in one run
        (:meth:`Sim.alloc_many`: nothing is freed in between)."""
        if not self.on_gpu:
            for p in self.params:
                self.create_state(p)
            return
        div = self.div
        rows: list[tuple[int, str, str, int, int]] = []
        counts: list[tuple[Param, int]] = []
        seen: set[str] = set()
        for p in self.params:
            if p.name in self.state or p.name in seen:  # create_state makes a name's state once
                continue
            seen.add(p.name)
            k = 0
            div = self.div_of.get(p.name, self.div)
            for cat, b in self._state_of(p):
                if cat == PAGED:
                    self.paged_bytes += shard(b, div)
                else:
                    rows.append((shard(b, div), cat, p.name, 0, 32))
                    k += 1
            counts.append((p, k))
        blocks = self.sim.alloc_many(STATE, rows)
        i = 0
        for p, k in counts:
            self.state[p.name] = blocks[i:i + k]
            i += k

    def run_events(self, events: list[tuple[str, int]], div: Optional[int] = None) -> None:
        if not self.on_gpu:
            return
        live: dict[int, T] = {}
        for i, (what, val) in enumerate(events):
            if what == "alloc":
                live[i] = self.sim.alloc(shard(val, div or self.div), TMP, "optimizer-step temporaries")
            else:
                self.sim.unref(live.pop(val))
        for t in live.values():
            self.sim.unref(t)

    def step_param(self, p: Param) -> None:
        """One parameter's step (for-loop implementations, or a step in a backward hook)."""
        if self.galore is not None:
            galore_step(self, self.tr.galore_rank, [p])
            return
        self.create_state(p)
        self.run_events(self._temps_of(p), self.div_of.get(p.name))

    def step_all(self) -> None:
        """optimizer.step() after backward: foreach (all state first, one group temporary) or per parameter."""
        if uses_foreach(self.tr):
            for p in self.params:
                self.create_state(p)
            if not self.on_gpu:
                return
            if self.div == 1 and not self.div_of:  # one request per tensor (foreach_temp_sizes)
                # named apart in the allocation trace: in a first step the state just made (one run
                # of tensors per layer) and these (another run) would be one block of two per-layer
                # runs, which memcalc.plan.depth's extrapolation does not split
                with self.sim.traced_as("optimizer-step temporaries"):
                    held = [self.sim.alloc(n, TMP, "optimizer-step temporaries")
                            for n in foreach_temp_sizes(self.params, self.tr)]
                    for h in held:
                        self.sim.unref(h)
                return
            t = shard(foreach_temps([p for p in self.params if p.name not in self.div_of], self.tr), self.div)
            if self.div_of:  # the experts' copies at their own shard
                t += shard(foreach_temps([p for p in self.params if p.name in self.div_of], self.tr),
                           next(iter(self.div_of.values())))
            if t:
                self.sim.transient(t, TMP, "optimizer-step temporaries")
        elif self.galore is not None:
            galore_step(self, self.tr.galore_rank, self.params)
        else:
            for p in self.params:
                if p.grad is not None:
                    self.step_param(p)
