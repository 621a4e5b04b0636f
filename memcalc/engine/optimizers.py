"""Optimizer state and the optimizer step's temporaries, per optimizer and implementation.

State sizes follow each optimizer's ``_init_group``/``_init_state``; temporaries
follow the step's code (torch/optim/adamw.py ``_multi_tensor_adamw`` /
``_single_tensor_adamw`` / fused kernel; Forgather's ``_adafactor``;
bitsandbytes' 8-bit blockwise Adam; lion-pytorch's ``update_fn``). The step
counter (a scalar) and scalar hyper-parameters are ignored.
"""

from __future__ import annotations

from memcalc.core.dtypes import DType
from memcalc.engine.sharding import shard
from memcalc.engine.sim import Param, Sim, T
from memcalc.core.spec import TrainingSpec

STATE = "optimizer_state"
TMP = "temporaries"


def state_dtype(tr: TrainingSpec) -> DType:
    """torch.optim keeps state like the parameter (``zeros_like(p)``); with master weights the
    moments are fp32 (the ZeRO-paper 16 bytes/param layout)."""
    return DType.fp32 if tr.master_weights else tr.weight_dtype


def state_bytes(p: Param, shape_rows: int, tr: TrainingSpec) -> list[tuple[str, int]]:
    """State tensors of one trainable parameter, as (category, bytes)."""
    n = p.numel
    sdt = state_dtype(tr)
    out: list[tuple[str, int]] = []
    if tr.master_weights:
        out.append(("master weights", DType.fp32.nbytes(n)))
    opt = tr.optimizer
    if opt in ("adam", "adamw"):
        out += [("optimizer state", sdt.nbytes(n))] * 2
    elif opt == "sgd-momentum" or opt == "lion":
        out.append(("optimizer state", sdt.nbytes(n)))
    elif opt == "adafactor":
        # factored second moment: a row and a column vector for matrices, a full vector otherwise
        cols = n // shape_rows if shape_rows else 0
        if shape_rows and cols > 1 and shape_rows > 1:
            out += [("optimizer state", tr.weight_dtype.nbytes(shape_rows)), ("optimizer state", tr.weight_dtype.nbytes(cols))]
        else:
            out.append(("optimizer state", tr.weight_dtype.nbytes(n)))
    elif opt == "adamw-8bit":
        if n < 4096:  # bitsandbytes min_8bit_size: small tensors keep 32-bit state
            out += [("optimizer state", 4 * n)] * 2
        else:
            blocks = -(-n // 256)
            out += [("optimizer state", n + 4 * blocks)] * 2
    return out


def per_param_temps(p: Param, shape_rows: int, tr: TrainingSpec) -> list[tuple[str, int]]:
    """The step's temporaries for one parameter as a sequence of events:
    ("alloc", bytes) or ("free", index of the alloc). Used by per-parameter steps
    (for-loop implementations and a step fused into backward)."""
    n = p.numel
    sdt = state_dtype(tr)
    wdt = tr.weight_dtype
    ev: list[tuple[str, int]] = []
    if tr.master_weights:
        ev.append(("alloc", 4 * n))  # grad.float() for the fp32 master step
    opt = tr.optimizer
    if opt in ("adam", "adamw"):
        if tr.optimizer_impl == "fused" or (tr.master_weights and tr.optimizer_impl == "foreach"):
            pass  # one fused multi-tensor kernel (torch fused=True; DeepSpeed/apex FusedAdam on masters)
        elif tr.optimizer_impl == "foreach":
            # _multi_tensor_adam on this one tensor: _foreach_sqrt makes a copy, then div_/add_ in place
            ev.append(("alloc", sdt.nbytes(n)))
        else:  # _single_tensor_adam: denom = (exp_avg_sq.sqrt() / bc2).add_(eps): two, then one
            i = len(ev)
            ev += [("alloc", sdt.nbytes(n)), ("alloc", sdt.nbytes(n)), ("free", i)]
    elif opt == "lion":
        ev.append(("alloc", sdt.nbytes(n)))  # update = exp_avg.clone().lerp_(grad).sign_()
    elif opt == "adafactor":
        # Forgather _adafactor: grad32 = grad.float(); update = grad32**2 + eps1;
        # update = grad32 * outer(rsqrt(r), rsqrt(c)); rms(update); 16-bit params:
        # update = p.float() - lr * update.
        g32 = None
        if wdt != DType.fp32:
            g32 = len(ev)
            ev.append(("alloc", 4 * n))
        i_pow = len(ev)
        ev.append(("alloc", 4 * n))
        i_upd = len(ev)
        ev += [("alloc", 4 * n), ("free", i_pow)]
        is_matrix = shape_rows > 1 and n // shape_rows > 1
        if is_matrix:
            i_outer = len(ev)
            ev.append(("alloc", 4 * n))
            i_new = len(ev)
            ev += [("alloc", 4 * n), ("free", i_outer), ("free", i_upd)]
        else:
            i_sqrt = len(ev)
            ev.append(("alloc", 4 * n))
            i_new = len(ev)
            ev += [("alloc", 4 * n), ("free", i_sqrt), ("free", i_upd)]
        i_sq = len(ev)
        ev += [("alloc", 4 * n), ("free", i_sq)]  # rms: update.square()
        if wdt != DType.fp32:
            i_pf = len(ev)
            ev.append(("alloc", 4 * n))
            i_lr = len(ev)
            ev.append(("alloc", 4 * n))
            ev += [("alloc", 4 * n), ("free", i_pf), ("free", i_lr)]
        del g32, i_new
    return ev


def foreach_temps(trainable: list[Param], tr: TrainingSpec) -> int:
    """The whole-group temporary of a foreach step: ``_foreach_sqrt(exp_avg_sqs)`` for Adam/AdamW
    (one state-sized copy of every tensor at once); none for SGD(-momentum) without weight decay."""
    if tr.optimizer in ("adam", "adamw") and tr.optimizer_impl == "foreach":
        return sum(state_dtype(tr).nbytes(p.numel) for p in trainable)
    return 0


def uses_foreach(tr: TrainingSpec) -> bool:
    """foreach applies to torch.optim's Adam/AdamW/SGD; the others, and master-weight steps
    (which cast each gradient to fp32 for its master), step per parameter."""
    return (tr.optimizer_impl == "foreach" and not tr.master_weights
            and tr.optimizer in ("adam", "adamw", "sgd", "sgd-momentum"))


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
        self.on_gpu = not tr.offload_optimizer

    def create_state(self, p: Param) -> None:
        if p.name in self.state:
            return
        if not self.on_gpu:
            self.state[p.name] = []
            return
        self.state[p.name] = [self.sim.alloc(shard(b, self.div), STATE, cat)
                              for cat, b in state_bytes(p, self.rows_of[p.name], self.tr)]

    def create_all(self) -> None:
        for p in self.params:
            self.create_state(p)

    def run_events(self, events: list[tuple[str, int]]) -> None:
        if not self.on_gpu:
            return
        live: dict[int, T] = {}
        for i, (what, val) in enumerate(events):
            if what == "alloc":
                live[i] = self.sim.alloc(shard(val, self.div), TMP, "optimizer-step temporaries")
            else:
                self.sim.unref(live.pop(val))
        for t in live.values():
            self.sim.unref(t)

    def step_param(self, p: Param) -> None:
        """One parameter's step (for-loop implementations, or a step in a backward hook)."""
        self.create_state(p)
        self.run_events(per_param_temps(p, self.rows_of[p.name], self.tr))

    def step_all(self) -> None:
        """optimizer.step() after backward: foreach (all state first, one group temporary) or per parameter."""
        if uses_foreach(self.tr):
            for p in self.params:
                self.create_state(p)
            if not self.on_gpu:
                return
            t = shard(foreach_temps(self.params, self.tr), self.div)
            if t:
                self.sim.transient(t, TMP, "optimizer-step temporaries")
        else:
            for p in self.params:
                if p.grad is not None:
                    self.step_param(p)
