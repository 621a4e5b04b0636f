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
================  ===========================  =====================================================

With ``tp > 1`` every stage is tensor-parallel over ``tp`` ranks (GPUs = pp x tp x gpus). With ``gpus > 1`` and
``--zero 2`` / ``3`` (FSDP2) every stage is FSDP2-sharded over ``gpus`` data-parallel ranks as torchtitan 0.3.0 does
it under pipelining (memcalc.engine.pipeline_fsdp; validate/sharded/pipeline_fsdp.py).

The split is even: each stage gets ``n_layers / pp`` consecutive layers (the first stage also the
embedding, the last the final norm, the head and the loss), as torchtitan's
``pipeline_module_split`` cuts a model given per-stage module names; ``n_layers`` must divide by
``pp`` (torchtitan's default ``generate_llm_fqn_per_model_part`` would instead weigh the embedding and
the head as one layer each and give the end stages fewer layers; memcalc does not model that split).

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
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
#: the schedule names, in the order the CLI lists them
PP_SCHEDULES = tuple(TORCH_SCHEDULES)


def stage_layers(n_layers: int, pp: int, virtual: int = 1) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each of the ``pp * virtual`` stages (even split; :func:`check_pp` checks it divides)."""
    n = pp * virtual
    per = n_layers // n
    return [(s * per, (s + 1) * per) for s in range(n)]


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
    if m.n_layers % pp:
        raise UserError(f"--pp {pp} must divide the layers ({m.n_layers}): {m.n_layers} / {pp} = {m.n_layers / pp:g} "
                        f"(remainder {m.n_layers % pp}); memcalc splits the layers evenly over the stages")
    if tr.batch % n_mb:
        given = "" if tr.microbatches else ", the default: --pp"
        raise UserError(f"--batch {tr.batch} must divide by --microbatches {n_mb}{given} (torch splits the batch into "
                        "micro-batches on dim 0): pick a batch that is a multiple of it")
    if tr.pp_schedule == "1f1b" and n_mb < pp:
        raise UserError(f"--pp-schedule 1f1b needs --microbatches >= --pp: {n_mb} < {pp} (torch's Schedule1F1B raises "
                        "'Number of microbatches must be greater than or equal to the number of stages')")
    unsupported = [name for cond, name in (
        (m.tie_embeddings, "tied embeddings (the embedding and the head sit on different stages)"),
        (tr.ep > 1, "--ep"),
        (tr.cp > 1, "--cp"),
        (tr.gpus > 1 and tr.zero > 0 and not (tr.sharding == "fsdp2" and tr.zero in (2, 3)),
         f"--sharding {tr.sharding} --zero {tr.zero} over data-parallel GPUs (FSDP2, --zero 2 or 3, composes)"),
        (tr.gpus > 1 and tr.offload_optimizer, "--offload-optimizer"),
        (tr.gpus > 1 and tr.zero > 1 and m.moe is not None and tr.gpus > m.moe.n_experts,
         f"FSDP2 over more data-parallel GPUs ({tr.gpus}) than routed experts "
         f"({m.moe.n_experts if m.moe else 0}): torchtitan's apply_fsdp_to_decoder shards the experts on dim 1 "
         "then (Shard(1)), not modelled"),
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


#: pipelines of more stages than this simulate only :func:`simulated_ranks` (estimate and plan alike)
ALL_RANKS_UP_TO = 4


def simulated_ranks(pp: int, m: Optional[ModelSpec] = None) -> list[int]:
    """The ranks whose step is simulated: every rank up to :data:`ALL_RANKS_UP_TO` stages, else the first
    (embedding, the most micro-batches in flight), the second, the last (head, logits and loss) and, for each
    stage of ``m`` whose layers differ from the second's (an MoE model's dense first layers, MoE every
    ``moe.every`` layers: :meth:`memcalc.core.model_spec.MoESpec.is_moe_layer`), the first rank with that
    stage. A middle rank with the second's layers holds the same buffers and, under 1F1B, fewer micro-batches
    in flight (warm-up ``pp - rank``; GPipe: as many): it peaks no higher than the second
    (``tests/unit/test_plan_pipelines.py`` simulates every rank and checks it). Layers that differ otherwise
    by their index are refused with ``--pp`` (:func:`check_pp`)."""
    if pp <= ALL_RANKS_UP_TO:
        return list(range(pp))
    ranks = [0, 1]
    if m is not None and m.moe is not None:
        moe = m.moe
        seen = set()
        for r, (lo, hi) in enumerate(stage_layers(m.n_layers, pp)):
            kinds = tuple(moe.is_moe_layer(i) for i in range(lo, hi))
            if 1 <= r < pp - 1 and kinds not in seen:
                seen.add(kinds)
                if r > 1:
                    ranks.append(r)
    return [*ranks, pp - 1]


def pipeline_line(pipe: dict) -> str:
    """The inputs table's line for ``--json``'s ``pipeline`` (memcalc.engine.pipeline.pipeline_extra)."""
    lo, hi = next(s for s in pipe["stages"] if s["rank"] == pipe["worst_rank"])["layers"]
    ranks = [s["rank"] for s in pipe["stages"]]
    every = ("every rank's in --json" if len(ranks) == pipe["pp"] else
             f"ranks {', '.join(map(str, ranks))} simulated, in --json (no other rank peaks above them)")
    return (f"PP {pipe['pp']}, {pipe['schedule']} ({pipe['torch_schedule']}), {pipe['microbatches']} micro-batches "
            f"of {pipe['microbatch_size']}; the peak is rank {pipe['worst_rank']}'s (layers {lo}-{hi - 1}), {every}")
