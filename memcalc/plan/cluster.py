"""``memcalc plan --model M`` (:func:`plan_cluster`): for every GPU in the catalog, the fewest
GPUs for a full fine-tune, a LoRA and a QLoRA run at batch 1 per GPU (ZeRO-3 over N GPUs run by FSDP2,
:data:`SHARDING`: :mod:`memcalc.engine.fsdp`), fitted in N (:func:`memcalc.plan.fits.fit_gpus`)
and confirmed with direct estimates."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from memcalc.core.spec import ExperimentSpec, KernelProfile, LoraSpec, ModelSpec, TrainingSpec
from memcalc.estimate.peak import card_side, required_bytes, step_side
from memcalc.inputs.profiles import DEFAULT_PROFILE, get_profile
from memcalc.plan.fits import fit_gpus
from memcalc.plan.layouts import layout_probes, layout_setups, search_layouts
from memcalc.plan.limits import CONFIRM_MARGIN, Probe, fit_probe, need, smallest_by_value
from memcalc.plan.options import LORA_RANK, default_seq
from memcalc.plan.parallel import parallel_map
from memcalc.plan.experts import search_experts
from memcalc.plan.pipelines import search_pipelines
from memcalc.engine.timeline import first_step_within_steady
from memcalc.plan.simulations import estimated_peak, simulated_peak, state_floor, with_training

#: The catalog search for ``plan --model M`` (no --gpu) covers 1..GPU_CAP GPUs.
GPU_CAP = 1024
#: Where one GPU more lowers the fitted per-GPU requirement by less than this fraction of the card
#: (near the floor that sharding cannot divide), the next FLAT_SPAN counts are simulated ahead too.
FLAT = 0.002
FLAT_SPAN = 5
#: Whose sharding the counts assume (``TrainingSpec.sharding``), and in words (text and --json).
SHARDING = "fsdp2"
SHARDING_TEXT = ("FSDP2 (torch fully_shard per decoder layer and on the root, torchtitan-style): every parameter "
                 "sharded, each layer all-gathered for its forward and again for its backward (reshard after "
                 "forward), gradients reduce-scattered per layer; MixedPrecisionPolicy bf16 parameters / fp32 "
                 "reduce over fp32 shards for the full fine-tune")


#: the multi-GPU plan's setups (columns, and the ``*_full`` / ``*_lora`` / ``*_qlora`` keys of --json)
SETUPS = ("full", "lora", "qlora")


def cluster_setups(model: ModelSpec, seq: int, profile: KernelProfile) -> dict[str, dict[str, ExperimentSpec]]:
    """The three multi-GPU setups (per GPU: batch 1 x ``seq``), each with checkpointing none and full.

    full: ``--bf16 --master-weights`` (16 B/param: under FSDP2 fp32 shards, fp32 gradient shards and
    fp32 AdamW moments, bf16 all-gathers), ZeRO-3 over the GPUs run by FSDP2 (:data:`SHARDING`), no
    offload. lora: bf16 frozen base, rank-16 adapters on q,k,v,o, AdamW, ZeRO-3 (FSDP2, sharding the
    frozen base too) over the GPUs. qlora: the same with the base in 4-bit NF4 (``LoraSpec.qlora``: what
    ``estimate --qlora`` runs; FSDP2 shards the quantized base as it shards the bf16 one).
    """
    from memcalc.inputs.trainer_defaults import SHARDED_FULL_PRECISION, default_precision

    out: dict[str, dict[str, ExperimentSpec]] = {s: {} for s in SETUPS}
    full_precision, master = SHARDED_FULL_PRECISION  # (the precision policy: inputs/trainer_defaults.py)
    for ck in ("none", "full"):
        out["full"][ck] = ExperimentSpec(
            name=f"{model.name} full fine-tune", model=model, profile=profile,
            training=TrainingSpec(batch=1, seq=seq, precision=full_precision, master_weights=master, optimizer="adamw",
                                  zero=3, gpus=1, checkpoint=ck, sharding=SHARDING))
        out["lora"][ck] = ExperimentSpec(
            name=f"{model.name} LoRA", model=model, profile=profile,
            training=TrainingSpec(batch=1, seq=seq, precision=default_precision("lora")[0], optimizer="adamw",
                                  zero=3, gpus=1, checkpoint=ck, sharding=SHARDING,
                                  lora=LoraSpec(rank=LORA_RANK, targets=model.attention_lora_targets)))
        out["qlora"][ck] = ExperimentSpec(
            name=f"{model.name} QLoRA", model=model, profile=profile,
            training=TrainingSpec(batch=1, seq=seq, precision=default_precision("qlora")[0], optimizer="adamw",
                                  zero=3, gpus=1, checkpoint=ck, sharding=SHARDING,
                                  lora=LoraSpec(rank=LORA_RANK, qlora=True, targets=model.attention_lora_targets)))
    return out


def _smallest_n(one: bool, probe: Probe, seed: int, hi: int, cap: int) -> Optional[int]:
    """The smallest N in [1, hi] that fits: 1 when ``one`` (N = 1 has no gathered layer buffers, so
    it is checked on its own), else the smallest N in [2, hi] whose ``probe(N)`` fits
    (:func:`memcalc.plan.limits.smallest_by_value`); ``seed`` is the fitted answer."""
    return 1 if one else smallest_by_value(probe, 2, hi, cap, seed)


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
    layout: dict[str, Optional[dict]] = field(default_factory=dict)  # setup -> {"dp", "tp"} (plan/layouts.py)
    #: setup -> the ``memcalc estimate`` command of that count (None: none fits; memcalc.plan.rows.cluster_commands)
    commands: dict[str, Optional[str]] = field(default_factory=dict)
    #: setup -> the allocated peak at that count (what its command's estimate reports as peak_bytes)
    peak_bytes: dict[str, Optional[int]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.gpu.name, "display_name": getattr(self.gpu, "display_name", self.gpu.name),
                             "capacity_bytes": self.gpu.capacity_bytes}
        for s in SETUPS:
            n = self.min_gpus[s]
            d[f"min_gpus_{s}"] = n
            d[f"min_gpus_{s}_pow2"] = next_pow2(n)
            d[f"checkpoint_{s}"] = self.checkpoint[s]
            d[f"required_bytes_{s}"] = self.required_bytes[s]
            d[f"layout_{s}"] = self.layout.get(s)
            d[f"peak_bytes_{s}"] = self.peak_bytes.get(s)
            d[f"command_{s}"] = self.commands.get(s)
        return d


@dataclass
class ClusterPlan:
    model: ModelSpec
    seq: int
    rows: list[ClusterRow]
    params: int
    notes: list[str] = field(default_factory=list)
    sharding: str = SHARDING  # whose sharding the counts assume (TrainingSpec.sharding)
    sharding_text: str = SHARDING_TEXT
    #: per card, the fewest GPUs of a pipeline x tensor-parallel full fine-tune (memcalc.plan.pipelines)
    pipelines: list = field(default_factory=list)
    #: why no pipeline layout is listed (the model cannot be pipelined), else None
    pipelines_note: Optional[str] = None
    #: a mixture-of-experts model: per card, the fewest GPUs with expert parallelism (memcalc.plan.experts)
    experts: list = field(default_factory=list)
    #: why no expert-parallel layout is listed (experts that cannot be sharded), else None
    experts_note: Optional[str] = None


def plan_cluster(model: ModelSpec, seq: Optional[int] = None, profile: Optional[KernelProfile] = None,
                 gpus: Optional[Sequence[Any]] = None) -> ClusterPlan:
    """For each GPU, the fewest GPUs (1..GPU_CAP) for a full fine-tune, a LoRA and a QLoRA run (see
    :func:`cluster_setups`); checkpointing none when that fits at the count, else full. Every
    printed count and requirement is confirmed with direct estimates (the fits only seed the
    searches)."""
    from memcalc.inputs.gpus import list_gpus
    from memcalc.engine.params import count_params

    seq = default_seq(model, seq)
    profile = profile or get_profile(DEFAULT_PROFILE)
    cards = list(gpus) if gpus is not None else list_gpus()
    search = _ClusterSearch(cluster_setups(model, seq, profile))
    tp_fits, ones, top = search.fit(cards)
    search.presimulate(cards, tp_fits, ones, top)  # the counts the confirmation will ask about, in parallel
    rows = [search.row(g) for g in cards]
    search_layouts(rows, search.setups["full"], GPU_CAP, tp_fits)  # data x tensor parallel (plan/layouts.py)
    pipes, why = search_pipelines(search.setups["full"]["full"], cards)  # pipeline x tensor parallel
    experts, why_ep = search_experts(search.setups["full"]["full"], cards)  # expert parallel (MoE)
    return ClusterPlan(model, seq, rows, count_params(model).total, _notes(seq), pipelines=pipes, pipelines_note=why,
                       experts=experts, experts_note=why_ep)


def _notes(seq: int) -> list[str]:
    """What the counts assume, in words."""
    return [
        f"sharding: ZeRO-3 over N GPUs by {SHARDING_TEXT}; the root unit (embedding, final norm, head) is "
        "all-gathered whole on every GPU and the head's gradient waits for the end of backward, so a per-GPU floor "
        "remains however many GPUs",
        f"full fine-tune: bf16 compute with fp32 shards, gradient shards and AdamW moments (16 bytes/param over N), "
        f"no offload, batch 1 x seq {seq} per GPU, activation checkpointing none if it fits at that count, else full",
        f"LoRA: bf16 frozen base, rank {LORA_RANK} adapters on q,k,v,o, AdamW; FSDP2 shards the frozen base when one "
        f"GPU is not enough; checkpointing as above; QLoRA: the same over a 4-bit NF4 base (estimate --qlora)",
        "tp: the full fine-tune's count as dp x tp = FSDP2 (ZeRO-3) over dp = full / tp data-parallel ranks x tensor "
        "parallelism with sequence parallelism over tp (torchtitan's 2-D layout; tp 2/4/8, within a node), batch 1 "
        "per data-parallel rank (--json: layout_full); LoRA runs ZeRO-3 alone; cpN: dp x N GPUs with context "
        "parallelism (ring attention, seq / N tokens a GPU, ZeRO-3 over dp x N), tried from seq 16k",
        f"searched 1..{GPU_CAP} GPUs; the minimal integer count is exact (direct estimates); people rent powers of two "
        "and nodes of 8: --json gives the next power of two of each count (min_gpus_full_pow2, ...)",
    ]


@dataclass
class _ClusterSearch:
    """One :func:`plan_cluster`: its setups (``setups[setup][checkpointing]``), their fitted
    per-GPU requirement at every count, and its steps."""

    setups: dict[str, dict[str, ExperimentSpec]]
    #: setup -> checkpointing -> fitted required bytes at N = 1..GPU_CAP (NaN at N = 1: a different
    #: step, checked directly)
    req: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    ns: np.ndarray = field(default_factory=lambda: np.arange(1, GPU_CAP + 1))

    def fit(self, cards: Sequence[Any]) -> tuple[dict, list, int]:
        """The fits in N of the four setups and of the full fine-tune at each tensor-parallel degree
        (plan/layouts.py), in one parallel map; with them, the one-GPU steps the searches check first
        (they need no fit): they fill the workers' idle time at the end of the fits. Returns the
        tensor-parallel fits, the one-GPU jobs and the largest card's bytes."""
        keys = [(s, ck) for s, cks in self.setups.items() for ck in cks]
        tp_exps = layout_setups(self.setups["full"]["full"])
        fit_exps = [self.setups[s][ck] for s, ck in keys] + tp_exps
        top = max(int(g.capacity_bytes) for g in cards)
        ones = sorted({(with_training(e, gpus=1), False, top) for e in fit_exps},
                      key=lambda j: (j[0].name, j[0].training.tp, j[0].training.checkpoint))
        got = parallel_map(_fit_or_simulate_job, [("fit", e) for e in fit_exps] + [("simulate", j) for j in ones],
                           heavy=lambda j: j[0] == "fit")
        self.req = {s: {} for s in self.setups}
        for (s, ck), f in zip(keys, got[:len(keys)]):
            self.req[s][ck] = f.required(self.ns)
        return dict(zip(tp_exps, got[len(keys):len(fit_exps)])), ones, top

    def fits_at(self, s: str, ck: str, n: int, g: Any) -> bool:
        """Whether setup ``s`` with checkpointing ``ck`` fits card ``g`` at ``n`` GPUs (a direct estimate, on the
        card's own GPU side: :func:`memcalc.plan.limits.need`)."""
        return need(with_training(self.setups[s][ck], gpus=n), int(g.capacity_bytes), gpu=g)[0]

    def seed_of(self, s: str, cap: int) -> Optional[int]:
        """The fitted fewest N >= 2 of setup ``s`` with checkpointing full (None: none up to GPU_CAP)."""
        ok = self.req[s]["full"][1:] <= cap
        return int(self.ns[1:][ok][0]) if ok.any() else None

    def presimulate(self, cards: Sequence[Any], tp_fits: dict, ones: list, top: int) -> None:
        """Simulate the counts the confirmation will ask about, in parallel: (the first step only
        where it can set the peak: otherwise one job per step, not two; a step whose weights and
        state alone exceed every card is not simulated, decided in the worker)."""
        jobs: set[tuple[ExperimentSpec, bool]] = set()
        for g in cards:
            for s in self.setups:
                jobs |= self._confirm_jobs(s, int(g.capacity_bytes))
        jobs |= layout_probes(self.setups["full"], {int(g.capacity_bytes): self.seed_of("full", int(g.capacity_bytes))
                                                    for g in cards}, GPU_CAP, tp_fits)
        todo = {(e, both and not first_step_within_steady(e), top) for e, both in jobs} - set(ones)
        parallel_map(_simulate_job, sorted(todo, key=lambda j: (j[0].training.gpus, j[0].name, j[1])))

    def _confirm_jobs(self, s: str, cap: int) -> set[tuple[ExperimentSpec, bool]]:
        """The steps (and whether the first step too) that confirming setup ``s`` on ``cap`` will
        estimate: one GPU, the fitted count and the one below, and checkpointing none at the count."""
        by_ck, r = self.setups[s], self.req[s]
        jobs = {(with_training(by_ck["full"], gpus=1), False), (with_training(by_ck["none"], gpus=1), False)}
        n = self.seed_of(s, cap)
        if n is None:  # the search starts from the most GPUs
            return jobs | {(with_training(by_ck["full"], gpus=GPU_CAP), False)}
        if n > 2:
            jobs.add((with_training(by_ck["full"], gpus=n - 1), False))
        jobs.add((with_training(by_ck["full"], gpus=n), True))
        if n > 2 and r["full"][n - 1] - r["full"][n] < FLAT * cap:
            # near the per-GPU floor one GPU more moves the requirement so little that the
            # fitted count is a few off: the counts just above it too
            jobs |= {(with_training(by_ck["full"], gpus=k), False) for k in range(n + 1, min(n + FLAT_SPAN, GPU_CAP) + 1)}
        if r["none"][n - 1] <= cap:
            jobs.add((with_training(by_ck["none"], gpus=n), True))
        return jobs

    def row(self, g: Any) -> ClusterRow:
        """Card ``g``'s row: per setup the fewest GPUs, the checkpointing and the required bytes there."""
        mins: dict[str, Optional[int]] = {}
        cks: dict[str, Optional[str]] = {}
        reqs: dict[str, Optional[int]] = {}
        peaks: dict[str, Optional[int]] = {}
        for s, by_ck in self.setups.items():
            n = mins[s] = self.fewest(s, g)
            if n is None:
                cks[s], reqs[s], peaks[s] = None, None, None
                continue
            ck = cks[s] = self.checkpointing(s, n, g)
            e = with_training(by_ck[ck], gpus=n)
            peaks[s] = estimated_peak(e)
            reqs[s] = required_bytes(peaks[s], card_side(e, g))  # the card's own GPU side
        return ClusterRow(g, mins, cks, reqs, peak_bytes=peaks)

    def fewest(self, s: str, g: Any) -> Optional[int]:
        """The fewest N with checkpointing full (the frugal one) on card ``g``: fitted, then exact."""
        cap = int(g.capacity_bytes)
        seed = self.seed_of(s, cap)
        probe = fit_probe(lambda k, e=self.setups[s]["full"]: with_training(e, gpus=int(k)), cap, gpu=g)
        return _smallest_n(self.fits_at(s, "full", 1, g), probe, seed or GPU_CAP, GPU_CAP, cap)

    def checkpointing(self, s: str, n: int, g: Any) -> str:
        """Checkpointing none if it fits at that count too (fitted; checked directly near the line),
        else full."""
        cap = int(g.capacity_bytes)
        if n == 1 or abs(self.req[s]["none"][n - 1] - cap) <= CONFIRM_MARGIN * cap:
            none_fit = self.fits_at(s, "none", n, g)
        else:
            none_fit = bool(self.req[s]["none"][n - 1] <= cap)
        return "none" if none_fit else "full"


def _fit_gpus_job(exp: ExperimentSpec):
    return fit_gpus(exp, GPU_CAP)


def _fit_or_simulate_job(job: tuple[str, Any]):
    """A job of the first stage: a fit in N (``("fit", experiment)``) or a step to simulate
    (``("simulate", (experiment, first step too, bytes))``, :func:`_simulate_job`)."""
    kind, arg = job
    return _fit_gpus_job(arg) if kind == "fit" else _simulate_job(arg)


def _simulate_job(job: tuple[ExperimentSpec, bool, int]) -> None:
    """Simulate the steady step (and the first step too when ``job[1]``) into the peak cache, unless
    its weights and state alone exceed ``job[2]`` bytes (every card)."""
    exp, both, top = job
    if required_bytes(state_floor(exp), step_side(exp)) > top:
        return
    if both:
        estimated_peak(exp)  # (the first step only where it can set the peak)
    else:
        simulated_peak(exp)
