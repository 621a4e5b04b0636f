"""Pipeline parallelism: the rules the estimator (memcalc.engine.pipeline) and the validator
(validate/sharded/pipeline.py) share -- how the layers are split, which torch schedule runs, the
micro-batches, and what is refused.

The schedules are ``torch.distributed.pipelining``'s (torch 2.13, schedules.py):

================  ===========================  =====================================================
``--pp-schedule``  torch class                  per rank ``r`` of ``pp``, ``M`` micro-batches
================  ===========================  =====================================================
gpipe             ``ScheduleGPipe``            all ``M`` forwards, then all ``M`` backwards
1f1b              ``Schedule1F1B``             ``min(M, pp - r)`` warm-up forwards, then one
                                               backward and one forward in turn, then the cool-down
                                               backwards (``M >= pp``: torch raises otherwise)
interleaved-1f1b  ``ScheduleInterleaved1F1B``  ``V`` stages per rank (``--pp-stages-per-rank``, looped:
                                               rank ``r`` holds stages ``r, r + pp, ...``), depth first;
                                               the order: :mod:`memcalc.core.pp_schedules`
zero-bubble       (the next line's)            ``ScheduleInterleavedZeroBubble``: as interleaved-1f1b
                                               (one warm-up forward less a hop), each backward split
                                               into ``I`` (the input's gradient) and a later ``W`` (the
                                               weights'): :mod:`memcalc.engine.pipeline_zb`
zbv-zero-bubble   ``ScheduleZBVZeroBubble``    torchtitan's ``ZBVZeroBubble``: exactly 2 stages per rank
                                               in a V (rank ``r`` holds stages ``r`` and ``2 pp - 1 - r``,
                                               so rank 0 holds the embedding and the head), zero
                                               bubble's ``I`` / ``W``, its own order
                                               (:func:`memcalc.core.pp_schedules.zbv`)
================  ===========================  =====================================================

``V`` (``--pp-stages-per-rank``) is torchtitan's ``stages_per_rank`` (torchtitan 0.3.0
distributed/pipeline_parallel.py ``_get_pipeline_metadata``, which derives it from
``pipeline_parallel_layers_per_stage``): 1 for the single-stage schedules, which refuse more, and by default 2
for the multi-stage ones, which refuse fewer. The layers are split over the ``pp x V`` stages (:func:`stage_layers`).

With ``tp > 1`` every stage is tensor-parallel over ``tp`` ranks (GPUs = pp x tp x gpus). With ``gpus > 1`` and
``--zero 2`` / ``3`` (FSDP2) every stage is FSDP2-sharded over ``gpus`` data-parallel ranks as torchtitan 0.3.0 does
it under pipelining (memcalc.engine.pipeline_fsdp; validate/sharded/pipeline_fsdp.py), with the multi-stage
schedules each stage its own FSDP root under the runtime's UNSHARD / RESHARD / REDUCE_GRAD
(memcalc.core.pp_lowering). With ``--ep`` every stage's
MoE layers hold ``n_experts / ep`` routed experts and run torchtitan's all-to-all dispatch on each micro-batch
(memcalc.engine.expert_parallel, as for a whole model); the mesh is torchtitan 0.3.0's sparse mesh
(``distributed/parallel_dims.py`` ``_build_mesh``: ``("pp", "dp_replicate", "efsdp", "ep")``): ``pp`` outermost, the
``ep`` ranks borrowed from each stage's ``gpus`` data-parallel ranks (GPUs = pp x gpus;
:func:`memcalc.core.expert_parallel.check_ep`), as torchtitan's ``parallelize_deepseekv3`` parallelizes each model
part (``model.parallelize(parallel_dims)`` when ``ep_enabled``) before the pipeline stage wraps it. With ``--ep`` and
FSDP2 (torchtitan's default for its MoE models) each MoE layer has two FSDP2 groups, its experts over ``efsdp =
gpus / ep`` and the rest over ``gpus`` (memcalc.engine.pipeline_ep_fsdp; validate/sharded/pipeline_ep_fsdp.py).
With ``--cp`` (ring attention; no ``--ep``) the mesh is ``pp x cp [x tp]`` (``_build_mesh``'s order ``pp,
dp_replicate, dp_shard, cp, tp``; GPUs = gpus x tp x cp x pp) and every stage runs torch's ring on its ``seq / cp``
tokens (memcalc.engine.pipeline; validate/sharded/pipeline.py); FSDP2 (``--zero 2|3``) then shards each stage over
the ``gpus x cp`` ranks (torchtitan's ``dp_shard_cp``: memcalc.engine.context_parallel.shard_group).

The split (:func:`stage_layers`) is torchtitan 0.3.0's, always: ``pipeline_llm``
(``torchtitan/distributed/pipeline_parallel.py``) calls ``_generate_llm_fqn_per_model_part(num_virtual_stages,
num_layers, input_weight, output_weight)`` unless ``module_fqns_per_model_part`` is given, with
``input_weight`` = ``pipeline_parallel_first_stage_less_layers`` (``--pp-first-stage-less-layers``) and
``output_weight`` = ``pipeline_parallel_last_stage_less_layers`` (``--pp-last-stage-less-layers``), both 1 by
default (config/configs.py ``ParallelismConfig``; ``_get_pipeline_metadata``). The embedding and the head count
as ``input_weight`` / ``output_weight`` layers: ``n_layers + in + out`` effective layers go
``(n_layers + in + out) // n`` to each of the ``n`` stages and one more to each of the first
``(n_layers + in + out) % n``, the first stage holding ``in`` decoder layers less, the last ``out`` less
(Llama-3 8B's 32 layers over 4: 8, 9, 8, 7; DeepSeek-V3's 61 over 8: 7, 8 x 6, 6). ``0`` and ``0`` give
the even split where ``n`` divides the layers (Megatron-LM's). :func:`check_pp` refuses what it refuses:
more stages than effective layers, a weight above the effective layers per stage.

The batch: ``--batch`` is what one pipeline step receives (torch splits it on dim 0 into ``M``
micro-batches, ``schedules._split_inputs`` / ``microbatch.split_args_kwargs_into_chunks``); it must
divide by ``M``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from memcalc.core.errors import UserError
from memcalc.core.rules import is_variant_layer

if TYPE_CHECKING:
    from memcalc.core.spec import ExperimentSpec, ModelSpec, TrainingSpec

#: ``--pp-schedule`` -> the torch.distributed.pipelining class that runs it
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
                   "zero-bubble": "ScheduleInterleavedZeroBubble", "zbv-zero-bubble": "ScheduleZBVZeroBubble"}
#: the schedule names, in the order the CLI lists them
PP_SCHEDULES = tuple(TORCH_SCHEDULES)
#: the schedules with several stages per rank (torch's ``PipelineScheduleMulti`` subclasses)
MULTI_STAGE = ("interleaved-1f1b", "zero-bubble", "zbv-zero-bubble")
#: the schedules that split each backward into ``I`` and ``W`` (memcalc.engine.pipeline_zb)
ZERO_BUBBLE = ("zero-bubble", "zbv-zero-bubble")
#: the schedules that place a rank's stages in a V (torchtitan 0.3.0 distributed/pipeline_parallel.py
#: ``_get_pp_rank_to_stage_indices_mapping``: ``style = "v"`` for ``ScheduleZBVZeroBubble``), not looped
V_SHAPED = ("zbv-zero-bubble",)


def stages_per_rank(tr: TrainingSpec) -> int:
    """``V``: ``--pp-stages-per-rank``, else torchtitan's default (``_get_pipeline_metadata``: 1 for a
    single-stage schedule, 2 for a multi-stage one)."""
    if tr.pp_stages_per_rank is not None:
        return tr.pp_stages_per_rank
    return 2 if tr.pp_schedule in MULTI_STAGE else 1


def rank_stages(tr: TrainingSpec, rank: int) -> list[int]:
    """The global stage indices rank ``rank`` holds, ascending (looped, or in a V for :data:`V_SHAPED`:
    :func:`memcalc.core.pp_schedules.rank_stages`)."""
    from memcalc.core.pp_schedules import rank_stages as placed

    return placed(tr.pp, stages_per_rank(tr), rank, "v" if tr.pp_schedule in V_SHAPED else "loop")


#: torchtitan 0.3.0 config/configs.py ``pipeline_parallel_first_stage_less_layers`` /
#: ``pipeline_parallel_last_stage_less_layers`` defaults: the embedding and the head weigh one layer each
INPUT_WEIGHT = OUTPUT_WEIGHT = 1


def stage_layers(n_layers: int, pp: int, virtual: int = 1, first_less: int = INPUT_WEIGHT,
                 last_less: int = OUTPUT_WEIGHT) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each of the ``pp * virtual`` stages, as torchtitan 0.3.0 splits them
    (distributed/pipeline_parallel.py ``_generate_llm_fqn_per_model_part(pp * virtual, n_layers, first_less,
    last_less)``; the module docstring; :func:`check_pp` refuses what it refuses)."""
    n = pp * virtual
    if n == 1:  # "Single stage gets everything"
        return [(0, n_layers)]
    per, extra = divmod(n_layers + first_less + last_less, n)
    out, cur = [], 0
    for s in range(n):
        k = per + (s < extra) - (first_less if s == 0 else last_less if s == n - 1 else 0)
        k = max(0, min(k, n_layers - cur))  # (its loops stop at num_layers)
        out.append((cur, cur + k))
        cur += k
    return out


def split(tr: TrainingSpec, n_layers: int) -> list[tuple[int, int]]:
    """:func:`stage_layers` of ``tr``'s ``pp x V`` stages with its two weights (the estimator's and the
    validator's split)."""
    return stage_layers(n_layers, tr.pp, stages_per_rank(tr), tr.pp_first_stage_less_layers,
                        tr.pp_last_stage_less_layers)


def micro_batch(tr: TrainingSpec) -> tuple[int, int]:
    """(micro-batches ``M``, rows per micro-batch ``batch / M``); ``M`` defaults to ``pp``."""
    M = tr.microbatches or tr.pp
    return M, tr.batch // M


def check_pp(exp: ExperimentSpec) -> None:
    """One clear line for a pipeline setup memcalc does not model (see the module docstring)."""
    tr, m = exp.training, exp.model
    pp = tr.pp
    if pp == 1:
        return
    if tr.pp_schedule not in TORCH_SCHEDULES:
        raise UserError(f"--pp-schedule {tr.pp_schedule}: not modelled yet; valid: {', '.join(PP_SCHEDULES)}")
    n_mb, _ = micro_batch(tr)
    _check_stages(tr, m.n_layers, n_mb)
    if tr.batch % n_mb:
        given = "" if tr.microbatches else ", the default: --pp"
        raise UserError(f"--batch {tr.batch} must divide by --microbatches {n_mb}{given} (torch splits the batch into "
                        "micro-batches on dim 0): pick a batch that is a multiple of it")
    if tr.pp_schedule == "1f1b" and n_mb < pp:
        raise UserError(f"--pp-schedule 1f1b needs --microbatches >= --pp: {n_mb} < {pp} (torch's Schedule1F1B raises "
                        "'Number of microbatches must be greater than or equal to the number of stages')")
    from memcalc.core.expert_parallel import shard1_refusal

    uneven = shard1_refusal(exp) if tr.gpus > 1 and tr.sharding == "fsdp2" else None
    if uneven:
        raise UserError(f"--pp {pp} with --gpus {tr.gpus} --zero {tr.zero}: {uneven}; pick --gpus dividing them")
    unsupported = [name for cond, name in (
        (m.tie_embeddings, "tied embeddings (the embedding and the head sit on different stages)"),
        (tr.cp > 1 and tr.cp_method != "ring", f"--cp-method {tr.cp_method} (torchtitan composes its ring attention "
                                               "with pipelines: --cp-method ring)"),
        (tr.cp > 1 and tr.ep > 1, "--cp with --ep (the ep ranks borrowed from dp x cp: not modelled)"),
        (tr.cp > 1 and tr.zero > 0 and not (tr.sharding == "fsdp2" and tr.zero in (2, 3)),
         f"--cp with --sharding {tr.sharding} --zero {tr.zero} (FSDP2, --zero 2 or 3, composes)"),
        (tr.gpus > 1 and tr.zero > 0 and not (tr.sharding == "fsdp2" and tr.zero in (2, 3)),
         f"--sharding {tr.sharding} --zero {tr.zero} over data-parallel GPUs (FSDP2, --zero 2 or 3, composes)"),
        (tr.gpus > 1 and tr.offload_optimizer, "--offload-optimizer"),
        (tr.grad_accum > 1, "--grad-accum (the micro-batches are the accumulation)"),
        (tr.compile, "--compile"),
        (tr.fused_optimizer, "--fused-optimizer"),
        (tr.activation_offload, "--activation-offload"),
        (tr.lora is not None, "LoRA / QLoRA adapters"),
        (tr.checkpoint not in ("none", "full"), f"--checkpoint {tr.checkpoint}"),
        (is_variant_layer(m) or m.sliding_window is not None, "layers that differ by their index"),
        (exp.profile.framework not in ("plain", "hf") or exp.profile.kernels != "none"
         or exp.profile.cross_entropy != "full", f"--framework {exp.profile.framework}'s own head or kernels"),
    ) if cond]
    if unsupported:
        raise UserError(f"--pp {pp} models torch.distributed.pipelining over a decoder, full fine-tuning; "
                        f"not with {'; '.join(unsupported)}")


def _check_stages(tr: TrainingSpec, n_layers: int, n_mb: int) -> None:
    """The stages per rank and the split (torchtitan's and torch's rules, quoted)."""
    pp, V = tr.pp, stages_per_rank(tr)
    multi = tr.pp_schedule in MULTI_STAGE
    if multi and V < 2:
        raise UserError(f"--pp-schedule {tr.pp_schedule} needs --pp-stages-per-rank >= 2, not {V} (torchtitan's "
                        "_get_pipeline_metadata: 'Multi-stage schedule requires at least 2 stages per rank')")
    if tr.pp_schedule in V_SHAPED and V != 2:
        raise UserError(f"--pp-schedule {tr.pp_schedule} runs exactly 2 stages per rank, not --pp-stages-per-rank "
                        f"{V} (torch's ScheduleZBVZeroBubble raises 'ZBV requires exactly 2 stages per rank, but got "
                        f"{V}.')")
    if tr.pp_schedule in ZERO_BUBBLE and tr.checkpoint_reentrant:
        raise UserError(f"--pp-schedule {tr.pp_schedule} with --reentrant: its input backward is "
                        "torch.autograd.grad (_backward.py stage_backward_input), and torch's reentrant checkpoint "
                        "raises 'When use_reentrant=True, torch.utils.checkpoint is incompatible with .grad()' "
                        "(torch/utils/checkpoint.py CheckpointFunction.backward); torchtitan checkpoints "
                        "non-reentrant: drop --reentrant")
    if not multi and V != 1:
        raise UserError(f"--pp-schedule {tr.pp_schedule} runs one stage per rank, not --pp-stages-per-rank {V} "
                        "(torchtitan's _get_pipeline_metadata: 'Single stage schedule requires exactly 1 stage per "
                        "rank'); more stages per rank: --pp-schedule interleaved-1f1b")
    _check_split(tr, n_layers, pp * V, "" if V == 1 else f" x --pp-stages-per-rank {V} = {pp * V} stages")
    if multi and tr.pp_schedule not in V_SHAPED:  # (ZBV plans max(2 pp - 1, M) micro-batches: any M)
        from memcalc.core.pp_schedules import rounds

        n_rounds = rounds(pp, n_mb)[0]
        if n_mb % n_rounds:  # ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble.__init__
            raise UserError(f"--pp-schedule {tr.pp_schedule} needs --microbatches a multiple of its rounds, "
                            f"max(1, {n_mb} // {pp}) = {n_rounds}: {n_mb} is not (torch raises 'requires the number "
                            "of microbatches to be a multiple of the number of rounds')")


def split_refusal(n_layers: int, n: int, first: int, last: int) -> Optional[str]:
    """What torchtitan 0.3.0 ``_generate_llm_fqn_per_model_part(n, n_layers, first, last)`` raises (``n > 1``),
    quoted, or None."""
    effective = n_layers + first + last
    if n > effective:
        return f"Number of stages ({n}) cannot be greater than effective layers ({effective})"
    per = effective // n  # (>= 1 here: its "empty stages" check cannot fire)
    for weight, name in ((first, "input_weight"), (last, "output_weight")):
        if weight > per:
            return f"{name} ({weight}) exceeds minimum layers per stage ({per})."
    return None


def _check_split(tr: TrainingSpec, n_layers: int, n: int, stages: str) -> None:
    """:func:`split_refusal` as one line naming the flags."""
    first, last = tr.pp_first_stage_less_layers, tr.pp_last_stage_less_layers
    why = split_refusal(n_layers, n, first, last)
    if why:
        raise UserError(f"--pp {tr.pp}{stages} over {n_layers} layers with --pp-first-stage-less-layers {first} "
                        f"--pp-last-stage-less-layers {last} (the embedding and the head count as that many "
                        f"layers): torchtitan's _generate_llm_fqn_per_model_part raises '{why}'")


#: pipelines of more stages than this simulate only :func:`simulated_ranks` (estimate and plan alike)
ALL_RANKS_UP_TO = 4


def simulated_ranks(pp: int, m: Optional[ModelSpec] = None, V: int = 1, schedule: str = "1f1b",
                    less: tuple[int, int] = (INPUT_WEIGHT, OUTPUT_WEIGHT)) -> list[int]:
    """The ranks whose step is simulated: every rank up to :data:`ALL_RANKS_UP_TO` stages, else the first
    (embedding, the most micro-batches in flight), the second, the last (head, logits and loss) and, for each
    stage of ``m`` whose layers differ from the second's (an MoE model's dense first layers, MoE every
    ``moe.every`` layers: :meth:`memcalc.core.model_spec.MoESpec.is_moe_layer`), the first rank with that
    stage. A middle rank with an earlier rank's layers, or fewer of them (torchtitan's split gives its extra
    layers to the first stages: a later rank's stages hold no more layers than the second's), holds no more
    buffers and, under 1F1B, fewer micro-batches in flight (warm-up ``pp - rank``; GPipe: as many; interleaved:
    ``2`` fewer warm-up forwards a hop): it peaks no higher (``tests/unit/test_plan_pipelines.py`` simulates
    every rank and checks it). With ``V`` stages per rank a rank's layers are its ``V`` stages'. Under zero
    bubble the last rank of each layer kind and the second-to-last rank are simulated too: rank ``r`` defers
    ``r`` weight backwards (``num_1f1b_microbatches = rank``, each keeping a micro-batch's graph and its
    intermediates' gradients), one more a hop, against one warm-up forward fewer, so the middle ranks' peaks
    rise with the rank (the test simulates every rank). A V-shaped schedule (:data:`V_SHAPED`) simulates every
    rank: its ranks' stages pair a stage near the start with one near the end. Layers that differ otherwise
    by their index are refused with ``--pp`` (:func:`check_pp`)."""
    if pp <= ALL_RANKS_UP_TO or schedule in V_SHAPED:
        return list(range(pp))
    ranks = {0, 1, pp - 1}
    if m is not None:
        groups: dict[tuple, list[int]] = {}
        split = stage_layers(m.n_layers, pp, V, *less)
        for r in range(1, pp - 1):
            groups.setdefault(_rank_kind(m, split, r, pp), []).append(r)
        for rs in groups.values():
            if m.moe is not None:
                ranks.add(rs[0])
            if schedule == "zero-bubble":
                ranks.add(rs[-1])
    if schedule == "zero-bubble":
        ranks.add(pp - 2)
    return sorted(ranks)


def _rank_kind(m: ModelSpec, split: list[tuple[int, int]], r: int, pp: int) -> tuple:
    """What sets rank ``r``'s buffers apart: per stage, its layer count, or an MoE model's layers' kinds."""
    moe = m.moe
    return tuple(tuple(moe.is_moe_layer(i) for i in range(*split[s])) if moe is not None else split[s][1] - split[s][0]
                 for s in range(r, len(split), pp))


def pipeline_line(pipe: dict) -> str:
    """The inputs table's line for ``--json``'s ``pipeline`` (memcalc.engine.pipeline.pipeline_extra)."""
    worst = next(s for s in pipe["stages"] if s["rank"] == pipe["worst_rank"])
    layers = ", ".join((f"stage {s['stage']}: " if "stage" in s else "") + layers_text(*s["layers"])
                       for s in worst.get("stages", [worst]))
    ranks = [s["rank"] for s in pipe["stages"]]
    every = ("every rank's in --json" if len(ranks) == pipe["pp"] else
             f"ranks {', '.join(map(str, ranks))} simulated, in --json (no other rank peaks above them)")
    per_rank = f", {pipe['stages_per_rank']} stages per rank" if "stages_per_rank" in pipe else ""
    return (f"PP {pipe['pp']}, {pipe['schedule']} ({pipe['torch_schedule']}){per_rank}, {pipe['microbatches']} "
            f"micro-batches of {pipe['microbatch_size']}; the peak is rank {pipe['worst_rank']}'s ({layers}), "
            f"{every}")


def layers_text(lo: int, hi: int) -> str:
    """``layers lo-(hi - 1)``, ``layer lo`` for one, or ``no layers`` for an uneven split's end stage of the
    embedding or the head only."""
    if hi - lo == 1:
        return f"layer {lo}"
    return f"layers {lo}-{hi - 1}" if hi > lo else "no layers"
