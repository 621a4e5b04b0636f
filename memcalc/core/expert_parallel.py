"""Expert parallelism (``--ep``): the rules the estimator and the validator share.

Follows torchtitan 0.3.0 (PyPI; the source read is the installed wheel):

- ``torchtitan/distributed/parallel_dims.py`` ``ParallelDims._build_mesh``: the expert-parallel
  ranks are borrowed from the data-parallel ones (``efsdp = dp_shard * cp * tp // ep``: the
  experts' FSDP mesh is what is left of the data-parallel ranks once ``ep`` of them split the
  experts). Here (no context parallelism, no tensor parallelism over MoE) ``ep`` divides
  ``--gpus``, the data-parallel ranks, and each group of ``ep`` ranks holds one copy of the experts.
- ``torchtitan/models/common/moe_sharding.py`` ``expert_param_placement_sparse``: the routed
  experts' 3-D weights are ``Shard(0)`` on the ``ep`` axis (``n_experts / ep`` experts per rank);
  the router and the shared experts are dense (replicated over ``ep``).
- ``torchtitan/models/common/token_dispatcher.py`` ``AllToAllTokenDispatcher``: a rank routes its
  own ``N`` tokens (``S = N x top_k`` rows), sends each row to the rank holding its expert
  (``all_to_all_single``) and receives the rows routed to its ``n_experts / ep`` experts. How
  many it receives depends on the routing: :func:`received_rows`.

The capacity factor (``TrainingSpec.ep_capacity_factor``) is a stated input, not a margin: the
rows a rank receives over the ``S`` it sends. 1.0 (the default) is the even split (every rank
receives as many rows as it sends: the balanced routing of ``MoESpec.routing``); a larger value
models the busiest rank of an imbalanced routing (the tokens it receives, and everything the
grouped experts make from them, grow by that factor). torchtitan's all-to-all dispatcher drops
no token, so a rank cannot receive more than every rank sending it all its rows for its local
experts: ``ep x N x min(top_k, n_experts / ep)`` rows (:func:`max_capacity_factor`).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Optional

from memcalc.core.errors import UserError
from memcalc.core.rules import MOE_TP
from memcalc.core.spec import ExperimentSpec, TrainingSpec


def max_capacity_factor(top_k: int, n_experts: int, ep: int) -> Fraction:
    """The largest capacity factor a rank can see: every one of the ``ep`` ranks routes each of
    its tokens to ``min(top_k, n_experts / ep)`` of this rank's experts, over the ``top_k`` rows per
    token it sends."""
    return Fraction(ep * min(top_k, n_experts // ep), top_k)


def received_rows(sent_rows: int, capacity_factor: float) -> int:
    """The rows the dispatch all-to-all delivers to this rank: ``sent_rows`` x the capacity factor,
    rounded down to whole rows (1.0: exactly the rows it sent, the even split)."""
    return int(Fraction(capacity_factor).limit_denominator(10**6) * sent_rows)


def check_ep(exp: ExperimentSpec) -> None:
    """Refuse expert-parallel setups torchtitan does not run or memcalc does not model, each with
    the arithmetic or the reason."""
    tr, m = exp.training, exp.model
    ep = tr.ep
    if ep == 1:  # ep_capacity_factor alone changes nothing: a note (estimate.peak.NO_EFFECT)
        return
    if m.moe is None:
        raise UserError(f"--ep {ep} shards the routed experts of a mixture-of-experts model over ranks; {m.name} is "
                        "a dense model (no experts to shard): use --gpus / --zero / --tp for it")
    e = m.moe.n_experts
    if e % ep:
        raise UserError(f"--ep {ep} must divide the routed experts ({e}): {e} / {ep} = {e / ep:g} (remainder "
                        f"{e % ep}); each rank holds n_experts / ep of them (torchtitan shards the experts' "
                        "dim 0 evenly)")
    if tr.gpus % ep:
        raise UserError(f"--ep {ep} must divide --gpus {tr.gpus}: the expert-parallel ranks are data-parallel "
                        f"ranks (torchtitan's efsdp = dp_shard // ep); {tr.gpus} / {ep} = {tr.gpus / ep:g}")
    unsupported = [name for cond, name in (
        (tr.tp > 1, f"--tp (MoE layers under tensor parallelism: {MOE_TP})"),
        (tr.zero == 1 or (tr.zero > 1 and tr.sharding != "fsdp2"),
         f"--zero {tr.zero} --sharding {tr.sharding} (with expert parallelism FSDP2 --zero 2/3 is modelled)"),
        (tr.offload_optimizer, "--offload-optimizer"),
        (tr.lora is not None, "LoRA / QLoRA adapters"),
        (tr.compile, "torch.compile"),
        (m.moe.expert_bias, "expert biases (gpt-oss)"),
    ) if cond]
    if unsupported:
        raise UserError(f"--ep {ep} is modelled for full fine-tuning of the routed experts with torchtitan's "
                        f"all-to-all dispatcher; not with {', '.join(unsupported)}")
    top = max_capacity_factor(m.moe.top_k, e, ep)
    if tr.ep_capacity_factor > top:
        raise UserError(f"--ep-capacity-factor {tr.ep_capacity_factor:g} is more than a rank can receive: at most "
                        f"ep x min(top_k, n_experts / ep) / top_k = {ep} x {min(m.moe.top_k, e // ep)} / "
                        f"{m.moe.top_k} = {float(top):g} (every rank's tokens all routed to this rank's experts)")


def shard1_refusal(exp: ExperimentSpec) -> Optional[str]:
    """What torch 2.13 raises when FSDP2 shards the routed experts on dim 1 unevenly, or None: torchtitan 0.3.0's
    ``apply_fsdp_to_decoder`` places them ``Shard(1)`` over the ``efsdp`` mesh (``gpus / ep`` ranks) when
    ``efsdp x ep`` (= ``gpus``) exceeds the experts, and ``fully_shard`` refuses a dim-1 size its mesh does not
    divide (``_fsdp_param.py``: "FSDP does not support uneven sharding on dim 1"). The dims: the experts'
    ``gate_up`` (``2 x d_ff_expert`` gated, else ``d_ff_expert``) and ``down`` (``d_model``)."""
    tr, m = exp.training, exp.model
    if m.moe is None or tr.zero < 2 or tr.gpus <= m.moe.n_experts:
        return None
    world = tr.gpus // tr.ep
    up = m.moe.d_ff_expert * (2 if m.mlp == "gated" else 1)
    bad = [f"{name} {size}" for name, size in (("gate_up", up), ("down", m.d_model)) if size % world]
    if world == 1 or not bad:
        return None
    return (f"FSDP2 over {world} ranks puts the routed experts on dim 1 (more GPUs, {tr.gpus}, than experts, "
            f"{m.moe.n_experts}: torchtitan's Shard(1)), and {world} does not divide their dim 1 ({', '.join(bad)}): "
            "torch raises 'FSDP does not support uneven sharding on dim 1'")


def ep_line(exp: ExperimentSpec, ep_mark: str = "", cf_mark: str = "") -> Optional[str]:
    """The inputs table's "expert parallel" line (None without expert parallelism); the marks say
    where each value came from."""
    tr, moe = exp.training, exp.model.moe
    if tr.ep == 1 or moe is None:
        return None
    return (f"EP {tr.ep}{ep_mark}: {moe.n_experts // tr.ep} of {moe.n_experts} routed experts per rank, "
            f"capacity factor {tr.ep_capacity_factor:g}{cf_mark}; "
            f"{tr.gpus // tr.ep} groups of {tr.ep} over {tr.gpus} data-parallel GPUs"
            + (f" of each of the {tr.pp} pipeline stages" if tr.pp > 1 else ""))


def expert_divisors(tr: TrainingSpec, params: list, div: int) -> dict[str, int]:
    """The optimizer's shard divisor of each routed-expert parameter under expert parallelism with
    ZeRO / FSDP2 (``div`` = ``gpus``): ``gpus / ep``, the ``efsdp`` mesh its shards live on; empty
    otherwise (every parameter's state divided by ``div``)."""
    if tr.ep == 1 or div == 1:
        return {}
    return {p.name: div // tr.ep for p in params if ".moe.experts." in p.name}
