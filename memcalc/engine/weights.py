"""The model's parameters as simulator blocks, allocated before the step.

Each parameter of the inventory (:mod:`memcalc.engine.params`) is allocated at the precision
policy's weight dtype, a QLoRA base as packed NF4, a ZeRO-3 layer weight as this rank's shard.
"""

from __future__ import annotations

from dataclasses import dataclass

from memcalc.core.dtypes import DType
from memcalc.core.spec import ExperimentSpec, ModelSpec
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


def make_params(sim: Sim, exp: ExperimentSpec) -> Model:
    """Allocate every parameter at the precision policy's weight dtype, LoRA adapters at theirs
    (:attr:`ExperimentSpec.adapter_dtype`); weights exist before the step."""
    tr = exp.training
    lora = tr.lora
    wdt = tr.weight_dtype
    adt = exp.adapter_dtype or wdt  # LoRA adapters: fp32 or the base's dtype (ExperimentSpec.adapter_dtype)
    n = tr.gpus
    zero3 = tr.zero >= 3 and n > 1
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
        if zero3 and pt.layer is not None:
            nbytes = shard(full, n)
            cat += f" (ZeRO-3 shard 1/{n})"
            if pt.layer == 0:
                gather += full
        w = sim.alloc(nbytes, "weights", cat, name=pt.name)
        w.numel, w.itemsize_bits = pt.numel, (4 if quant else pdt.bits)
        p = Param(pt.name, w, pt.trainable, pdt.nbytes(grad_numel(pt.name, pt.numel, tr.tp)), pt.layer, pt.numel)
        if tr.zero >= 2 and n > 1:
            p.grad_keep_bytes = shard(p.grad_bytes, n)
        params[pt.name] = p
        order.append(p)
    return Model(exp.model, params, order, tr.compute_dtype, gather)
