"""``estimate``'s "to make it fit": when a setup does not fit a card, the smallest changes that do.

A handful of candidate setups, never the plan's grid: each is one change a user makes with a flag
(``--checkpoint full``, a smaller ``--batch``, ``--optimizer adamw-8bit``, a shorter ``--seq``,
``--offload-optimizer``, ``--gpus N --zero 3``, ``--lora`` / ``--qlora``), tried in that order (the
setup's own method first: recomputation, fewer sequences per step, a smaller optimizer state,
shorter sequences, host traffic, more GPUs; then a different method), and, when no single change
fits, the same changes on top of ``--checkpoint full``. Each candidate is resolved from the flags
exactly as ``memcalc estimate`` resolves its command line (``exp_of``), so the command printed gives
the same bytes. It is estimated (the simulation stopped as soon as it passes the card: an exact
screen, :func:`_first_fit`) and judged by the estimate's own verdict (``verdict``:
:func:`memcalc.render.report.fits_rows`, the one place that decides "fits"), whose bytes are the
ones shown (no numpy, no plan search: only what ``memcalc estimate`` loads). A batch or sequence is
halved until it fits (round numbers, at most :data:`HALVINGS` tries); more GPUs are 2, 4, ..., 64
(:data:`GPU_COUNTS`).
"""

from __future__ import annotations

import contextlib
import io
import shlex
from dataclasses import dataclass
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Optional

from memcalc.core.errors import UserError
from memcalc.core.spec import ExperimentSpec
from memcalc.engine.observers import PeakAbove
from memcalc.estimate.peak import card_side, estimate, largest_peak_within

#: how many changes are listed per card: the smallest one. Each is confirmed by a full estimate with its
#: allocator replay, and a second one cost estimate about 0.15 s of CPU more, past its 0.5 s budget
#: (benchmarks/bench_estimate.py); ``memcalc plan`` lists the others
SHOWN = 1
#: a batch or sequence is halved at most this many times
HALVINGS = 4
#: the shortest sequence suggested
MIN_SEQ = 128
#: GPU counts tried for ``--gpus N --zero 3``
GPU_COUNTS = (2, 4, 8, 16, 32, 64)
#: optimizers whose state an 8-bit AdamW quarters (bitsandbytes AdamW8bit: two 1-byte moments)
ADAM_FAMILY = ("adamw", "adam")

#: options with no command-line flag: a setup given with them gets no command
_NO_FLAG = ("liger_ops",)


@dataclass(frozen=True)
class Remedy:
    """A change that makes the setup fit ``gpu``: its options (API keywords), its allocated peak and
    the card's device total (the estimate's ``fits_rows``), the headroom left, and the
    ``memcalc estimate`` command that shows it."""

    gpu: str
    change: dict[str, Any]
    peak_bytes: int
    device_total_bytes: int
    headroom_bytes: int
    command: Optional[str]

    @property
    def flags(self) -> str:
        """The change as flags, e.g. ``--checkpoint full --seq 1024``."""
        return " ".join(_flag_words(self.change))

    def as_json(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "flags": self.flags, "change": dict(self.change), "peak_bytes": self.peak_bytes,
                "device_total_bytes": self.device_total_bytes, "headroom_bytes": self.headroom_bytes,
                "command": self.command}


def _flag_words(options: Mapping[str, Any]) -> list[str]:
    """Options (API keywords) as command-line words: True a bare flag, a list repeated."""
    words: list[str] = []
    for name, v in options.items():
        flag = "--" + name.replace("_", "-")
        if v is None or v is False:
            continue
        if v is True:
            words.append(flag)
        elif isinstance(v, (list, tuple)):
            for x in v:
                words += [flag, str(x)]
        else:
            words += [flag, f"{v:g}" if isinstance(v, float) else str(v)]
    return words


def gpu_word(gpu: Any) -> str:
    """What ``--gpu`` takes to name ``gpu`` again: its catalog name, or for a card given as a capacity
    the capacity as typed (``23.99GiB``: the card's name, ``23-99gib``, is no ``--gpu`` value;
    :func:`memcalc.inputs.gpus.capacity_gpu` keeps it in ``GPU.given_as``)."""
    given = getattr(gpu, "given_as", None)
    return str(given) if given else str(gpu.name)


def command(options: Optional[Mapping[str, Any]], change: Mapping[str, Any], gpu: str) -> Optional[str]:
    """``memcalc estimate`` with ``options`` (the API keywords a setup was given with), ``change``
    on top (replacing what it sets) and ``--gpu gpu``; None where the setup has no command line
    (a spec, a config dict, an option without a flag)."""
    if options is None or any(options.get(k) is not None for k in _NO_FLAG):
        return None
    if not all(v is None or isinstance(v, (str, int, float, bool, list, tuple)) for v in options.values()):
        return None
    merged = {**{k: v for k, v in options.items() if k not in change}, **change}
    return " ".join(["memcalc", "estimate", *(shlex.quote(w) for w in _flag_words(merged)), "--gpu", shlex.quote(gpu)])


def _singles(exp: ExperimentSpec) -> Iterator[list[dict[str, Any]]]:
    """The single changes that apply to ``exp``, in the order they are preferred; each a list of
    alternatives tried in turn (the first that fits is the change: halvings, GPU counts)."""
    tr = exp.training
    if tr.checkpoint != "full" and not tr.compile:
        yield [{"checkpoint": "full"}]
    if tr.batch > 1:
        yield [{"batch": b} for b in _halvings(tr.batch, 1)]
    if tr.lora is None and tr.optimizer in ADAM_FAMILY:
        yield [{"optimizer": "adamw-8bit"}]
    if tr.seq > MIN_SEQ:
        yield [{"seq": t} for t in _halvings(tr.seq, MIN_SEQ)]
    if tr.lora is None and not tr.offload_optimizer:
        yield [{"offload_optimizer": True}]
    if tr.gpus == 1 and tr.tp == 1:
        yield [{"gpus": n, "zero": 3} for n in GPU_COUNTS]
    if tr.lora is None:
        yield [{"lora": True}]
    if tr.lora is None or not tr.lora.qlora:
        yield [{"qlora": True}]


def _halvings(x: int, lo: int) -> list[int]:
    out: list[int] = []
    while len(out) < HALVINGS and x // 2 >= lo:
        x //= 2
        out.append(x)
    return out


#: the estimate's verdict on one card: (estimate, card) -> its ``fits_rows`` row (fits, device_total_bytes,
#: headroom_bytes)
Verdict = Callable[[Any, Any], Mapping[str, Any]]


def to_make_it_fit(exp: ExperimentSpec, gpu: Any, exp_of: Callable[[dict[str, Any]], ExperimentSpec],
                   verdict: Verdict, options: Optional[Mapping[str, Any]] = None) -> list[Remedy]:
    """Up to :data:`SHOWN` changes that make ``exp`` fit ``gpu`` (a catalog card), smallest first:
    single changes, else each on top of ``--checkpoint full``. ``exp_of(change)`` is the setup with
    that change (resolved as the command line would be); ``options`` the setup's own keywords, for
    the commands."""
    found: list[Remedy] = []
    singles = list(_singles(exp))
    levels = [singles]
    if exp.training.checkpoint != "full" and not exp.training.compile:
        levels.append([[{"checkpoint": "full", **c} for c in alts] for alts in singles[1:]])
    for level in levels:
        for alts in level:
            got = _first_fit(alts, gpu, exp_of, verdict)
            if got is not None:
                change, peak, row = got
                found.append(Remedy(gpu.name, change, peak, row["device_total_bytes"], row["headroom_bytes"],
                                    command(options, change, gpu_word(gpu))))
                if len(found) == SHOWN:
                    return found
        if found:
            return found
    return found


def _first_fit(alts: list[dict[str, Any]], gpu: Any, exp_of: Callable[[dict[str, Any]], ExperimentSpec],
               verdict: Verdict) -> Optional[tuple[dict[str, Any], int, Mapping[str, Any]]]:
    """The first of ``alts`` that fits ``gpu``, with its peak and the estimate's verdict row; a change
    the inputs refuse (a flag that does not go with the setup) is skipped. Each is estimated with the
    simulation stopped as soon as its running total passes what the card can hold
    (:func:`memcalc.estimate.peak.largest_peak_within` on the card's own side: the device total is at
    least the allocated peak plus the workspaces, context and NCCL buffers), and its allocator replay as
    soon as it reserves more than that (the device total is the reserved peak plus those), so a change
    that does not fit costs part of one simulation, or one simulation and part of a replay, and never
    the verdict's replay with the card's capacity (``fits_after_cache_release``: only for a step that
    does not fit)."""
    for change in alts:
        try:
            e = exp_of(change)
        except (UserError, ValueError):
            return None
        try:
            est = estimate(e, timeline=False, replay=True, flops=False,
                           stop_above=largest_peak_within(int(gpu.capacity_bytes), card_side(e, gpu)))
        except PeakAbove:
            continue
        except UserError:  # refused by the engine's own checks (LoRA under --tp / --ep): not a change for this setup
            return None
        row = verdict(est, gpu)
        if row["fits"]:
            return change, est.peak_bytes, row
    return None


#: at most this many cards get their own changes (each is a few simulations)
MAX_CARDS = 3


def remedies_for(exp: ExperimentSpec, cards: Sequence[Any], fits: Mapping[str, bool], asked: bool,
                 exp_of: Optional[Callable[[dict[str, Any]], ExperimentSpec]], verdict: Verdict,
                 options: Optional[Mapping[str, Any]] = None) -> dict[str, list[Remedy]]:
    """Card name -> the changes that make ``exp`` fit it, for the cards it does not fit (``fits``:
    the estimate's verdict per card): every card asked for (``asked``: ``--gpu``; the first
    :data:`MAX_CARDS`); of the catalog, only when no card fits, the largest (``verdict``: the estimate's
    verdict on a card, :data:`Verdict`). ``exp_of`` resolves a
    change with the setup's options (the notes it writes on stderr were written once, for the setup
    itself, and are dropped); None (a spec given as such): the change is made to its training fields."""
    short = [g for g in cards if not fits[g.name]]
    if not asked:
        short = [max(cards, key=lambda g: g.capacity_bytes)] if short and len(short) == len(cards) else []
    if not short:
        return {}
    if exp_of is None:
        exp_of, options = _training_change(exp), None
    quiet = _quietly(exp_of)
    return {g.name: to_make_it_fit(exp, g, quiet, verdict, options) for g in short[:MAX_CARDS]}


def _quietly(exp_of: Callable[[dict[str, Any]], ExperimentSpec]) -> Callable[[dict[str, Any]], ExperimentSpec]:
    def run(change: dict[str, Any]) -> ExperimentSpec:
        with contextlib.redirect_stderr(io.StringIO()):
            return exp_of(change)
    return run


#: the changes a spec's own training fields take (a spec has no flags: LoRA is not added to it)
_TRAINING_CHANGES = ("checkpoint", "batch", "seq", "optimizer", "offload_optimizer", "gpus", "zero")


def _training_change(exp: ExperimentSpec) -> Callable[[dict[str, Any]], ExperimentSpec]:
    def run(change: dict[str, Any]) -> ExperimentSpec:
        if set(change) - set(_TRAINING_CHANGES):
            raise UserError(f"a spec takes no {', '.join(sorted(set(change) - set(_TRAINING_CHANGES)))} change")
        tr = exp.training.model_validate({**exp.training.model_dump(), **change})
        return exp.model_copy(update={"training": tr})
    return run


__all__ = ["Remedy", "command", "remedies_for", "to_make_it_fit"]
