"""The model's parameters as simulator blocks, allocated before the step.

Each parameter of the inventory (:mod:`memcalc.engine.params`) is allocated at the precision
policy's weight dtype, a QLoRA base as packed NF4, a ZeRO-3 layer weight as this rank's shard.
Under FSDP2 (:func:`memcalc.engine.fsdp.fsdp2_active`) every parameter, root ones included, is
this rank's padded dim-0 shard in FSDP2's original dtype (fp32 under the mixed-precision policy),
while the forward sees it (``itemsize_bits``, gradient bytes) in its ``param_dtype``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional

from memcalc.core.dtypes import DType
from memcalc.core.spec import ExperimentSpec, LoraSpec, ModelSpec
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
    (:attr:`ExperimentSpec.adapter_dtype`); weights exist before the step. What each parameter
    allocates depends only on the model and a few training fields, so it is worked out once per
    those (:func:`_param_rows`) and every simulated step of them only allocates."""
    tr = exp.training
    wdt = tr.weight_dtype
    f2 = fsdp.fsdp_active(tr)  # FSDP2 or FSDP1: every parameter sharded in the original dtype
    f1 = f2 and tr.sharding == "fsdp1"
    rows, gather, shapes = _param_rows(
        local_experiment(exp).model, tr.lora, wdt, exp.adapter_dtype or wdt, tr.gpus, f2, f1,
        fsdp.policy(tr).orig if f2 else None, tr.zero >= 3 and tr.gpus > 1 and not f2, tr.zero, tr.sharding,
        tr.offload_optimizer, tr.tp)
    params: dict[str, Param] = {}
    order: list[Param] = []
    blocks = sim.alloc_many("weights", [(nbytes, cat, name, numel, bits)
                                        for name, nbytes, cat, numel, bits, _, _, _, _ in rows])
    for (name, nbytes, cat, numel, bits, trainable, grad_bytes, layer, keep), w in zip(rows, blocks):
        p = Param(name, w, trainable, grad_bytes, layer, numel)
        if keep is not None:
            p.grad_keep_bytes = keep
        params[name] = p
        order.append(p)
    return Model(exp.model, params, order, tr.compute_dtype, gather, dict(shapes), f2, f1)


@lru_cache(maxsize=128)
def _param_rows(local: ModelSpec, lora: Optional[LoraSpec], wdt: DType, adt: DType, n: int, f2: bool, f1: bool,
                f2_orig: Optional[DType], zero3: bool, zero: int, sharding: str, offload_optimizer: bool,
                tp: int) -> tuple[tuple, int, tuple]:
    """Each parameter's allocation as :func:`make_params` makes it: (name, bytes, category,
    elements, width in bits, trainable, gradient bytes, layer, the gradient shard kept after a
    reduce-scatter or None); the ZeRO-3 layer gather bytes; the shapes FSDP shards by. From
    everything make_params reads of the spec: the model one tensor-parallel rank holds, the LoRA
    spec, the weight and adapter dtypes, the GPUs, FSDP2/FSDP1 and FSDP's original dtype, ZeRO-3
    (not FSDP), the ZeRO stage, the sharding, optimizer offload and the tensor-parallel degree."""
    rows = []
    gather = 0
    inventory = param_inventory(local, lora)
    for pt in inventory:
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
            if offload_optimizer:  # CPUOffloadPolicy: the shards live in host memory
                nbytes = 0
        elif zero3 and (pt.layer is not None or sharding == "deepspeed"):  # DeepSpeed shards the root too
            nbytes = shard(full, n)
            cat += f" (ZeRO-3 shard 1/{n})"
            if pt.layer == 0 and sharding != "deepspeed":  # DeepSpeed gathers its own way (engine.deepspeed)
                gather += full
        grad_bytes = pdt.nbytes(grad_numel(pt.name, pt.numel, tp))
        keep = None
        if zero >= 2 and n > 1 and not f2 and sharding != "deepspeed":  # DeepSpeed: its buckets (engine.deepspeed)
            keep = shard(grad_bytes, n)
        rows.append((pt.name, nbytes, cat, pt.numel, 4 if quant else pdt.bits, pt.trainable, grad_bytes, pt.layer,
                     keep))
    shapes = tuple((pt.name, pt.shape) for pt in inventory) if f2 else ()  # TP: local shapes
    return tuple(rows), gather, shapes
