"""What ``memcalc plan --gpu`` prints of its search: the kinds of run asked for (``--lora`` / ``--qlora`` /
``--full``), rows deduplicated (a fused-step row whose numbers are its unfused twin's), and the
``memcalc estimate`` command behind every row, which gives exactly the row's numbers (the same
:class:`~memcalc.core.spec.TrainingSpec`: :meth:`memcalc.plan.options.Technique.training` at batch 1 and
the plan's sequence, on the plan's model and profile)."""

from __future__ import annotations

import shlex
from dataclasses import replace
from collections.abc import Sequence
from typing import Any, Optional

from memcalc.core.errors import UserError
from memcalc.core.units import gib
from memcalc.plan.options import Technique

#: --lora / --qlora / --full -> Technique.adapters
ADAPTER_FLAGS = {"full": "none", "lora": "lora", "qlora": "qlora"}


def adapter_kinds(full: bool, lora: bool, qlora: bool, gpu: Optional[str]) -> Optional[tuple[str, ...]]:
    """The ``Technique.adapters`` kept by ``--full`` / ``--lora`` / ``--qlora`` (several: their union), None
    when none is given. The multi-GPU plan (no ``--gpu``) has its own full and LoRA columns: refused there."""
    asked = [k for k, on in (("full", full), ("lora", lora), ("qlora", qlora)) if on]
    if not asked:
        return None
    if gpu is None:
        raise UserError(f"plan --{asked[0]} restricts the plan for one GPU to that kind of run; give --gpu too "
                        "(without --gpu, plan shows how many GPUs a full fine-tune and a LoRA run need)")
    return tuple(ADAPTER_FLAGS[k] for k in asked)


def keep_adapters(techs: Sequence[Technique], kinds: Optional[tuple[str, ...]]) -> list[Technique]:
    """``techs`` of these adapter kinds (all when ``kinds`` is None)."""
    return [t for t in techs if kinds is None or t.adapters in kinds]


def _numbers(o: Any) -> tuple:
    """What the table shows of a row: GiB to 2 decimals, fits, max batch and seq, cost to 2 decimals."""
    return (round(gib(o.peak_bytes), 2), round(gib(o.required_bytes), 2), o.fits, o.max_batch, o.max_seq,
            None if o.relative_cost is None else round(o.relative_cost, 2))


def dedup(options: Sequence[Any]) -> list[Any]:
    """``options`` (:class:`memcalc.plan.search.OptionResult`) less each fused-step row that shows the numbers
    of its unfused twin (two rows the table would print alike but for "fused"; the unfused one is kept: every
    framework runs it, while Hugging Face Trainer has no optimizer step in backward)."""
    by_tech = {o.technique: o for o in options}
    out = []
    for o in options:
        twin = by_tech.get(replace(o.technique, fused=False)) if o.technique.fused else None
        if twin is not None and _numbers(twin) == _numbers(o):
            continue
        out.append(o)
    return out


def estimate_command(t: Technique, half: str, seq: int, gpu: str, source: Sequence[str]) -> str:
    """The ``memcalc estimate`` command whose step is the plan row of ``t`` at batch 1 x ``seq`` on ``gpu``;
    ``source``: the plan's model and profile flags (``--model NAME``, ``--framework hf``, ...) as given."""
    args = ["memcalc", "estimate", *source, "--batch", "1", "--seq", str(seq), "--precision", t.precision_name(half)]
    if t.precision == "16+master":
        args.append("--master-weights")
    args += ["--optimizer", t.optimizer, "--checkpoint", t.checkpoint]
    if t.fused:
        args.append("--fused-optimizer")
    if t.adapters != "none":
        args.append(f"--{t.adapters}")
    if t.budget is not None:
        args.append("--compile")
        if t.budget != 1.0:
            args += ["--memory-budget", f"{t.budget:g}"]
    return shlex.join([*args, "--gpu", gpu])


#: the plan's flags that estimate takes as they are (the model's profile)
PROFILE_FLAGS = ("profile", "framework", "torch", "loss", "loss_chunks", "loss_tokens", "kernels")


def source_flags(values: dict[str, Any]) -> list[str]:
    """The plan's model (``--model`` or ``--params``) and the profile flags it was given (``values``: the
    plan's arguments, the recipe's filled in), as estimate flags."""
    model = values.get("model")
    out = ["--model", str(model)] if model is not None else ["--params", str(values.get("params"))]
    for key in PROFILE_FLAGS:
        if values.get(key) is not None:
            out += ["--" + key.replace("_", "-"), str(values[key])]
    return out


def with_commands(options: Sequence[Any], half: str, seq: int, gpu: str, values: dict[str, Any]) -> list[Any]:
    """``options``, each with its :func:`estimate_command` (``OptionResult.command``); ``values``: the plan's
    arguments (:func:`source_flags`)."""
    source = source_flags(values)
    return [replace(o, command=estimate_command(o.technique, half, seq, gpu, source)) for o in options]


def cluster_command(setup: str, layout: dict[str, int], checkpoint: str, seq: int, gpu: str, sharding: str,
                    source: Sequence[str]) -> str:
    """The ``memcalc estimate`` command whose step is the multi-GPU plan's ``setup`` (full / lora / qlora,
    :func:`memcalc.plan.cluster.cluster_setups`) in ``layout`` (``dp`` data-parallel ranks, ``tp`` with
    sequence parallelism or ``cp``: memcalc.plan.layouts.parallel) with ``checkpoint`` on ``gpu``: batch 1 x
    ``seq`` per GPU, bf16 (+ fp32 master weights for the full fine-tune), AdamW, ZeRO-3 by ``sharding``.
    --checkpoint is always given (estimate's own default differs by run: trainer_defaults.py)."""
    from memcalc.inputs.trainer_defaults import SHARDED_FULL_PRECISION, default_precision

    precision, master = SHARDED_FULL_PRECISION if setup == "full" else (default_precision(setup)[0], False)
    args = ["memcalc", "estimate", *source, "--batch", "1", "--seq", str(seq), "--precision", precision]
    if master:
        args.append("--master-weights")
    args += ["--optimizer", "adamw", "--checkpoint", checkpoint]
    if setup != "full":
        args.append(f"--{setup}")
    args += ["--zero", "3", "--gpus", str(layout["dp"]), "--sharding", sharding]
    if layout.get("cp", 1) > 1:
        args += ["--cp", str(layout["cp"])]
    elif layout["tp"] > 1:
        args += ["--tp", str(layout["tp"]), "--sequence-parallel"]
    return shlex.join([*args, "--gpu", gpu])


def cluster_commands(plan: Any, values: dict[str, Any]) -> Any:
    """``plan`` (:class:`memcalc.plan.cluster.ClusterPlan`) with each row's ``commands`` filled: per setup
    that fits, the :func:`cluster_command` of its layout and checkpointing; ``values``: the plan's arguments
    (:func:`source_flags`)."""
    source = source_flags(values)
    for r in plan.rows:
        r.commands = {s: None if r.layout.get(s) is None else half_command(
                          cluster_command(s, r.layout[s], str(r.checkpoint[s]), plan.seq, r.gpu.name, plan.sharding,
                                          source), r.gpu) for s in r.min_gpus}
    from memcalc.plan.pipelines import pipeline_command

    from memcalc.plan.experts import expert_command

    for pr in getattr(plan, "pipelines", []):
        if pr.layout is not None:
            pr.command = half_command(pipeline_command(plan.seq, pr.layout, pr.gpu.name, source), pr.gpu)
    for er in getattr(plan, "experts", []):
        if er.layout is not None:
            er.command = half_command(expert_command(plan.seq, er.layout, er.gpu.name, plan.sharding, source), er.gpu)
    no_bf16 = [r.gpu.name for r in plan.rows if getattr(r.gpu, "bf16", True) is False]
    note = f"{', '.join(no_bf16)}: no bf16; their rows' commands say fp16, what runs there (the same bytes)"
    if no_bf16 and note not in plan.notes:
        plan.notes.append(note)
    return plan


def half_command(command: str, gpu: Any) -> str:
    """``command`` for ``gpu``: on a card without bf16 (data/gpus.yaml ``bf16: false``: T4, V100) its
    ``--precision bf16`` is fp16, what runs there (memcalc.inputs.trainer_defaults.NO_BF16; the same bytes, so
    the row's peak is the command's to the byte)."""
    from memcalc.inputs.trainer_defaults import NO_BF16

    args = shlex.split(command)
    if getattr(gpu, "bf16", True) is not False or "--precision" not in args:
        return command
    i = args.index("--precision") + 1
    args[i] = NO_BF16.get(args[i], args[i])
    return shlex.join(args)
