"""The model's parameters as simulator blocks, allocated before the step.

Each parameter of the inventory (:mod:`memcalc.engine.params`) is allocated at the precision
policy's weight dtype, a QLoRA base as packed NF4, a ZeRO-3 layer weight as this rank's shard.
Under FSDP2 (:func:`memcalc.engine.fsdp.fsdp2_active`) every parameter, root ones included, is
this rank's padded dim-0 shard in FSDP2's original dtype (fp32 under the mixed-precision policy),
while the forward sees it (``itemsize_bits``, gradient bytes) in its ``param_dtype``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memcalc.core.dtypes import DType
from memcalc.core.spec import ExperimentSpec, ModelSpec
from memcalc.engine import fsdp
from memcalc.engine.params import param_inventory
from memcalc.engine.sharding import shard
from memcalc.engine.sim import Param, Sim
from memcalc.engine.tensor_parallel import grad_numel, local_experiment


def quantized_bytes(numel: int, block: int, double_quant: bool) -> int:
    """NF4 storage of a QLoRA base weight: packed 4-bit values (numel/2 bytes) plus absmax
    constants: fp32 per block, or with double quantisation uint8 per block plus an fp32
    scale and offset per 256 blocks (Dettmers et al. 2023, bitsandbytes ``QuantState``)."""
    blocks = -(-numel // block)
    consts = blocks + 8 * -(-blocks // 256) if double_quant else 4 * blocks
    return DType.nf4.nbytes(numel) + consts


@dataclass
class Model:
    """Parameters (as simulator blocks) grouped for the forward code."""

    spec: ModelSpec
    params: dict[str, Param]
    order: list[Param]
    compute: DType
    layer_gather_bytes: int = 0  # ZeRO-3: one layer's weights all-gathered whole (0 = not sharded)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # parameter shapes (FSDP2 shards by rows)
    fsdp2: bool = False  # FSDP2 (or, with fsdp1, FSDP1) runs the step (engine.fsdp, engine.fsdp1)
    fsdp1: bool = False


def make_params(sim: Sim, exp: ExperimentSpec) -> Model:
    """Allocate every parameter at the precision policy's weight dtype, LoRA adapters at theirs
    (:attr:`ExperimentSpec.adapter_dtype`); weights exist before the step."""
    tr = exp.training
    lora = tr.lora
    wdt = tr.weight_dtype
    adt = exp.adapter_dtype or wdt  # LoRA adapters: fp32 or the base's dtype (ExperimentSpec.adapter_dtype)
    n = tr.gpus
    f2 = fsdp.fsdp_active(tr)  # FSDP2 or FSDP1: every parameter sharded in the original dtype
    f1 = f2 and tr.sharding == "fsdp1"
    f2_orig = fsdp.policy(tr).orig if f2 else None
    zero3 = tr.zero >= 3 and n > 1 and not f2
    params: dict[str, Param] = {}
    order: list[Param] = []
    gather = 0
    for pt in param_inventory(local_experiment(exp).model, lora):  # tensor parallelism: this rank's shards
        quant = lora is not None and lora.qlora and pt.quantizable
        pdt = adt if pt.kind == "lora" else wdt
        if quant:
            full = quantized_bytes(pt.numel, lora.quant_block, lora.double_quant)
            cat = "frozen base weights (NF4)"
        else:
            full = pdt.nbytes(pt.numel)
            cat = "weights" if pt.trainable or lora is None else "frozen base weights"
        nbytes = full
        if f2:  # this rank's padded row shard (FSDP1: its share of the flat shard), original dtype
            elems = -(-pt.numel // n) if f1 else fsdp.padded_shard_numel(pt.shape, n)
            nbytes = -(-full * elems // pt.numel) if quant else (
                pdt if pt.kind == "lora" else f2_orig).nbytes(elems)
            cat += f" (FSDP{1 if f1 else 2} shard 1/{n})"
            if tr.offload_optimizer:  # CPUOffloadPolicy: the shards live in host memory
                nbytes = 0
        elif zero3 and (pt.layer is not None or tr.sharding == "deepspeed"):  # DeepSpeed shards the root too
            nbytes = shard(full, n)
            cat += f" (ZeRO-3 shard 1/{n})"
            if pt.layer == 0 and tr.sharding != "deepspeed":  # DeepSpeed gathers its own way (engine.deepspeed)
                gather += full
        w = sim.alloc(nbytes, "weights", cat, name=pt.name)
        w.numel, w.itemsize_bits = pt.numel, (4 if quant else pdt.bits)
        p = Param(pt.name, w, pt.trainable, pdt.nbytes(grad_numel(pt.name, pt.numel, tr.tp)), pt.layer, pt.numel)
        if tr.zero >= 2 and n > 1 and not f2 and tr.sharding != "deepspeed":  # DeepSpeed: its buckets (engine.deepspeed)
            p.grad_keep_bytes = shard(p.grad_bytes, n)
        params[pt.name] = p
        order.append(p)
    shapes = {pt.name: pt.shape for pt in param_inventory(local_experiment(exp).model, lora)} if f2 else {}  # TP: local shapes
    return Model(exp.model, params, order, tr.compute_dtype, gather, shapes, f2, f1)
