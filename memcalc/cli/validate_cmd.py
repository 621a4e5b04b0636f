"""``memcalc validate``: run the step on CUDA or trace it on the meta device, beside the estimate.

The only command that imports :mod:`memcalc.validate` (torch), lazily
(``tests/unit/test_layering.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Annotated, Any, Optional

import typer

from memcalc.cli.group import app
from memcalc.cli.options import (Reentrant, GaloreRank, Quant, ActivationOffload, AdapterConfig, Batch, Bf16,
                                 Checkpoint, Compile,
                                 CompileScope, Deepspeed, BnbSavesInput, Dora, ModulesToSave,
                                 FusedOptimizer, GradAccum, Json, Kernels, Lora, LoraAlpha, LoraDropout, LoraRank,
                                 LoraTargets, Loss, LossChunks,
                                 LossTokens, MasterWeights, MemoryBudget, Model, Optimizer, OptimizerImpl, Params,
                                 Precision, Profile, Qlora, Recipe, Seq, Ep, EpCapacityFactor, SequenceParallel, Tp,
                                 Pp, PpSchedule, PpStagesPerRank, PpFirstLess, PpLastLess,
                                 Microbatches, FirstSeq, NoDoubleQuant,
                                 _check_output, inputs_of,
                                 Force, Cp, CpMethod)
from memcalc.core.choices import FRAMEWORKS, TRACED_FRAMEWORKS
from memcalc.core.errors import UserError


@app.command()
def validate(
    config: Annotated[Optional[list[str]], typer.Option(
        "--config", "-c", metavar="<str>", help="Reference config name or file (repeatable).")] = None,
    all_configs: Annotated[bool, typer.Option("--all", help="Every shipped reference config.")] = False,
    model: Model = None, params: Params = None, batch: Batch = None, seq: Seq = None, grad_accum: GradAccum = None,
    precision: Precision = None, bf16: Bf16 = False, master_weights: MasterWeights = False, optimizer: Optimizer = None,
    optimizer_impl: OptimizerImpl = None,
    galore_rank: GaloreRank = None, checkpoint: Checkpoint = None, reentrant: Reentrant = False,
    fused_optimizer: FusedOptimizer = False,
    compile: Compile = False, memory_budget: MemoryBudget = None,
    compile_scope: CompileScope = None, lora: Lora = False, lora_rank: LoraRank = None,
    lora_alpha: LoraAlpha = None, lora_targets: LoraTargets = None, lora_dropout: LoraDropout = None,
    qlora: Qlora = False,
    quant: Quant = None, profile: Profile = None, loss: Loss = None, loss_chunks: LossChunks = None,
    loss_tokens: LossTokens = None,
    kernels: Kernels = None,
    recipe: Recipe = None, adapter_config: AdapterConfig = None, deepspeed: Deepspeed = None, tp: Tp = None,
    ep: Ep = None, ep_capacity_factor: EpCapacityFactor = None,
    cp: Cp = None, cp_method: CpMethod = None,
    sequence_parallel: SequenceParallel = False,
    pp: Pp = None, pp_schedule: PpSchedule = None, microbatches: Microbatches = None,
    pp_stages_per_rank: PpStagesPerRank = None, pp_first_stage_less_layers: PpFirstLess = None,
    pp_last_stage_less_layers: PpLastLess = None,
    first_seq: FirstSeq = None,
    device: Annotated[Optional[str], typer.Option(
        "--device", help="cuda | meta | cpu (default: cuda when available, else meta).")] = None,
    scale_layers: Annotated[Optional[int], typer.Option(
        "--scale-layers", help="Trace with only this many layers (quick runs).")] = None,
    output: Annotated[Optional[str], typer.Option(
        "--output", "-o", help="Write records to this JSON file as each one finishes.")] = None,
    snapshot: Annotated[Optional[str], typer.Option(
        "--snapshot", help="Write the measured step as a PyTorch memory snapshot here (open it at "
                           "pytorch.org/memory_viz, or give it to `memcalc compare`): on CUDA torch's own "
                           "_dump_snapshot; on meta/cpu the tracer's allocations replayed through the caching "
                           "allocator model, labelled with memcalc's kinds (the replica and --framework hf).")] = None,
    as_json: Json = False, activation_offload: ActivationOffload = False, dora: Dora = False,
    modules_to_save: ModulesToSave = None,
    bnb_saves_input: BnbSavesInput = False,
    no_double_quant: NoDoubleQuant = False,
    html: Annotated[Optional[str], typer.Option(
        "--html", help="Also write a self-contained HTML report (predicted vs measured) to this file.")] = None,
    force: Force = False,
    framework: Annotated[Optional[str], typer.Option(
        "--framework", metavar="<" + "|".join(FRAMEWORKS) + ">",
        help="Whose step is traced, and whose rules the estimate beside it uses: plain (memcalc's PyTorch replica "
             "of the model), hf (the real transformers + PEFT step: AutoModelForCausalLM.from_config, "
             "get_peft_model, only kernel dispatch patched) or torchtune (its builders, loss and "
             "recipe step). Default: as for estimate, plain for a --config, "
             "hf for --model and --params.")] = None,
    gpus: Annotated[Optional[int], typer.Option(
        "--gpus",
        help="Trace one rank of N GPUs (with --zero 2|3): the sharded step runs in one process on PyTorch's fake "
             "process group, fake tensors (--device meta or cpu; nothing is allocated); memcalc's replica unless "
             "--framework hf (FSDP2, or FSDP1 with PEFT's wrap policy).")] = None,
    zero: Annotated[Optional[int], typer.Option(
        "--zero", help="With --gpus: 3 reshards parameters after forward (FSDP2 reshard_after_forward=True, "
                       "FSDP1 FULL_SHARD), 2 keeps them until backward (False, SHARD_GRAD_OP).")] = None,
    sharding: Annotated[Optional[str], typer.Option(
        "--sharding", help="With --gpus: fsdp2 (default; fully_shard per layer and root), fsdp1 "
                           "(FullyShardedDataParallel, one unit per layer) or deepspeed (ZeRO-2/3 with "
                           "DeepSpeed's defaults, or the buckets of --deepspeed).")] = None,
    rank: Annotated[Optional[int], typer.Option("--rank", help="With --gpus: which rank to trace (default 0).")] = None,
    protocol: Annotated[bool, typer.Option(
        "--protocol", help="Run the one-command GPU protocol (docs/protocol.md): the reference configs, HF LoRA "
                           "and QLoRA, torch.compile with a memory budget, the chunked loss, the Trainer callback, "
                           "the allocator, cuBLAS workspace and CUDA context, each predicted vs measured; --output "
                           "is then a folder (default data/reference/measured/ on CUDA). --device meta runs it "
                           "traced.")] = False,
    case: Annotated[Optional[list[str]], typer.Option(
        "--case", metavar="<str>", help="With --protocol: run only this case (repeatable; e.g. to rerun the ones "
                                        "a run skipped for time). Default: all, in the protocol's order.")] = None,
) -> None:
    """Run the real training step (CUDA) or trace it on the meta device, and compare with the estimate.

    Examples:

    \b
      memcalc validate --config fused --device meta --scale-layers 2
      memcalc validate --all --device meta --scale-layers 1 --output results.json
      memcalc validate --model llama-2-7b --batch 2 --seq 1024 --bf16 --checkpoint full --device meta --scale-layers 4
      memcalc validate --framework hf --model mistral-7b --bf16 --lora --device meta --scale-layers 2
      memcalc validate --model gpt2 --deepspeed examples/ds_zero2.json --gpus 8 --seq 256 --scale-layers 1
      memcalc validate --framework plain --model llama-2-7b --bf16 --master-weights --gpus 8 --zero 3 --scale-layers 2
      memcalc validate --framework plain --model llama-3.1-8b --bf16 --tp 4 --sequence-parallel --scale-layers 2
    """
    inputs = inputs_of(locals(), _OWN)  # first: locals() are the options only until the next name is bound
    if protocol:
        given = [k for k, v in inputs.items() if v not in (None, False, ())]
        given += [k for k, v in (("config", config), ("all", all_configs), ("scale_layers", scale_layers),
                                 ("snapshot", snapshot), ("html", html), ("framework", framework), ("gpus", gpus),
                                 ("zero", zero), ("sharding", sharding), ("rank", rank))
                  if v not in (None, False, ())]
        return _protocol(device, output, as_json, given, case)
    if case:
        raise UserError("--case selects the cases of --protocol: add --protocol")
    from memcalc.core.aliases import canonical, notes_held

    with notes_held():  # the notes written once the inputs are taken: a refusal after an alias is one line
        # the users' spellings (transformers, bfloat16, 4k) as memcalc's names, a note each, before torch loads
        inputs = canonical({**inputs, "framework": framework})
        framework = inputs.pop("framework")
        import memcalc.api

        _check_flags(device, framework, scale_layers)
        for path, flag in ((output, "--output"), (html, "--html"), (snapshot, "--snapshot")):
            _check_output(path, flag, force)
        framework = _sharded(device, framework, gpus, zero, sharding, rank, deepspeed, ep)
        run_validate = _runner(as_json)
        items = memcalc.api.experiments(config or (), all_configs=all_configs, framework=framework, zero=zero,
                                        gpus=gpus, sharding=sharding, **inputs)
    records = run_validate(items, device, as_json, output, scale_layers, snapshot, framework=_traced(items),
                           rank=rank or 0)
    if html is not None:
        from memcalc.render.html import validate_html, write_report

        # the estimates' timelines are of the full model: left out when tracing fewer layers
        ests = ({n: memcalc.api.estimate(e).estimate for n, e in items if not isinstance(e, Exception)}
                if scale_layers is None else None)
        write_report(html, validate_html(list(records or []), ests))


def _check_flags(device: Optional[str], framework: Optional[str], scale_layers: Optional[int]) -> None:
    """validate's own flags, checked before torch loads."""
    from memcalc.core.spec import MAX_LAYERS

    if device is not None and device not in ("cuda", "meta", "cpu"):
        raise UserError(f"unknown --device {device!r}; valid: cuda, meta, cpu")
    if framework == "unsloth":
        from memcalc.core.unsloth import UNTRACED

        raise UserError(UNTRACED)
    if framework is not None and framework not in TRACED_FRAMEWORKS:
        raise UserError(f"--framework {framework}: validate traces {', '.join(TRACED_FRAMEWORKS)} "
                        f"(not yet {framework}; estimate models it from its sources)")
    if scale_layers is not None and scale_layers <= 0:
        raise UserError(f"--scale-layers must be positive, got {scale_layers}")
    if scale_layers is not None and scale_layers > MAX_LAYERS:
        raise UserError(f"--scale-layers {scale_layers:,} is more than {MAX_LAYERS:,}, "
                        "the most layers a model may have")


def _sharded(device: Optional[str], framework: Optional[str], gpus: Optional[int], zero: Optional[int],
             sharding: Optional[str], rank: Optional[int], deepspeed: Optional[str],
             ep: Optional[int] = None) -> Optional[str]:
    """The sharded flags checked; the framework traced (plain for a sharded trace unless --framework
    hf is given)."""
    if ep is None or ep == 1:  # --ep traces its own data-parallel ranks (validate/sharded/expert_parallel.py)
        _check_sharded_flags(gpus, zero, sharding, rank, deepspeed)
    if (gpus is not None and gpus > 1) or deepspeed is not None:  # (DeepSpeed: its engine on one rank too)
        if device == "cuda" and not (gpus or 1) > 1:
            raise UserError("--deepspeed --device cuda: validate traces DeepSpeed's engine as one rank on the fake "
                            "process group; use --device meta")
        if device == "cuda":
            raise UserError(f"--gpus {gpus} --device cuda: validate runs one process and cannot measure {gpus} ranks "
                            "on CUDA; trace one rank with --device meta")
        if framework is None:  # the sharded trace builds the replica unless --framework hf is given
            framework = "plain"
    return framework


def _runner(as_json: bool) -> Callable[..., Any]:
    """``memcalc.validate.command.run_validate``, imported (torch: seconds) so that a signal
    meanwhile stops cleanly, and torch missing is one line."""
    from memcalc.validate.interrupt import StopRequested, stoppable, stopped  # torch-free

    with stoppable():
        try:
            from memcalc.validate.command import run_validate
        except ImportError as e:  # torch missing
            raise UserError(f"validate needs torch: pip install 'memcalc[validate]' ({e})") from None
        except StopRequested as e:
            stopped(e)
            sys.stderr.write(f"memcalc validate: stopped by {e} before any config ran\n")
            sys.stdout.write("[]\n" if as_json else "")
            raise SystemExit(e.exit_code) from None
    return run_validate


def _traced(items: list) -> str:
    """The one framework the experiments trace, one of TRACED_FRAMEWORKS (UserError otherwise)."""
    traced = {e.profile.framework for _, e in items if not isinstance(e, UserError)} or {"plain"}
    if not traced <= set(TRACED_FRAMEWORKS) or len(traced) > 1:
        raise UserError(f"validate traces one framework per run, one of {', '.join(TRACED_FRAMEWORKS)}; these "
                        f"experiments use {', '.join(sorted(traced))}: pass --framework with one of them")
    for flag in ("tp", "pp"):
        if "hf" in traced and any(not isinstance(e, UserError) and getattr(e.training, flag) > 1 for _, e in items):
            raise UserError(f"--{flag} traces memcalc's replica under torchtitan's plan: pass --framework plain")
    if traced != {"plain"} and any(not isinstance(e, UserError) and e.training.cp > 1 for _, e in items):
        raise UserError("--cp traces memcalc's replica under torch's ring attention or DeepSpeed's Ulysses: pass "
                        "--framework plain")
    return traced.pop()


#: validate's own options (and those it passes on itself); the others are the experiment's inputs
_OWN = ("config", "all_configs", "device", "scale_layers", "output", "snapshot", "as_json", "html", "framework",
        "gpus", "zero", "sharding", "rank", "force", "protocol", "case")


def _protocol(device: Optional[str], output: Optional[str], as_json: bool, given: list[str],
              case: Optional[list[str]] = None) -> None:
    """``--protocol``: its fixed list of cases (memcalc.validate.protocol), the records in the folder ``output``."""
    if given:
        flags = ", ".join("--" + g.replace("_", "-") for g in given)
        raise UserError(f"--protocol runs its own fixed list of cases (docs/protocol.md): drop {flags}")
    if device is not None and device not in ("cuda", "meta"):
        raise UserError(f"--protocol --device {device}: the protocol runs on cuda, or traced on meta")
    if output is not None:
        _check_folder(output)
    _runner(as_json)  # imports memcalc.validate (torch): missing torch is one line, a signal meanwhile stops cleanly
    from memcalc.validate.protocol import default_output, run_protocol, select

    cases = select(case or ())  # unknown names: one line listing the valid ones, before any case runs
    run_protocol(device, output if output is not None else default_output(device), as_json, cases=cases)


def _check_folder(path: str) -> None:
    """--protocol --output: a folder that exists or can be made in one that does, writable."""
    import os

    if not path.strip():
        raise UserError(f"cannot write --output {path!r}: an empty path; give a folder")
    p = os.path.realpath(os.path.expanduser(path))
    if p.split(os.sep)[1:2] in (["proc"], ["sys"], ["dev"]):
        raise UserError(f"cannot write --output {path}: {p} is a kernel interface, not a folder")
    if os.path.exists(p) and not os.path.isdir(p):
        raise UserError(f"cannot write --output {path}: it is a file; --protocol writes a folder of records")
    parent = p if os.path.isdir(p) else os.path.dirname(p)
    if not os.path.isdir(parent):
        raise UserError(f"cannot write --output {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"cannot write --output {path}: permission denied")


def _check_sharded_flags(gpus: Optional[int], zero: Optional[int], sharding: Optional[str],
                         rank: Optional[int], deepspeed: Optional[str] = None) -> None:
    """validate's sharded flags go together: --gpus N (N >= 2) with --zero 2 or 3, or with a
    --deepspeed config, whose ZeRO stage sets --zero (DeepSpeed's engine traced as rank 0:
    validate/deepspeed_trace.py)."""
    from memcalc.core.spec import SHARDINGS

    if sharding is not None and sharding not in SHARDINGS:
        raise UserError(f"unknown --sharding {sharding!r}; valid: {', '.join(SHARDINGS)}")
    if deepspeed is not None and zero is None:
        zero = 2 if gpus is not None and gpus > 1 else None  # (checked when the config is read: stage 2 or 3)
    if (sharding == "deepspeed" or deepspeed is not None) and rank not in (None, 0):
        raise UserError(f"--rank {rank}: the DeepSpeed trace runs rank 0 (validate/deepspeed_trace.py)")
    if gpus is None or gpus == 1:
        given = [f"{f} {v}" for f, v in (("--zero", zero or None), ("--sharding", sharding), ("--rank", rank))
                 if v is not None]
        if given:
            raise UserError(f"{' '.join(given)} needs --gpus N (N >= 2): validate traces one rank of a sharded step; "
                            "add it, with --zero 2 or 3")
        return
    if gpus < 1:
        raise UserError(f"--gpus must be at least 1, got {gpus}")
    if zero not in (2, 3):
        raise UserError(f"--gpus {gpus} needs --zero 2 or 3 for validate (got {'none' if zero is None else zero}): "
                        "it traces one rank of an FSDP or DeepSpeed step (or give --deepspeed CONFIG); data parallel "
                        "without sharding is one GPU's step")
    if rank is not None and not 0 <= rank < gpus:
        raise UserError(f"--rank {rank} is not a rank of --gpus {gpus} (valid: 0..{gpus - 1})")
