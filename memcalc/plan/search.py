"""``memcalc plan``: which GPU, how many, and with which memory techniques.

Three questions, all answered from the simulated step (:mod:`memcalc.engine.timeline`):

1. ``plan --model M --gpu G`` (:func:`plan_gpu`): every technique combination (precision x
   optimizer x activation checkpointing x adapters x fused optimizer step, see
   :func:`techniques`) that fits one G at batch 1 and the given sequence, with the largest
   batch (at that sequence) and the largest sequence (at batch 1) whose *required* bytes
   (peak + CUDA context + allocator slack, :func:`memcalc.estimate.peak.estimate`) fit
   ``G.capacity_bytes``, ranked by a relative step-time cost per token (below).
2. ``plan --model M`` (:func:`plan_cluster`): for every GPU in the catalog, the fewest GPUs
   for a full fine-tune and for a LoRA run at batch 1 per GPU (ZeRO-3 over N GPUs).
3. ``estimate --max-batch / --max-seq`` (:func:`max_batch`, :func:`max_seq`): the inverse
   questions for one setup, by binary search over direct estimates.

How the search is fast: a direct estimate simulates the step op by op (5-80 ms); the plan asks
~10^5-10^6 (option, batch, seq) questions. :mod:`memcalc.plan.fits` fits each option's peak in
closed form from a handful of simulations (every allocation's running total is a polynomial
a + b*B + c*T + d*B*T + e*T^2 + f*B*T^2; a phase's peak is the maximum over the few
allocations that can set it), and :func:`evaluate_grid` evaluates options x batches x seqs in
one numpy expression. Options whose weights and optimizer state alone exceed the card are
discarded before fitting. Every number printed for a fitting option (its batch-1 peak, max
batch, max seq) is then confirmed with a direct estimate: the fitted answer must fit and the
next integer must not, otherwise a binary search around it finds the exact one.

Cost model (relative step time per token; 1.00 = full fine-tune in bf16, no
checkpointing, at full GPU utilisation). Forward FLOPs per token from the model's shapes
(Kaplan et al. 2020, "Scaling Laws for Neural Language Models", Table 1):
``F = F_lin + F_head + F_attn`` with ``F_lin = 2 x`` (the layers' linear weights),
``F_head = 2 x vocab x d_model`` and ``F_attn = 2 x n_layers x T x q_dim`` (the attention
core, QK^T and PV). One step is

- forward ``F``; backward ``2 F`` for a full fine-tune (activation and weight gradients, the
  ``C = 6N`` per token of Kaplan et al.); with LoRA/QLoRA the frozen weights get no weight
  gradient: ``F_lin + F_head + 2 F_attn`` (the adapters' own matmuls are negligible at rank 16;
  Hu et al. 2021 report about 25% faster training than full fine-tuning for GPT-3);
- full or sqrt checkpointing recompute the layers' forward once (Chen et al. 2016, "Training
  Deep Nets with Sublinear Memory Cost"): ``+ F_lin + F_attn`` (about +33%); selective
  (Korthikanti et al. 2022) recomputes only the attention core: ``+ F_attn``;
- QLoRA dequantises every 4-bit weight for each matmul: x1.15 (an assumption; reported
  slowdowns over LoRA range from about 10% to 40% with the kernel and model size);
- precision: bf16/fp16 (pure or with fp32 master weights) x1.0; AMP x1.05 (an assumption: the
  casts of the fp32 weights every forward); fp32 x2.0 (TF32 tensor cores run at half the 16-bit
  rate: A100 datasheet, 156 vs 312 dense TFLOPS; without TF32 fp32 is far slower);
- optimizer (AdamW, 8-bit AdamW, Adafactor) and a fused step: +0 (the step is O(params),
  the forward/backward O(params x tokens));
- utilisation (an assumption): small steps run below peak throughput; cost per token is
  multiplied by ``1 + 1024 / (max_batch x T)`` (a 1024-token step runs at half speed), so
  options that fit a bigger batch rank higher.

The ranking is by this cost per token at each option's max batch. It is a rough guide for
comparing options on one GPU, not a time prediction.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Optional, Sequence

import numpy as np

from memcalc.core.errors import UserError
from memcalc.core.optimizers import OPTIMIZERS as OPTIMIZER_RECORDS, PLANNED_OPTIMIZERS
from memcalc.estimate.peak import ALLOCATOR_SLACK_FRACTION, CUDA_CONTEXT_BYTES
from memcalc.plan.fits import (FEATURES, fit_gpus, fit_points, fit_step, largest_true, largest_true_array, required_from_peak,
                  simulated_peak, trace_peak)
from memcalc.engine.params import param_inventory
from memcalc.inputs.profiles import DEFAULT_PROFILE, get_profile
from memcalc.core.spec import ExperimentSpec, KernelProfile, LoraSpec, ModelSpec, TrainingSpec
from memcalc.core.units import MiB, fmt_bytes, fmt_count, gib

#: Largest batch the search considers.
BATCH_CAP = 1 << 16
#: The catalog search for ``plan --model M`` (no --gpu) covers 1..GPU_CAP GPUs.
GPU_CAP = 1024
#: Default sequence length (or the model's maximum when smaller).
DEFAULT_SEQ = 2048
#: Options whose fitted requirement is within this fraction of the card are checked directly.
CONFIRM_MARGIN = 0.02

#: Cost model constants (see the module docstring).
QLORA_OVERHEAD = 0.15
PRECISION_FACTOR = {"16": 1.0, "16+master": 1.0, "amp": 1.05, "fp32": 2.0}
HALF_SPEED_TOKENS = 1024

OPTIMIZERS = PLANNED_OPTIMIZERS  # the registry's searched optimizers (memcalc.core.optimizers)
CHECKPOINTS = ("none", "full", "sqrt", "selective")
LORA_RANK = 16

COST_MODEL_LINES = (
    "relative cost = step time per token, 1.00 = bf16 full fine-tune, no checkpointing, GPU saturated",
    "forward F = linear + head + attention-core FLOPs; backward 2F (full) or F_lin + F_head + 2 F_attn (LoRA/QLoRA: no frozen-weight grads)",
    "checkpointing full/sqrt: + the layers' forward (~+33%); selective: + the attention core",
    f"QLoRA dequantisation x{1 + QLORA_OVERHEAD:.2f}; AMP x{PRECISION_FACTOR['amp']:.2f}; fp32 x{PRECISION_FACTOR['fp32']:.1f} (TF32); optimizer choice and fused step +0",
    f"utilisation: x (1 + {HALF_SPEED_TOKENS} / tokens per step) at the max batch, so a bigger batch ranks higher",
    "torch.compile (--compile): + the forward FLOPs its memory budget recomputes; compile's own speed-up is not counted",
)


# --------------------------------------------------------------------------- techniques


@dataclass(frozen=True)
class Technique:
    """One combination of memory techniques for a single-GPU run."""

    adapters: str  # "none" | "lora" | "qlora"
    precision: str  # "16" (pure 16-bit) | "16+master" (16-bit + fp32 master/moments) | "amp" | "fp32"
    optimizer: str
    checkpoint: str
    fused: bool
    budget: Optional[float] = None  # torch.compile's activation memory budget; None = eager

    def precision_name(self, half: str = "bf16") -> str:
        return {"16": half, "16+master": half, "amp": f"amp-{half}", "fp32": "fp32"}[self.precision]

    def label(self, half: str = "bf16") -> str:
        """Human-readable name, e.g. ``QLoRA · bf16 · AdamW · ckpt full · fused``."""
        ad = {"none": "full FT", "lora": "LoRA", "qlora": "QLoRA"}[self.adapters]
        pr = self.precision_name(half) + ("+fp32 master" if self.precision == "16+master" else "")
        op = OPTIMIZER_RECORDS[self.optimizer].display
        ck = "no ckpt" if self.checkpoint == "none" else f"ckpt {self.checkpoint}"
        comp = [] if self.budget is None else [f"compile budget {self.budget:g}"]
        return " · ".join([ad, pr, op, ck] + (["fused"] if self.fused else []) + comp)

    def key(self, half: str = "bf16") -> str:
        """Compact id, e.g. ``qlora/bf16/adamw/full/fused``."""
        pr = self.precision_name(half) + ("+master" if self.precision == "16+master" else "")
        comp = [] if self.budget is None else [f"compile{self.budget:g}"]
        return "/".join([self.adapters, pr, self.optimizer, self.checkpoint] + (["fused"] if self.fused else []) + comp)

    def training(self, batch: int, seq: int, half: str = "bf16") -> TrainingSpec:
        lora = None
        if self.adapters != "none":
            lora = LoraSpec(rank=LORA_RANK, qlora=self.adapters == "qlora")
        return TrainingSpec(
            batch=batch, seq=seq, precision=self.precision_name(half), master_weights=self.precision == "16+master",
            optimizer=self.optimizer, checkpoint=self.checkpoint, fused_optimizer=self.fused, lora=lora,
            compile=self.budget is not None, memory_budget=None if self.budget in (None, 1.0) else self.budget,
        )

    def as_dict(self, half: str = "bf16") -> dict[str, Any]:
        return {
            "option": self.label(half),
            "key": self.key(half),
            "adapters": self.adapters,
            "precision": self.precision_name(half),
            "master_weights": self.precision == "16+master",
            "optimizer": self.optimizer,
            "checkpoint": self.checkpoint,
            "fused_optimizer": self.fused,
            "compile": self.budget is not None,
            "memory_budget": self.budget,
        }


def techniques() -> list[Technique]:
    """The option grid: full fine-tuning in 4 precisions (pure 16-bit; 16-bit with fp32 master
    weights and moments; AMP over fp32 weights; fp32) x AdamW / 8-bit AdamW / Adafactor x
    checkpointing none/full/sqrt/selective x plain or fused (in-backward) optimizer step (96),
    plus LoRA and QLoRA (rank 16 on q,k,v,o, 16-bit base, AdamW) x the 4 checkpointing modes x
    plain/fused step (16). Gradient accumulation is 1 (a fused step cannot accumulate)."""
    out = []
    for prec in ("16", "16+master", "amp", "fp32"):
        for opt in OPTIMIZERS:
            for ck in CHECKPOINTS:
                for fused in (False, True):
                    out.append(Technique("none", prec, opt, ck, fused))
    for ad in ("lora", "qlora"):
        for ck in CHECKPOINTS:
            for fused in (False, True):
                out.append(Technique(ad, "16", "adamw", ck, fused))
    return out


#: the activation memory budgets ``plan --compile`` tries
COMPILE_BUDGETS = (1.0, 0.5, 0.1)


def compile_techniques(budgets: Sequence[float] = COMPILE_BUDGETS) -> list[Technique]:
    """``plan --compile``: torch.compile at each budget for a bf16 full fine-tune, LoRA and QLoRA
    (AdamW, no checkpointing: the budget is the recomputation). They are searched with direct
    estimates, not fits: the partitioner's choice can change with batch and sequence length."""
    return [Technique(ad, "16", "adamw", "none", False, b) for ad in ("none", "lora", "qlora") for b in budgets]


def default_seq(model: ModelSpec, seq: Optional[int]) -> int:
    """The sequence the plan uses: ``seq`` if given (checked), else 2048 or the model's maximum."""
    if seq is None:
        return min(DEFAULT_SEQ, model.max_seq_len)
    if seq < 2:
        raise UserError(f"--seq must be at least 2, got {seq}")
    if seq > model.max_seq_len:
        raise UserError(f"--seq {seq} exceeds {model.name}'s maximum sequence length ({model.max_seq_len})")
    return seq


# --------------------------------------------------------------------------- cost model


def flops_per_token(model: ModelSpec, seq: int) -> tuple[float, float, float]:
    """Forward FLOPs per token: (layers' linear matmuls, LM head, attention core at ``seq``)."""
    lin = sum(p.numel for p in param_inventory(model) if p.kind == "linear")
    f_lin = 2.0 * lin
    f_head = 2.0 * model.vocab_size * model.d_model
    f_attn = 2.0 * model.n_layers * seq * model.q_dim
    return f_lin, f_head, f_attn


def relative_cost(t: Technique, model: ModelSpec, seq: int, batch: int,
                  recompute_fraction: float = 0.0) -> Optional[float]:
    """Relative step time per token at ``batch`` x ``seq`` (see the module docstring); None when
    ``batch`` is 0 (nothing fits). ``recompute_fraction``: the share of the forward FLOPs that a
    torch.compile memory budget recomputes (memcalc.compile.compiled)."""
    if batch <= 0:
        return None
    f_lin, f_head, f_attn = flops_per_token(model, seq)
    fwd = f_lin + f_head + f_attn
    bwd = 2 * fwd if t.adapters == "none" else f_lin + f_head + 2 * f_attn
    rec = {"none": 0.0, "full": f_lin + f_attn, "sqrt": f_lin + f_attn, "selective": f_attn}[t.checkpoint]
    rec += recompute_fraction * fwd
    units = fwd + bwd + rec
    if t.adapters == "qlora":
        units *= 1 + QLORA_OVERHEAD
    units *= PRECISION_FACTOR[t.precision]
    units *= 1 + HALF_SPEED_TOKENS / (batch * seq)
    return units / (3 * fwd)


# --------------------------------------------------------------------------- direct checks


def _peak_bytes(exp: ExperimentSpec) -> int:
    """``estimate(exp).peak_bytes``: the higher of the simulated steady-state and first steps, from
    the same simulations estimate() runs (cached, so fit points are not simulated twice)."""
    return max(simulated_peak(exp, False), simulated_peak(exp, True))


def fits(exp: ExperimentSpec, capacity_bytes: int) -> bool:
    """Whether ``estimate(exp).required_bytes <= capacity_bytes``. Two exact shortcuts come first:
    weights plus optimizer state (no forward pass) and the steady-state step alone; when either
    does not fit, the estimate (at least as high) cannot either."""
    if required_from_peak(_state_floor(exp)) > capacity_bytes:  # weights + state alone: no simulation
        return False
    if required_from_peak(simulated_peak(exp)) > capacity_bytes:
        return False
    return required_from_peak(_peak_bytes(exp)) <= capacity_bytes


def _with(exp: ExperimentSpec, **training: Any) -> ExperimentSpec:
    return exp.model_copy(update={"training": exp.training.model_copy(update=training)})


def _largest_exact(pred: Callable[[int], bool], lo: int, hi: int, seed: Optional[int] = None) -> int:
    """The largest x in [lo, hi] with pred(x) (pred monotone: true, then false), ``lo - 1`` if none.
    With a ``seed`` (a fitted guess) it checks seed and seed + 1 first and gallops outward only
    when the guess is off."""
    if seed is None or seed < lo or seed > hi:
        if not pred(lo):
            return lo - 1
        a, step = lo, 1  # gallop up from lo
        while True:
            b = min(hi, a + step)
            if b == a:
                return a
            if not pred(b):
                return largest_true(pred, a, b - 1) if b - 1 > a else a
            a, step = b, step * 2
    if pred(seed):
        if seed == hi or not pred(seed + 1):
            return seed
        a, step = seed + 1, 2
        while True:
            b = min(hi, a + step)
            if b == a:
                return a
            if not pred(b):
                return largest_true(pred, a, b - 1) if b - 1 > a else a
            a, step = b, step * 2
    b, step = seed, 1  # gallop down: pred(b) false
    while True:
        a = max(lo, b - step)
        if pred(a):
            return largest_true(pred, a, b - 1) if b - 1 > a else a
        if a == lo:
            return lo - 1
        b, step = a, step * 2


def max_batch(exp: ExperimentSpec, capacity_bytes: int, seed: Optional[int] = None) -> int:
    """The largest batch (at ``exp``'s seq, everything else as given) whose required bytes fit
    ``capacity_bytes``; 0 if batch 1 does not fit; at most :data:`BATCH_CAP`. Exact: a galloping
    binary search over direct estimates (the estimate is monotone in batch)."""
    return _largest_exact(lambda b: fits(_with(exp, batch=int(b)), capacity_bytes), 1, BATCH_CAP, seed)


def max_seq(exp: ExperimentSpec, capacity_bytes: int, seed: Optional[int] = None) -> int:
    """The largest sequence (at ``exp``'s batch) whose required bytes fit ``capacity_bytes``, at most
    the model's ``max_seq_len``; 0 if not even 2 tokens fit. Exact: binary search over direct
    estimates (monotone in seq)."""
    hi = exp.model.max_seq_len
    if seed is None:  # bisect between 2 and the model's maximum
        pred = lambda t: fits(_with(exp, seq=int(t)), capacity_bytes)  # noqa: E731
        r = largest_true(pred, 2, hi)
        return r if r >= 2 else 0
    r = _largest_exact(lambda t: fits(_with(exp, seq=int(t)), capacity_bytes), 2, hi, seed)
    return r if r >= 2 else 0


def check_one_gpu(gpu: Optional[Sequence[str]], flag: str):
    """The single GPU that ``--max-batch``/``--max-seq`` answer for (UserError otherwise)."""
    from memcalc.inputs.gpus import get_gpu

    names = list(gpu or [])
    if len(names) != 1:
        got = "none" if not names else f"{len(names)} ({', '.join(names)})"
        raise UserError(f"{flag} needs exactly one --gpu (the card to fit), got {got}")
    return get_gpu(names[0])


# --------------------------------------------------------------------------- vectorised search


@dataclass(frozen=True)
class StackedFits:
    """Every option's fitted candidate rows in raw (B, T) features, for evaluation in one go.
    ``owner[k]`` is the option of row k; rows are grouped by option (owner is sorted)."""

    coef: np.ndarray  # (K, 6)
    owner: np.ndarray  # (K,)
    starts: np.ndarray  # (O,) first row of each option
    n: int

    @classmethod
    def of(cls, fits_: Sequence[Any]) -> "StackedFits":
        rows, owner = [], []
        for i, f in enumerate(fits_):
            c = f.coefficients.copy()
            s = f.t_scale
            c[:, 2] /= s
            c[:, 3] /= s
            c[:, 4] /= s * s
            c[:, 5] /= s * s
            rows.append(c)
            owner.append(np.full(len(c), i))
        coef = np.concatenate(rows)
        own = np.concatenate(owner)
        starts = np.searchsorted(own, np.arange(len(fits_)))
        return cls(coef, own, starts, len(fits_))

    def peaks_at(self, B: np.ndarray, T: np.ndarray) -> np.ndarray:
        """Fitted peak of option i at (B[i], T[i]) for every option (arrays of shape (O,))."""
        b = np.asarray(B, dtype=np.float64)[self.owner]
        t = np.asarray(T, dtype=np.float64)[self.owner]
        f = np.stack([np.ones_like(b), b, t, b * t, t * t, b * t * t], axis=-1)
        v = np.einsum("kf,kf->k", f, self.coef)
        return np.maximum.reduceat(v, self.starts)


_GRID_CHUNK = 4_000_000  # floats per intermediate block of evaluate_grid


def evaluate_grid(stack: StackedFits, batches: np.ndarray, seqs: np.ndarray) -> np.ndarray:
    """Fitted required bytes of every option at every (batch, seq): shape (options, batches, seqs).
    One matrix product of the (batches x seqs, 6) features with all options' candidate rows, then
    a maximum per option."""
    B = np.asarray(batches, dtype=np.float64)[:, None]
    T = np.asarray(seqs, dtype=np.float64)[None, :]
    B, T = np.broadcast_arrays(B, T)
    f = np.stack([np.ones_like(B), B, T, B * T, T * T, B * T * T], axis=-1)  # (nB, nT, 6)
    out = np.empty((stack.n,) + B.shape)
    ends = np.append(stack.starts[1:], len(stack.coef))
    step = max(1, int(_GRID_CHUNK // max(1, B.size * max(1, len(stack.coef) // max(1, stack.n)))))
    for o0 in range(0, stack.n, step):  # chunks of options keep the (nB, nT, K) block small
        o1 = min(stack.n, o0 + step)
        k0, k1 = stack.starts[o0], ends[o1 - 1]
        v = f @ stack.coef[k0:k1].T  # (nB, nT, k)
        peak = np.maximum.reduceat(v, stack.starts[o0:o1] - k0, axis=-1)  # (nB, nT, o)
        out[o0:o1] = np.moveaxis(peak, -1, 0)
    return required_from_peak(out)


def batch_grid() -> np.ndarray:
    """Batches on the search grid: 1..64, then about 12% apart up to :data:`BATCH_CAP`."""
    return np.unique(np.concatenate([np.arange(1, 65), np.round(np.geomspace(64, BATCH_CAP, 64))])).astype(np.int64)


def seq_grid(model: ModelSpec, seq: int) -> np.ndarray:
    """Sequence lengths on the search grid: about 9% apart from 2 to the model's maximum, plus ``seq``."""
    hi = model.max_seq_len
    g = np.round(np.geomspace(2, max(hi, 3), 96))
    return np.unique(np.concatenate([g, [seq, hi]])).astype(np.int64)


def _state_floor(exp: ExperimentSpec) -> int:
    """Weights plus optimizer state at the start of a steady-state step (allocated exactly as the
    simulator does): a lower bound of the peak that needs no forward pass."""
    tr = exp.training
    return _state_floor_of(exp.model, exp.profile.allocator_round_bytes, tr.model_copy(
        update={"batch": 1, "seq": 2, "checkpoint": "none", "fused_optimizer": False}))


@lru_cache(maxsize=512)
def _state_floor_of(model: ModelSpec, round_bytes: int, tr: TrainingSpec) -> int:
    from memcalc.engine.forward import make_params
    from memcalc.engine.optimizers import OptimizerSim
    from memcalc.engine.sim import Sim

    exp = ExperimentSpec(model=model, training=tr)
    sim = Sim(round_bytes)
    sim.record_timeline = False
    params = make_params(sim, exp)
    rows_of = {p.name: (p.shape[0] if len(p.shape) == 2 else 0) for p in param_inventory(model, tr.lora)}
    OptimizerSim(sim, tr, params.order, rows_of).create_all()
    return sim.total


# --------------------------------------------------------------------------- parallel work


def workers() -> int:
    """Worker processes for the simulations: the CPUs this process may use, or
    ``MEMCALC_WORKERS`` (1 = run everything in this process)."""
    env = os.environ.get("MEMCALC_WORKERS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise UserError(f"MEMCALC_WORKERS must be a whole number, got {env!r}") from None
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _run_keeping_peaks(job: tuple[Callable[[Any], Any], Any]) -> tuple[Any, dict]:
    from memcalc.plan import fits as _fit

    fn, arg = job
    before = set(_fit._PEAKS)
    out = fn(arg)
    return out, {k: v for k, v in _fit._PEAKS.items() if k not in before}


def parallel_map(fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """``[fn(x) for x in items]`` over forked worker processes (each simulation is pure Python, so
    processes, not threads); the simulated peaks they find are merged into this process's cache.
    Serial when there is one CPU, one item, or no ``fork``. ``fn`` must be a module-level function."""
    from memcalc.plan import fits as _fit

    items = list(items)
    n = min(workers(), len(items))
    if n <= 1 or not sys.platform.startswith("linux"):  # fork is the cheap, safe start method there
        return [fn(x) for x in items]
    with mp.get_context("fork").Pool(n) as pool:
        out = pool.map(_run_keeping_peaks, [(fn, x) for x in items], chunksize=1)
    for _, peaks in out:
        _fit._PEAKS.update(peaks)
    return [r for r, _ in out]


def _fit_option(job: tuple[ExperimentSpec, int, bool]):
    """Fit one option, unless (``always`` false) its steady step at batch 1 already exceeds ``cap``.
    That first simulation is one of the fit's own points when the plan's seq is a fit sequence."""
    exp, cap, always = job
    if not always:
        b1 = exp.training.batch == 1 and exp.training.seq in fit_points(exp)
        peak = trace_peak(exp) if b1 else simulated_peak(exp)
        if required_from_peak(peak) > cap:
            return None
    return fit_step(exp)


def _fit_gpus_job(exp: ExperimentSpec):
    return fit_gpus(exp, GPU_CAP)


def _simulate_job(job: tuple[ExperimentSpec, bool]) -> None:
    """Simulate the steady step (and the first step too when ``job[1]``) into the peak cache."""
    exp, both = job
    simulated_peak(exp, False)
    if both:
        simulated_peak(exp, True)


def _confirm_option(job: tuple[ExperimentSpec, int, int, int]) -> tuple[int, int, int]:
    """Exact (peak at batch 1, max batch, max seq) of one option, seeded with the fitted answers."""
    e, cap, mb, ms = job
    p = _peak_bytes(e)
    ok = required_from_peak(p) <= cap
    b = max_batch(e, cap, seed=mb if mb > 0 else None) if ok else 0
    t = max_seq(e, cap, seed=ms if ms >= 2 else None) if (ok or ms > 0) else 0
    return p, b, t


# --------------------------------------------------------------------------- plan --gpu


@dataclass
class OptionResult:
    """One technique combination on one GPU. Bytes are ints (batch 1 at the plan's seq)."""

    technique: Technique
    peak_bytes: int
    required_bytes: int
    fits: bool
    max_batch: int
    max_seq: int
    relative_cost: Optional[float]
    confirmed: bool  # every number above comes from (or was checked by) direct estimates

    def as_dict(self, half: str) -> dict[str, Any]:
        d = self.technique.as_dict(half)
        d.update(peak_bytes=self.peak_bytes, required_bytes=self.required_bytes, fits=self.fits,
                 max_batch=self.max_batch, max_seq=self.max_seq,
                 relative_cost=None if self.relative_cost is None else round(self.relative_cost, 4),
                 confirmed=self.confirmed)
        return d


@dataclass
class GpuPlan:
    model: ModelSpec
    gpu: Any
    seq: int
    half: str
    options: list[OptionResult]
    evaluated: int  # options x batches x seqs evaluated by the vectorised search
    notes: list[str] = field(default_factory=list)
    considered: int = 0  # technique combinations planned

    @property
    def fitting(self) -> list[OptionResult]:
        return [o for o in self.options if o.fits]


def plan_gpu(model: ModelSpec, gpu: Any, seq: Optional[int] = None, profile: Optional[KernelProfile] = None,
             include_all: bool = False, confirm: bool = True,
             options: Optional[Sequence[Technique]] = None) -> GpuPlan:
    """Every technique combination on one ``gpu`` (see the module docstring). Without
    ``include_all`` only the options that fit at batch 1 are fitted and returned."""
    seq = default_seq(model, seq)
    profile = profile or get_profile(DEFAULT_PROFILE)
    half = "bf16" if getattr(gpu, "bf16", True) else "fp16"
    cap = int(gpu.capacity_bytes)
    techs = list(options) if options is not None else techniques()
    exps = [ExperimentSpec(name=f"{model.name} {t.key(half)}", model=model, training=t.training(1, seq, half),
                           profile=profile) for t in techs]
    notes = []
    if half == "fp16":
        notes.append(f"{getattr(gpu, 'display_name', gpu.name)} has no bf16: 16-bit options use fp16 (same memory)")

    # 1. weights + optimizer state alone: options beyond the card cannot fit at any batch or seq;
    #    without --all, neither can options whose steady step at batch 1 does not fit.
    #    Compiled options are not fitted (see compile_techniques): they are estimated directly.
    compiled = [i for i, t in enumerate(techs) if t.budget is not None]
    floor_ok = [i for i, e in enumerate(exps) if techs[i].budget is None and required_from_peak(_state_floor(e)) <= cap]
    # 2. fit the rest in (batch, seq) and evaluate the whole grid at once
    got = parallel_map(_fit_option, [(exps[i], cap, include_all) for i in floor_ok])
    fitted = {i: f for i, f in zip(floor_ok, got) if f is not None}
    to_fit = sorted(fitted)
    results: dict[int, OptionResult] = {}
    evaluated = 0
    if to_fit:
        stack = StackedFits.of([fitted[i] for i in to_fit])
        bs, ts = batch_grid(), seq_grid(model, seq)
        req = evaluate_grid(stack, bs, ts)  # (O, nB, nT)
        evaluated = req.size
        ok = req <= cap
        j_seq = int(np.searchsorted(ts, seq))
        fit_b1 = ok[:, 0, j_seq]
        # bracket from the grid, then bisect on the fitted closed form to the exact integer
        n_b = ok[:, :, j_seq].sum(axis=1)  # the grid batches are sorted and the peak grows with batch
        lo_b = np.where(n_b > 0, bs[np.maximum(n_b - 1, 0)], 1)
        hi_b = np.where(n_b < len(bs), bs[np.minimum(n_b, len(bs) - 1)] - 1, BATCH_CAP)
        seqs_o = np.full(stack.n, seq)
        mb = largest_true_array(lambda b: required_from_peak(stack.peaks_at(b, seqs_o)) <= cap, lo_b, hi_b)
        mb = np.where(fit_b1, np.maximum(mb, 1), 0)
        n_t = ok[:, 0, :].sum(axis=1)
        lo_t = np.where(n_t > 0, ts[np.maximum(n_t - 1, 0)], 2)
        hi_t = np.where(n_t < len(ts), ts[np.minimum(n_t, len(ts) - 1)] - 1, model.max_seq_len)
        ones = np.ones(stack.n)
        ms = largest_true_array(lambda t: required_from_peak(stack.peaks_at(ones, t)) <= cap, lo_t, hi_t)
        ms = np.where(n_t > 0, np.maximum(ms, 2), 0)
        peak_b1 = stack.peaks_at(ones, np.full(stack.n, seq))
        for k, i in enumerate(to_fit):
            p = int(round(peak_b1[k]))
            results[i] = OptionResult(techs[i], p, required_from_peak(p), bool(fit_b1[k]), int(mb[k]), int(ms[k]),
                                      None, False)
    # 2b. compiled options: direct estimates, seeded with the same setup's eager answers
    for i, (p, mb, ms) in zip(compiled, parallel_map(_confirm_option, [
            (exps[i], cap, *_eager_seeds(techs[i], techs, results)) for i in compiled])):
        r = OptionResult(techs[i], p, required_from_peak(p), required_from_peak(p) <= cap, mb, ms, None, True)
        if r.fits or include_all:
            results[i] = r
    # 3. options that cannot fit: exact batch-1 numbers only when all are shown
    rest = [i for i in range(len(exps)) if i not in results and i not in compiled] if include_all else []
    for i, p in zip(rest, parallel_map(_peak_bytes, [exps[i] for i in rest])):
        results[i] = OptionResult(techs[i], p, required_from_peak(p), False, 0, 0, None, True)
    # 4. confirm what is printed with direct estimates (fitting options, and those near the line)
    todo = [i for i, r in results.items() if confirm and not r.confirmed and (
        r.fits or abs(r.required_bytes - cap) <= CONFIRM_MARGIN * cap or (include_all and r.max_seq > 0))]
    exact = parallel_map(_confirm_option, [(exps[i], cap, results[i].max_batch, results[i].max_seq) for i in todo])
    for i, (p, mb, ms) in zip(todo, exact):
        r = results[i]
        r.peak_bytes, r.required_bytes = p, required_from_peak(p)
        r.fits, r.max_batch, r.max_seq, r.confirmed = r.required_bytes <= cap, mb, ms, True
    for i, r in results.items():
        frac = 0.0
        if r.technique.budget is not None:
            from memcalc.compile.compiled import compiled_plan

            frac = compiled_plan(exps[i]).recompute_pct / 100
        r.relative_cost = relative_cost(r.technique, model, seq, r.max_batch, frac)
    shown = [results[i] for i in sorted(results) if include_all or results[i].fits]
    shown.sort(key=lambda r: (not r.fits, r.relative_cost if r.relative_cost is not None else float("inf"),
                              r.required_bytes))
    return GpuPlan(model, gpu, seq, half, shown, evaluated, notes, considered=len(techs))


def _eager_seeds(t: Technique, techs: Sequence[Technique], results: dict[int, "OptionResult"]) -> tuple[int, int]:
    """(max batch, max seq) of the same setup without compile, when it was planned: a starting
    guess for the compiled option's search, which gallops from it to the exact answer."""
    for j, u in enumerate(techs):
        if u.budget is None and (u.adapters, u.precision, u.optimizer, u.checkpoint, u.fused) == (
                t.adapters, t.precision, t.optimizer, t.checkpoint, t.fused) and j in results:
            return results[j].max_batch, results[j].max_seq
    return 0, 0


# --------------------------------------------------------------------------- plan (catalog)


def cluster_setups(model: ModelSpec, seq: int, profile: KernelProfile) -> dict[str, dict[str, ExperimentSpec]]:
    """The two multi-GPU setups (per GPU: batch 1 x ``seq``), each with checkpointing none and full.

    full: bf16 weights and gradients + fp32 master weights and AdamW moments (16 B/param),
    ZeRO-3 over the GPUs, no offload. lora: bf16 frozen base, rank-16 adapters on q,k,v,o,
    AdamW, ZeRO-3 (sharding the frozen base) over the GPUs.
    """
    out: dict[str, dict[str, ExperimentSpec]] = {"full": {}, "lora": {}}
    for ck in ("none", "full"):
        out["full"][ck] = ExperimentSpec(
            name=f"{model.name} full fine-tune", model=model, profile=profile,
            training=TrainingSpec(batch=1, seq=seq, precision="bf16", master_weights=True, optimizer="adamw",
                                  zero=3, gpus=1, checkpoint=ck))
        out["lora"][ck] = ExperimentSpec(
            name=f"{model.name} LoRA", model=model, profile=profile,
            training=TrainingSpec(batch=1, seq=seq, precision="bf16", optimizer="adamw", zero=3, gpus=1,
                                  checkpoint=ck, lora=LoraSpec(rank=LORA_RANK)))
    return out


def _smallest_n(pred: Callable[[int], bool], seed: int, hi: int) -> Optional[int]:
    """The smallest N in [1, hi] with pred(N), where pred is monotone for N >= 2 (N = 1 has no
    gathered layer buffers, so it is checked on its own); ``seed`` is the fitted answer."""
    if pred(1):
        return 1
    neg = lambda n: not pred(n)  # noqa: E731  -- true, then false, over N >= 2
    last_bad = _largest_exact(neg, 2, hi, seed - 1 if 2 <= seed - 1 <= hi else None)
    return last_bad + 1 if last_bad < hi else None


def next_pow2(n: Optional[int]) -> Optional[int]:
    if n is None:
        return None
    p = 1
    while p < n:
        p *= 2
    return p


@dataclass
class ClusterRow:
    gpu: Any
    min_gpus: dict[str, Optional[int]]  # setup -> fewest GPUs (None: more than GPU_CAP)
    checkpoint: dict[str, Optional[str]]  # setup -> checkpointing used at that count
    required_bytes: dict[str, Optional[int]]  # setup -> per-GPU required bytes at that count

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.gpu.name, "display_name": getattr(self.gpu, "display_name", self.gpu.name),
                             "capacity_bytes": self.gpu.capacity_bytes}
        for s in ("full", "lora"):
            n = self.min_gpus[s]
            d[f"min_gpus_{s}"] = n
            d[f"min_gpus_{s}_pow2"] = next_pow2(n)
            d[f"checkpoint_{s}"] = self.checkpoint[s]
            d[f"required_bytes_{s}"] = self.required_bytes[s]
        return d


@dataclass
class ClusterPlan:
    model: ModelSpec
    seq: int
    rows: list[ClusterRow]
    params: int
    notes: list[str] = field(default_factory=list)


def plan_cluster(model: ModelSpec, seq: Optional[int] = None, profile: Optional[KernelProfile] = None,
                 gpus: Optional[Sequence[Any]] = None, confirm: bool = True) -> ClusterPlan:
    """For each GPU, the fewest GPUs (1..GPU_CAP) for a full fine-tune and for a LoRA run (see
    :func:`cluster_setups`); checkpointing none when that fits at the count, else full."""
    from memcalc.inputs.gpus import list_gpus
    from memcalc.engine.params import count_params

    seq = default_seq(model, seq)
    profile = profile or get_profile(DEFAULT_PROFILE)
    cards = list(gpus) if gpus is not None else list_gpus()
    setups = cluster_setups(model, seq, profile)
    ns = np.arange(1, GPU_CAP + 1)
    keys = [(s, ck) for s, cks in setups.items() for ck in cks]
    fitted = parallel_map(_fit_gpus_job, [setups[s][ck] for s, ck in keys])
    req: dict[str, dict[str, np.ndarray]] = {s: {} for s in setups}
    for (s, ck), f in zip(keys, fitted):
        req[s][ck] = f.required(ns)  # NaN at N = 1: a different step, checked directly

    def fits_at(s: str, ck: str, n: int, cap: int) -> bool:
        if n == 1 or not confirm:
            return fits(_with(setups[s][ck], gpus=1), cap) if n == 1 else bool(req[s][ck][n - 1] <= cap)
        return fits(_with(setups[s][ck], gpus=n), cap)

    def seed_of(s: str, cap: int) -> Optional[int]:
        ok = req[s]["full"][1:] <= cap
        return int(ns[1:][ok][0]) if ok.any() else None

    if confirm:  # simulate the counts the confirmation will ask about, in parallel
        jobs = set()
        for g in cards:
            cap = int(g.capacity_bytes)
            for s, by_ck in setups.items():
                jobs.add((_with(by_ck["full"], gpus=1), False))
                n = seed_of(s, cap)
                if n is None:
                    continue
                if n > 2:
                    jobs.add((_with(by_ck["full"], gpus=n - 1), False))
                jobs.add((_with(by_ck["full"], gpus=n), True))
                if req[s]["none"][n - 1] <= cap:
                    jobs.add((_with(by_ck["none"], gpus=n), True))
        jobs = {j for j in jobs if required_from_peak(_state_floor(j[0])) <= max(int(g.capacity_bytes) for g in cards)}
        parallel_map(_simulate_job, sorted(jobs, key=lambda j: (j[0].training.gpus, j[0].name, j[1])))
    rows = []
    for g in cards:
        cap = int(g.capacity_bytes)
        mins: dict[str, Optional[int]] = {}
        cks: dict[str, Optional[str]] = {}
        reqs: dict[str, Optional[int]] = {}
        for s, by_ck in setups.items():
            # the fewest N with checkpointing full (the frugal one): fitted, then exact
            seed = seed_of(s, cap)
            if confirm:
                n = _smallest_n(lambda k: fits_at(s, "full", int(k), cap), seed or GPU_CAP, GPU_CAP)
            else:
                n = 1 if fits_at(s, "full", 1, cap) else seed
            mins[s] = n
            if n is None:
                cks[s], reqs[s] = None, None
                continue
            # checkpointing none if it fits at that count too (fitted; checked directly near the line)
            if n == 1 or abs(req[s]["none"][n - 1] - cap) <= CONFIRM_MARGIN * cap:
                none_fit = fits_at(s, "none", n, cap)
            else:
                none_fit = bool(req[s]["none"][n - 1] <= cap)
            ck = "none" if none_fit else "full"
            cks[s] = ck
            e = _with(by_ck[ck], gpus=n)
            reqs[s] = required_from_peak(_peak_bytes(e)) if confirm else int(req[s][ck][n - 1])
        rows.append(ClusterRow(g, mins, cks, reqs))
    notes = [
        f"full fine-tune: bf16 weights and gradients + fp32 master weights and AdamW moments (16 bytes/param), "
        f"ZeRO-3 over N GPUs (FSDP mechanics: layers all-gathered one at a time, embedding and head whole), no offload, "
        f"batch 1 x seq {seq} per GPU, activation checkpointing none if it fits at that count, else full",
        f"LoRA: bf16 frozen base, rank {LORA_RANK} adapters on q,k,v,o, AdamW; ZeRO-3 shards the frozen base when one GPU "
        f"is not enough; checkpointing as above",
        f"searched 1..{GPU_CAP} GPUs; the minimal integer count is exact (direct estimates); people rent powers of two "
        "and nodes of 8, so the next power of two is shown too",
    ]
    return ClusterPlan(model, seq, rows, count_params(model).total, notes)


# --------------------------------------------------------------------------- command helpers


def plan_model(model: Optional[str], params: Optional[str]) -> tuple[ModelSpec, list[str]]:
    """The model ``plan`` is about: ``--model`` (preset or file) or ``--params`` (inferred)."""
    from memcalc.inputs.infer import infer_from_params, parse_count
    from memcalc.inputs.presets import resolve_model

    if model and params:
        raise UserError("give one of --model or --params, not both")
    if model:
        return resolve_model(model), []
    if params:
        return infer_from_params(float(parse_count(params)))
    raise UserError("plan needs a model: give --model NAME|config.json or --params N (see `memcalc models`)")


def estimate_limits(exp: ExperimentSpec, gpu: Any, want_batch: bool, want_seq: bool) -> dict[str, Any]:
    """``estimate --max-batch/--max-seq``: the exact answers on one ``gpu``, and the required bytes
    at the answer and one past it (what makes the answer the answer)."""
    cap = int(gpu.capacity_bytes)
    out: dict[str, Any] = {"gpu": gpu.name, "capacity_bytes": cap}
    tr = exp.training
    if want_batch:
        b = max_batch(exp, cap)
        out["max_batch"] = b
        out["max_batch_seq"] = tr.seq
        out["max_batch_required_bytes"] = required_from_peak(_peak_bytes(_with(exp, batch=b))) if b else None
        out["next_batch_required_bytes"] = (required_from_peak(_peak_bytes(_with(exp, batch=b + 1)))
                                            if b < BATCH_CAP else None)
    if want_seq:
        t = max_seq(exp, cap)
        out["max_seq"] = t
        out["max_seq_batch"] = tr.batch
        out["max_seq_required_bytes"] = required_from_peak(_peak_bytes(_with(exp, seq=t))) if t else None
        out["next_seq_required_bytes"] = (required_from_peak(_peak_bytes(_with(exp, seq=t + 1)))
                                          if 2 <= t < exp.model.max_seq_len else None)
    return out


def render_limits(lim: dict[str, Any], gpu: Any, model: ModelSpec, console=None) -> None:
    from rich.console import Console

    c = console or Console()
    name = getattr(gpu, "display_name", gpu.name)
    cap = fmt_bytes(lim["capacity_bytes"])
    if "max_batch" in lim:
        b = lim["max_batch"]
        if b == 0:
            c.print(f"[bold]max batch[/bold] at seq {lim['max_batch_seq']} on {name} ({cap}): [red]0[/red] "
                    "(batch 1 does not fit)")
        else:
            nxt = lim["next_batch_required_bytes"]
            why = f"; batch {b + 1} needs {fmt_bytes(nxt)}" if nxt is not None else f" (the search stops at {BATCH_CAP:,})"
            c.print(f"[bold]max batch[/bold] at seq {lim['max_batch_seq']} on {name} ({cap}): [green]{b:,}[/green] "
                    f"(needs {fmt_bytes(lim['max_batch_required_bytes'])}{why})")
    if "max_seq" in lim:
        t = lim["max_seq"]
        if t == 0:
            c.print(f"[bold]max seq[/bold] at batch {lim['max_seq_batch']} on {name} ({cap}): [red]0[/red] "
                    "(not even 2 tokens fit)")
        else:
            nxt = lim["next_seq_required_bytes"]
            why = (f"; seq {t + 1} needs {fmt_bytes(nxt)}" if nxt is not None
                   else f"; {model.name}'s maximum sequence length")
            c.print(f"[bold]max seq[/bold] at batch {lim['max_seq_batch']} on {name} ({cap}): [green]{t:,}[/green] "
                    f"(needs {fmt_bytes(lim['max_seq_required_bytes'])}{why})")


# --------------------------------------------------------------------------- rendering


def gpu_plan_json(p: GpuPlan) -> dict[str, Any]:
    g = p.gpu
    return {
        "model": p.model.name,
        "gpu": {"name": g.name, "display_name": getattr(g, "display_name", g.name), "capacity_bytes": g.capacity_bytes},
        "seq": p.seq,
        "options": [o.as_dict(p.half) for o in p.options],
        "fitting": len(p.fitting),
        "evaluated_configurations": p.evaluated,
        "required_bytes_means": f"peak + CUDA context ({CUDA_CONTEXT_BYTES // MiB} MiB) + allocator slack "
                                f"({ALLOCATOR_SLACK_FRACTION:.0%} of the peak)",
        "cost_model": list(COST_MODEL_LINES),
        "notes": p.notes,
    }


def _gib(n: Optional[int]) -> str:
    return "-" if n is None else f"{gib(n):,.2f}"


def render_gpu_plan(p: GpuPlan, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    c = console or Console()
    g = p.gpu
    n_all = p.considered or len(techniques())
    title = (f"{p.model.name} on {getattr(g, 'display_name', g.name)} ({fmt_bytes(g.capacity_bytes)}): "
             f"{len(p.fitting)} of {n_all} technique combinations fit at batch 1 x seq {p.seq}")
    t = Table(title=title, title_justify="left",
              caption=f"peak, needs: GiB at batch 1 x seq {p.seq}; max batch at seq {p.seq}; max seq at batch 1; "
                      "cost: relative step time per token at the max batch (lower is better)",
              caption_justify="left")
    for col, just in (("#", "right"), ("option", "left"), ("peak", "right"), ("needs", "right"),
                      ("max batch", "right"), ("max seq", "right"), ("cost", "right")):
        t.add_column(col, justify=just, no_wrap=col != "option")
    for k, o in enumerate(p.options, 1):
        style = None if o.fits else "dim"
        ms = f"{o.max_seq:,}" + (" (max)" if o.max_seq == p.model.max_seq_len else "")
        mb = f"{o.max_batch:,}" + ("+" if o.max_batch >= BATCH_CAP else "")
        t.add_row(str(k) if o.fits else "-", o.technique.label(p.half), _gib(o.peak_bytes), _gib(o.required_bytes),
                  mb if o.fits else "0", ms if o.max_seq else "0",
                  "-" if o.relative_cost is None else f"{o.relative_cost:.2f}", style=style)
    c.print(t)
    if not p.fitting:
        c.print("[red]nothing fits[/red]: try a bigger GPU, fewer tokens (--seq), or `memcalc plan --model "
                f"{p.model.name}` for a multi-GPU count")
    c.print(f"[dim]peak = allocated peak; needs = peak + CUDA context {CUDA_CONTEXT_BYTES // MiB} MiB + "
            f"allocator slack {ALLOCATOR_SLACK_FRACTION:.0%}; LoRA/QLoRA: rank {LORA_RANK} on q,k,v,o; "
            f"numbers of fitting options confirmed by direct estimates (max seq capped at the model's "
            f"{p.model.max_seq_len:,})[/dim]")
    for line in COST_MODEL_LINES:
        c.print(f"[dim]cost model: {line}[/dim]")
    for n in p.notes:
        c.print(f"[yellow]note:[/yellow] {n}")


def cluster_plan_json(p: ClusterPlan) -> dict[str, Any]:
    return {"model": p.model.name, "params": p.params, "seq": p.seq, "gpus": [r.as_dict() for r in p.rows],
            "notes": p.notes}


def render_cluster_plan(p: ClusterPlan, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    c = console or Console()
    t = Table(title=f"{p.model.name} ({fmt_count(p.params)} params): fewest GPUs at batch 1 x seq {p.seq} per GPU",
              title_justify="left")
    for col, just in (("GPU", "left"), ("GiB", "right"), ("full", "right"), ("pow2", "right"),
                      ("ckpt", "left"), ("need", "right"), ("LoRA", "right"), ("pow2", "right"),
                      ("ckpt", "left"), ("need", "right")):
        t.add_column(col, justify=just, no_wrap=True)
    for r in p.rows:
        cells = [r.gpu.name, f"{gib(r.gpu.capacity_bytes):.1f}"]
        for s in ("full", "lora"):
            n = r.min_gpus[s]
            cells += [f">{GPU_CAP}" if n is None else str(n), "-" if n is None else str(next_pow2(n)),
                      r.checkpoint[s] or "-", "-" if r.required_bytes[s] is None else f"{gib(r.required_bytes[s]):.1f}"]
        t.add_row(*cells)
    c.print(t)
    for n in p.notes:
        c.print(f"[dim]{n}[/dim]")


__all__ = [
    "Technique", "techniques", "plan_gpu", "plan_cluster", "max_batch", "max_seq", "fits", "relative_cost",
    "evaluate_grid", "StackedFits", "GpuPlan", "ClusterPlan", "FEATURES",
]
