"""``memcalc plan --model M --gpu G`` (:func:`plan_gpu`): every technique combination
(:func:`memcalc.plan.options.techniques`) that fits one G at batch 1 and the given sequence, with
the largest batch (at that sequence) and the largest sequence (at batch 1) whose *required* bytes
(:func:`memcalc.estimate.peak.required_bytes`) fit ``G.capacity_bytes``, ranked by
:func:`memcalc.plan.cost.relative_cost`.

How the search is fast: a direct estimate simulates the step op by op (5-80 ms); the plan asks
~10^5-10^6 (option, batch, seq) questions. :mod:`memcalc.plan.fits` fits each option's peak in
closed form from a handful of simulations (every allocation's running total is a polynomial
a + b*B + c*T + d*B*T + e*T^2 + f*B*T^2; a phase's peak is the maximum over the few
allocations that can set it), and :func:`evaluate_grid` evaluates options x batches x seqs in
one numpy expression. Options whose weights and optimizer state alone exceed the card are
discarded before any simulation; the rest get their exact batch-1 peak (the simulation is one of
the fit's points), and those that fit are fitted, one fit per group of options that differ only
in the fused step (:func:`fit_groups`: the fit only seeds the exact searches). Every number
printed for a fitting option (its batch-1 peak, max batch, max seq) comes from direct estimates:
the fitted answer must fit and the next integer must not, otherwise a search from it that follows
the required bytes (:func:`memcalc.plan.limits.largest_by_value`) finds the exact one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

import numpy as np

from memcalc.core.spec import ExperimentSpec, KernelProfile, ModelSpec
from memcalc.estimate.peak import card_side, required_bytes
from memcalc.inputs.profiles import DEFAULT_PROFILE, get_profile
from memcalc.plan.cost import relative_cost
from memcalc.plan.fits import StepFit, bt_features, fit_points, fit_step, sorted_unique
from memcalc.plan.limits import BATCH_CAP, CONFIRM_MARGIN, largest_true_array, max_batch, max_seq, need
from memcalc.plan.options import Technique, default_seq, techniques
from memcalc.plan.parallel import parallel_map
from memcalc.plan.depth import applies
from memcalc.plan.simulations import device_total, estimated_peak, phase_peaks_of, simulated_peak, state_floor
from memcalc.plan.simulations import trace_peak


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


def evaluate_grid(stack: StackedFits, batches: np.ndarray, seqs: np.ndarray, side: Any = None) -> np.ndarray:
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
    return required_bytes(out, side)


def batch_grid() -> np.ndarray:
    """Batches on the search grid: 1..64, then about 12% apart up to :data:`BATCH_CAP`."""
    return sorted_unique(np.concatenate([np.arange(1, 65), np.round(np.geomspace(64, BATCH_CAP, 64))])).astype(np.int64)


def seq_grid(model: ModelSpec, seq: int) -> np.ndarray:
    """Sequence lengths on the search grid: about 9% apart from 2 to the model's maximum, plus ``seq``."""
    hi = model.max_seq_len
    g = np.round(np.geomspace(2, max(hi, 3), 96))
    return sorted_unique(np.concatenate([g, [seq, hi]])).astype(np.int64)


def _b1_peak(job: tuple[ExperimentSpec, int, bool, Any]) -> Optional[int]:
    """One option's exact peak at batch 1 and the plan's seq (what ``estimate()`` gives), or None
    when (``always`` false) its steady step alone already exceeds ``cap``. That simulation keeps
    its allocation trace when the plan's seq is a fit sequence: it is one of the fit's own points."""
    exp, cap, always, gpu = job
    b1 = exp.training.batch == 1 and exp.training.seq in fit_points(exp)
    peak = trace_peak(exp) if b1 else simulated_peak(exp)
    if not always and required_bytes(peak, card_side(exp, gpu)) > cap:
        return None
    return estimated_peak(exp)


def _b1_peaks(jobs: list[tuple[ExperimentSpec, int, bool, Any]]) -> list[Optional[int]]:
    return [_b1_peak(j) for j in jobs]  # (in one process: an option and its fused twin)


def fit_groups(techs: Sequence[Technique], idx: Sequence[int]) -> dict[int, int]:
    """For each option index in ``idx``, the option whose fit seeds its search: options that differ
    only in the optimizer and the fused optimizer step share one fit (an unfused one's where one is
    planned), moved to each option's own exact batch-1 peak (:func:`_plan_group`): they run the
    same forward and backward, and differ mostly by optimizer state and gradients, which do not
    grow with batch or sequence. The fit only seeds the exact searches (:func:`_confirm_option`),
    so a seed that is a little off costs a few more direct estimates, never a different answer."""
    groups: dict[Technique, list[int]] = {}
    for i in idx:
        t = techs[i]
        groups.setdefault(replace(t, fused=False, optimizer="", checkpoint=_FIT_CHECKPOINT.get(t.checkpoint, t.checkpoint)),
                          []).append(i)
    out: dict[int, int] = {}
    for members in groups.values():
        # the fitted one: a step the depth extrapolation covers (sqrt segments are simulated at full
        # depth), unfused where there is one
        rep = min(members, key=lambda i: (techs[i].checkpoint in _FULL_DEPTH, techs[i].fused))
        out.update({i: rep for i in members})
    return out


#: Checkpointing modes whose options take their seeds from another mode's fit: sqrt segments keep
#: about as much as per-layer checkpointing, and their steps cannot be extrapolated in depth
#: (each is simulated whole), while per-layer ones can.
_FIT_CHECKPOINT = {"sqrt": "full"}
_FULL_DEPTH = ("sqrt",)


def _seeds(stack: StackedFits, bs: np.ndarray, ts: np.ndarray, seq: int, cap: int, fit_b1: np.ndarray,
           max_len: int, side: Any = None) -> tuple[np.ndarray, np.ndarray, int]:
    """The fitted (max batch at ``seq``, max seq at batch 1) of every option of ``stack``, and the
    number of (option, batch, seq) configurations evaluated: the grid brackets each answer, then
    a bisection on the fitted closed form finds the integer."""
    req = evaluate_grid(stack, bs, ts, side)  # (O, nB, nT)
    ok = req <= cap
    j_seq = int(np.searchsorted(ts, seq))
    n_b = ok[:, :, j_seq].sum(axis=1)  # the grid batches are sorted and the peak grows with batch
    lo_b = np.where(n_b > 0, bs[np.maximum(n_b - 1, 0)], 1)
    hi_b = np.where(n_b < len(bs), bs[np.minimum(n_b, len(bs) - 1)] - 1, BATCH_CAP)
    seqs_o = np.full(stack.n, seq)
    mb = largest_true_array(lambda b: required_bytes(stack.peaks_at(b, seqs_o), side) <= cap, lo_b, hi_b)
    mb = np.where(fit_b1, np.maximum(mb, 1), 0)
    n_t = ok[:, 0, :].sum(axis=1)
    lo_t = np.where(n_t > 0, ts[np.maximum(n_t - 1, 0)], 2)
    hi_t = np.where(n_t < len(ts), ts[np.minimum(n_t, len(ts) - 1)] - 1, max_len)
    ones = np.ones(stack.n)
    ms = largest_true_array(lambda t: required_bytes(stack.peaks_at(ones, t), side) <= cap, lo_t, hi_t)
    ms = np.where(n_t > 0, np.maximum(ms, 2), 0)
    return mb, ms, int(req.size)


def _plan_group(job) -> tuple[list[tuple[int, bool, int, int, bool]], int]:
    """Options that share a fit (:func:`fit_groups`; ``job[0]`` is the fitted option): the fit, each
    option's seeds, and its exact answers from direct estimates where they are printed (it fits, is
    near the line, or ``include_all`` shows every option). Returns
    (peak, fits, max batch, max seq, confirmed) per option and the configurations evaluated."""
    fitted, members, peaks, cap, seq, bs, ts, confirm, include_all, gpu = job
    fit = fit_step(fitted)
    # a member with the fitted one's checkpointing differs by optimizer state and gradients (moved);
    # sqrt segments (fitted by per-layer checkpointing) save a different amount per token (scaled)
    fits_ = [fit if e == fitted else
             _scaled(fit, int(p), seq, phase_peaks_of(e)) if e.training.checkpoint != fitted.training.checkpoint else
             _moved(fit, e, int(p), seq) for e, p in zip(members, peaks)]
    stack = StackedFits.of(fits_)
    side = card_side(members[0], gpu)  # one model on one GPU: every member's
    fit_b1 = np.array([required_bytes(int(p), side) <= cap for p in peaks], dtype=bool)
    mb, ms, evaluated = _seeds(stack, bs, ts, seq, cap, fit_b1, members[0].model.max_seq_len, side)
    rows = []
    for k, e in enumerate(members):
        p, b, t = int(peaks[k]), int(mb[k]), int(ms[k])
        need = required_bytes(p, side)
        if confirm and (need <= cap or abs(need - cap) <= CONFIRM_MARGIN * cap or include_all):
            p, b, t = _confirm_option((e, cap, b, t, gpu, include_all, include_all))
            rows.append((p, device_total(e, side, None if include_all else cap) <= cap, b, t, True, fits_[k]))
        else:
            rows.append((p, bool(fit_b1[k]), b, t, False, fits_[k]))
    return rows, evaluated


def _moved(fit: StepFit, exp: ExperimentSpec, peak: int, seq: int) -> StepFit:
    """``fit`` (another option's, of the same forward and backward) moved to ``exp``'s own exact
    peaks at batch 1 and ``seq``: each phase's rows by the difference at that point, from ``exp``'s
    batch-1 trace when the plan has it (a phase ``exp``'s step does not run, such as the optimizer
    step of a fused one, is dropped), else all rows by the difference of the peaks. Only seeds."""
    own = phase_peaks_of(exp)
    at = {k: float(v[0]) for k, v in fit.phase_peaks(np.array([1.0]), np.array([float(seq)])).items()}
    if own is None:
        delta = peak - max(at.values())
        phases = {k: _shift(c, delta) for k, c in fit.phases.items()}
    else:
        phases = {k: _shift(c, own[k] - at[k]) for k, c in fit.phases.items() if k in own}
    return replace(fit, phases=phases or fit.phases)


def _shift(rows: np.ndarray, delta: float) -> np.ndarray:
    out = rows.copy()
    out[:, 0] += delta
    return out


def _confirm_compiled(job: tuple) -> tuple[int, int, int, float]:
    """:func:`_confirm_option` of a compiled option, and the fraction of its forward that its
    partition recomputes at batch 1 (for the cost model; the worker has the partition at hand)."""
    from memcalc.compile.compiled import compiled_plan

    e, cap, mb, ms, fit, gpu = job
    if fit is not None:
        mb, ms = _scaled_seeds(fit, e, estimated_peak(e), cap, gpu)
    return (*_confirm_option((e, cap, mb, ms, gpu)), compiled_plan(e).recompute_pct / 100)


def _confirm_option(job: tuple) -> tuple[int, int, int]:
    """Exact (peak at batch 1, max batch, max seq) of one option, seeded with the fitted answers: ``(experiment,
    capacity, max batch seed, max seq seed, gpu[, every[, shown]])`` (``gpu``: the card, :func:`card_side`). Where
    batch 1 does not fit at the plan's seq, the max seq (at batch 1) is searched when the seed says some seq fits
    (and ``shown``, default true; False: such a row is not shown, no ``--all``, and its verdict is cut short), or
    always with ``every`` (``plan --all``: from seq 2, one estimate when not even that fits)."""
    e, cap, mb, ms, gpu = job[:5]
    every, shown = len(job) > 5 and job[5], len(job) <= 6 or job[6]
    p = estimated_peak(e)
    ok = need(e, cap, exact=shown, gpu=gpu, replayed=True)[0]
    b = max_batch(e, cap, seed=mb if mb > 0 else None, anchored=True, gpu=gpu) if ok else 0
    if ok or (ms > 0 and shown):
        t = max_seq(e, cap, seed=ms if ms >= 2 else None, anchored=True, gpu=gpu)
    else:
        t = max_seq(e, cap, seed=2, gpu=gpu) if every else 0
    return p, b, t


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
    command: Optional[str] = None  # the `memcalc estimate` behind this row (memcalc.plan.rows)

    def as_dict(self, half: str) -> dict[str, Any]:
        d = self.technique.as_dict(half)
        d.update(peak_bytes=self.peak_bytes, required_bytes=self.required_bytes, fits=self.fits,
                 max_batch=self.max_batch, max_seq=self.max_seq,
                 relative_cost=None if self.relative_cost is None else round(self.relative_cost, 4),
                 confirmed=self.confirmed, command=self.command)
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
    techs = list(options) if options is not None else techniques()
    notes = []
    if profile.kernels == "liger":  # what memcalc.core.liger refuses: autocast, QLoRA; compile is not modelled with it
        techs = [t for t in techs if t.precision != "amp" and t.adapters != "qlora" and t.budget is None]
        notes.append("--kernels liger: AMP, QLoRA and torch.compile options are left out (not modelled with Liger)")
    if profile.kernels == "cce":  # what memcalc.core.cce refuses: fp32 and autocast, QLoRA, compile
        techs = [t for t in techs if t.precision not in ("amp", "fp32") and t.adapters != "qlora" and t.budget is None]
        notes.append("--kernels cce: fp32, AMP, QLoRA and torch.compile options are left out (not modelled with Cut "
                     "Cross-Entropy)")
    exps = [ExperimentSpec(name=f"{model.name} {t.key(half)}", model=model, profile=profile,
                           training=t.training(1, seq, half, model.attention_lora_targets)) for t in techs]
    if half == "fp16":
        notes.append(f"{getattr(gpu, 'display_name', gpu.name)} has no bf16: 16-bit options use fp16 (same memory)")
    search = _GpuSearch(model, techs, exps, int(gpu.capacity_bytes), seq, include_all, confirm, gpu)
    # 1. weights + optimizer state alone: options beyond the card cannot fit at any batch or seq;
    #    without --all, neither can options whose steady step at batch 1 does not fit.
    #    Compiled options are not fitted (see compile_techniques): they are estimated directly.
    # 2. the exact peak at batch 1 of the rest; fit those in (batch, seq), evaluate the whole grid
    #    at once, and confirm what is printed by direct estimates
    search.fitted(search.batch1_peaks(search.above_floor()))
    # 2b. compiled options: direct estimates, seeded with the same setup's eager fit
    search.compiled()
    # 3. options that cannot fit: exact batch-1 numbers only when all are shown
    if include_all:
        search.unfitting()
    return GpuPlan(model, gpu, seq, half, search.ranked(), search.evaluated, notes, considered=len(techs))


def _by_unfused(techs: Sequence[Technique], idx: Sequence[int]) -> list[list[int]]:
    """``idx`` in groups of an option and its fused twin (in ``idx``'s order): one job each, since
    the fused step is derived from the unfused one (memcalc.plan.steps)."""
    pairs: dict[Technique, list[int]] = {}
    for i in idx:
        pairs.setdefault(replace(techs[i], fused=False), []).append(i)
    return list(pairs.values())


@dataclass
class _GpuSearch:
    """One :func:`plan_gpu`: its options (``techs[i]`` planned as ``exps[i]``) and the results so far."""

    model: ModelSpec
    techs: list[Technique]
    exps: list[ExperimentSpec]
    cap: int
    seq: int
    include_all: bool
    confirm: bool
    gpu: Any  # the card: its GPU side counts in the required bytes (memcalc.estimate.peak.card_side)
    results: dict[int, OptionResult] = field(default_factory=dict)
    fit_of: dict[int, StepFit] = field(default_factory=dict)
    #: compiled option -> the fraction of its forward its partition recomputes (for the cost model)
    recompute: dict[int, float] = field(default_factory=dict)
    evaluated: int = 0  # options x batches x seqs evaluated by the vectorised search

    def required(self, i: int, peak: int, confirmed: bool) -> int:
        """Option ``i``'s device total at batch 1: confirmed, the estimate's (:func:`device_total`: its command's;
        a bound past the card for a row not shown), else its allocated ``peak``'s (reserved taken as allocated)."""
        e, side, lim = self.exps[i], card_side(self.exps[i], self.gpu), None if self.include_all else self.cap
        return device_total(e, side, lim) if confirmed else required_bytes(peak, side)

    def above_floor(self) -> list[int]:
        """The eager options whose weights and optimizer state alone fit the card."""
        return [i for i, e in enumerate(self.exps)
                if self.techs[i].budget is None and required_bytes(state_floor(e), card_side(e, self.gpu)) <= self.cap]

    def batch1_peaks(self, idx: list[int]) -> dict[int, Optional[int]]:
        """The exact peak at batch 1 of each option of ``idx`` (None: its steady step alone does not
        fit, without --all); an option and its fused twin in one job."""
        pairs = _by_unfused(self.techs, sorted(idx, key=lambda i: self.techs[i].fused))
        jobs = [[(self.exps[i], self.cap, self.include_all, self.gpu) for i in pair] for pair in pairs]
        b1: dict[int, Optional[int]] = {}
        heavy = lambda pair_jobs: not applies(pair_jobs[0][0])  # noqa: E731
        for pair, peaks in zip(pairs, parallel_map(_b1_peaks, jobs, heavy=heavy)):
            b1.update(zip(pair, peaks))
        return b1

    def fit_groups(self, b1: dict[int, Optional[int]]) -> dict[int, list[int]]:
        """The options with a batch-1 peak by the option fitted for them (:func:`fit_groups`), the
        fitted one first."""
        rep_of = fit_groups(self.techs, sorted(i for i in b1 if b1[i] is not None))
        groups: dict[int, list[int]] = {r: [r] for r in sorted(set(rep_of.values()))}
        for i in sorted(rep_of):
            if i != rep_of[i]:
                groups[rep_of[i]].append(i)
        return groups

    def fitted(self, b1: dict[int, Optional[int]]) -> None:
        """One fit per group of options that differ only in the fused step, evaluated on the grid
        and confirmed (:func:`_plan_group`): one job per option and its fused twin (they share
        simulated steps, memcalc.plan.steps), each with its group's fitted option (a worker fits it
        once for all the jobs it runs); jobs with full-depth steps first."""
        bs, ts = batch_grid(), seq_grid(self.model, self.seq)
        parts = [(r, pair) for r, g in self.fit_groups(b1).items() for pair in _by_unfused(self.techs, g)]
        jobs = [(self.exps[r], [self.exps[i] for i in pair], [b1[i] for i in pair], self.cap, self.seq, bs, ts,
                 self.confirm, self.include_all, self.gpu) for r, pair in parts]
        for (_, pair), (rows, n_eval) in zip(parts, parallel_map(_plan_group, jobs, heavy=lambda job: not all(
                applies(e) for e in job[1]))):
            self.evaluated += n_eval
            for i, (p, fits, mb, ms, done, fit) in zip(pair, rows):
                req = self.required(i, p, done)
                self.results[i] = OptionResult(self.techs[i], p, req, fits, mb, ms, None, done)
                self.fit_of[i] = fit

    def compiled(self) -> None:
        """The compiled options: direct estimates, seeded with the same setup's eager fit, scaled to
        the compiled step's own batch-1 peak (jobs whose eager setup fits first: their searches run
        the most estimates)."""
        idx = [i for i, t in enumerate(self.techs) if t.budget is not None]
        jobs = [(self.exps[i], self.cap, *_eager_seeds(self.techs[i], self.techs, self.results, self.fit_of), self.gpu)
                for i in idx]
        for i, (p, mb, ms, frac) in zip(idx, parallel_map(_confirm_compiled, jobs,
                                                          heavy=lambda job: job[2] > 0 or job[3] > 0)):
            req = self.required(i, p, True)
            r = OptionResult(self.techs[i], p, req, req <= self.cap, mb, ms, None, True)
            self.recompute[i] = frac
            if r.fits or self.include_all:
                self.results[i] = r

    def unfitting(self) -> None:
        """The exact batch-1 numbers of the eager options that were not fitted (``--all``)."""
        rest = [i for i, t in enumerate(self.techs) if i not in self.results and t.budget is None]
        for i, p in zip(rest, parallel_map(estimated_peak, [self.exps[i] for i in rest])):
            req = self.required(i, p, True)
            self.results[i] = OptionResult(self.techs[i], p, req, False, 0, 0, None, True)

    def ranked(self) -> list[OptionResult]:
        """The options shown (with --all every one), costed: fitting ones first, cheapest first."""
        for i, r in self.results.items():
            r.relative_cost = relative_cost(r.technique, self.model, self.seq, r.max_batch, self.recompute.get(i, 0.0))
        shown = [self.results[i] for i in sorted(self.results) if self.include_all or self.results[i].fits]
        shown.sort(key=lambda r: (not r.fits, r.relative_cost if r.relative_cost is not None else float("inf"),
                                  r.required_bytes))
        return shown


def _eager_seeds(t: Technique, techs: Sequence[Technique], results: dict[int, "OptionResult"],
                 fit_of: Optional[dict[int, StepFit]] = None) -> tuple[int, int, Optional[StepFit]]:
    """(max batch, max seq, fit) of the same setup without compile, when it was planned: a starting
    guess for the compiled option's search, which gallops from it to the exact answer (the fit,
    scaled to the compiled step's own batch-1 peak, gives a nearer one: :func:`_scaled_seeds`).
    Below budget 1.0 the partitioner recomputes most of each layer, so the eager setup with full
    checkpointing is the nearer guess (fewer galloping steps; the answer is the same)."""
    prefer = ("full", t.checkpoint) if t.budget is not None and t.budget < 1.0 else (t.checkpoint,)
    for ck in prefer:
        for j, u in enumerate(techs):
            if u.budget is None and (u.adapters, u.precision, u.optimizer, u.checkpoint, u.fused) == (
                    t.adapters, t.precision, t.optimizer, ck, t.fused) and j in results and (
                    results[j].fits or ck == prefer[-1]):
                return results[j].max_batch, results[j].max_seq, (fit_of or {}).get(j)
    return 0, 0, None


def _scaled(fit: StepFit, peak: int, seq: int, own: Optional[dict[str, int]] = None) -> StepFit:
    """``fit`` (another setup's) with what grows with batch and sequence scaled so that its peak at
    batch 1 and ``seq`` is ``peak``: for a setup that keeps the same weights and state but saves a
    different amount per token (sqrt segments against per-layer checkpointing, a compiled step
    against the eager one). With ``own`` (that setup's peak in each phase, from its batch-1 trace)
    phase by phase, a phase that hardly grows (the optimizer step) moved instead; else one factor
    for all rows. Only seeds."""
    f = bt_features(1, seq, fit.t_scale)
    if own is None:
        parts, targets = {"all": fit.coefficients}, {"all": peak}
    else:
        parts, targets = {k: c for k, c in fit.phases.items() if k in own}, own
    out: dict[str, np.ndarray] = {}
    for k, rows in parts.items():
        vals = rows @ f
        top = rows[int(np.argmax(vals))]
        at, grows = float(vals.max()), float(vals.max() - top[0])
        scaled = rows.copy()
        if grows > 0.01 * abs(at) and targets[k] > top[0]:
            scaled[:, 1:] *= (targets[k] - top[0]) / grows
        elif own is not None:
            scaled[:, 0] += targets[k] - at
        else:
            return fit
        out[k] = scaled
    return replace(fit, phases=out or fit.phases)


def _scaled_seeds(fit: StepFit, exp: ExperimentSpec, peak: int, cap: int, gpu: Any) -> tuple[int, int]:
    """(max batch at ``exp``'s seq, max seq at batch 1) by ``fit`` (another setup's: the same one
    without compile) with what grows with batch and sequence scaled so that its peak at batch 1
    is ``peak``, ``exp``'s own: compiled and eager steps keep the same weights and state, and
    their saved activations (a different set, the partitioner's) grow alike with the tokens.
    Only a seed: the searches are exact whatever it is."""
    seq = exp.training.seq
    stack = StackedFits.of([_scaled(fit, peak, seq)])
    one = np.ones(1)
    side = card_side(exp, gpu)
    # (largest_true_array gives lo - 1 where nothing fits: batch 0, seq 1)
    mb = int(largest_true_array(lambda b: required_bytes(stack.peaks_at(b, np.full(1, seq)), side) <= cap,
                                np.ones(1), np.full(1, BATCH_CAP))[0])
    ms = int(largest_true_array(lambda t: required_bytes(stack.peaks_at(one, t), side) <= cap,
                                np.full(1, 2), np.full(1, exp.model.max_seq_len))[0])
    return mb, (ms if ms >= 2 else 0)
