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
from collections.abc import Callable
from typing import Optional

from memcalc.core.dtypes import DType
from memcalc.core.kernels import ALLOCATOR_ROUND_BYTES
from memcalc.core.units import round_up
from memcalc.core.spec import ExperimentSpec, LoraSpec, ModelSpec
from memcalc.core.rules import packed_4bit_parts, torchtune_rope_buffers
from memcalc.engine import fsdp
from memcalc.engine.params import param_inventory
from memcalc.engine.sharding import offload_param, shard, uses_deepspeed
from memcalc.engine.sim import Param, Sim
from memcalc.engine.expert_fsdp import fsdp_shard_numel, routed_experts, shard_world
from memcalc.engine.expert_parallel import expert_degree
from memcalc.engine.tensor_parallel import grad_numel, local_experiment


#: bitsandbytes' code books: NF4's 16 fp32 values (``functional.get_4bit_type``) and, with double
#: quantisation, the 256-value dynamic map of the absmax (``create_dynamic_map``, ``state2.code``);
#: the nested absmax is quantised in blocks of 256 (``quantize_blockwise(blocksize=256)``)
NF4_CODE_VALUES, DYNAMIC_CODE_VALUES, NESTED_BLOCK = 16, 256, 256


def quantized_bytes(numel: int, block: int, double_quant: bool, round_bytes: int = ALLOCATOR_ROUND_BYTES) -> int:
    """NF4 storage of a QLoRA base weight as bitsandbytes 0.50 ``functional.quantize_4bit`` leaves it
    (Dettmers et al. 2023), each tensor its own CUDA allocation (rounded to ``round_bytes``): the
    packed 4-bit values (uint8, numel/2), the absmax (fp32 per block) and the NF4 code (16 fp32);
    with double quantisation (``compress_statistics=True``) the absmax is uint8 per block, plus
    ``offset`` (a 0-dim fp32: ``absmax.mean()``), ``state2.absmax`` (fp32 per 256 blocks) and
    ``state2.code`` (256 fp32). The validator counts the same tensors (validate/hf_qlora.py)."""
    blocks = -(-numel // block)
    parts = [DType.nf4.nbytes(numel), 4 * NF4_CODE_VALUES]
    if double_quant:
        parts += [blocks, 4, 4 * -(-blocks // NESTED_BLOCK), 4 * DYNAMIC_CODE_VALUES]
    else:
        parts.append(4 * blocks)
    return sum(round_up(p, round_bytes) for p in parts)


def kbit_dtype(name: str, wdt: DType, quantized: set[str]) -> DType:
    """A QLoRA model's non-4-bit parameter after PEFT 0.21 ``prepare_model_for_kbit_training``
    (peft/utils/other.py: ``param.data = param.data.to(torch.float32)`` for every fp16/bf16
    parameter that is not a ``Params4bit``): fp32, except a 4-bit linear's bias, which
    ``Linear4bit.forward`` casts back to the compute dtype in the first step (bitsandbytes/nn/
    modules.py: ``bias.data = bias.data.to(x.dtype)``)."""
    if wdt.bits != 16:
        return wdt
    if name.endswith(".bias") and name.removesuffix(".bias") in quantized:
        return wdt
    return DType.fp32


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
    # a framework's persistent GPU buffers, made once in the step and held (Unsloth's global dequantisation buffer)
    buffers: dict[str, list] = field(default_factory=dict)


def quantized_head(exp: ExperimentSpec) -> bool:
    """Whether QLoRA stores the output head in 4-bit too: LitGPT's finetune/lora.py builds the model
    under ``fabric.init_module()`` with ``BitsandbytesPrecision(quantize[4:], dtype)`` and no
    ``ignore_modules``, whose ``module_init_context`` replaces ``torch.nn.Linear`` itself with the
    4-bit class (lightning/fabric/plugins/precision/bitsandbytes.py ``_ClassReplacementContextManager``),
    so ``GPT.lm_head`` is a ``_Linear4bit`` as every other linear is (LitGPT 0.4 to 0.5.13, lightning
    2.3 to 2.6). transformers' bitsandbytes quantizer keeps ``lm_head`` 16-bit (``get_keys_to_not_convert``)
    and torchtune quantizes only the LoRA-wrapped linears."""
    lora = exp.training.lora
    return lora is not None and lora.qlora and exp.profile.framework == "litgpt"


def param_rows(exp: ExperimentSpec) -> tuple[tuple, ...]:
    """Each parameter's allocation as :func:`make_params` makes it (:func:`_param_rows`' rows), for
    what runs before the step (:mod:`memcalc.engine.loading`)."""
    tr = exp.training
    f2 = fsdp.fsdp_active(tr)
    z3 = tr.zero >= 3 and (tr.gpus > 1 or uses_deepspeed(exp)) and not f2
    return _param_rows(
        local_experiment(exp).model, tr.lora, tr.weight_dtype, exp.adapter_dtype or tr.weight_dtype, tr.gpus, f2,
        f2 and tr.sharding == "fsdp1", fsdp.policy(tr).orig if f2 else None, z3, tr.zero, tr.sharding,
        tr.offload_optimizer, tr.tp, exp.profile.qlora_fp32_cast, ep=expert_degree(exp),
        quant_head=quantized_head(exp), titan=tr.pp > 1)[0]


def make_params(sim: Sim, exp: ExperimentSpec,
                only: Optional[Callable[[str, Optional[int]], bool]] = None) -> Model:
    """Allocate every parameter at the precision policy's weight dtype, LoRA adapters at theirs
    (:attr:`ExperimentSpec.adapter_dtype`); weights exist before the step. What each parameter
    allocates depends only on the model and a few training fields, so it is worked out once per
    those (:func:`_param_rows`) and every simulated step of them only allocates. ``only(name, layer)``:
    only the parameters it accepts (a pipeline stage's, :mod:`memcalc.engine.pipeline`)."""
    tr = exp.training
    wdt = tr.weight_dtype
    f2 = fsdp.fsdp_active(tr)  # FSDP2 or FSDP1: every parameter sharded in the original dtype
    f1 = f2 and tr.sharding == "fsdp1"
    z3 = tr.zero >= 3 and (tr.gpus > 1 or uses_deepspeed(exp)) and not f2  # DeepSpeed's ds_tensor on one rank too
    rows, gather, shapes = _param_rows(
        local_experiment(exp).model, tr.lora, wdt, exp.adapter_dtype or wdt, tr.gpus, f2, f1,
        fsdp.policy(tr).orig if f2 else None, z3, tr.zero, tr.sharding,
        tr.offload_optimizer, tr.tp, exp.profile.qlora_fp32_cast, z3 and offload_param(exp), expert_degree(exp),
        quantized_head(exp), tr.pp > 1)
    if only is not None:
        rows = tuple(r for r in rows if only(r[0], r[7]))
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
    if exp.profile.framework == "torchtune" and exp.model.positions == "rope":  # its RoPE cache buffers
        sim.alloc_many("weights", [(b, "buffers", n, b // 4, 32) for n, b in
                                   zip(("rope.theta", "rope.cache"), torchtune_rope_buffers(exp.model), strict=True)])
    return Model(exp.model, params, order, tr.compute_dtype, gather, dict(shapes), f2, f1)


def _storage(pt, lora: Optional[LoraSpec], quant: bool, wdt: DType, adt: DType,
             kbit_quantized: Optional[set[str]]) -> tuple[DType, int, str]:
    """(dtype, whole-tensor bytes, category) of the parameter ``pt``: an adapter in the adapters'
    dtype, a QLoRA base weight as packed NF4 (:func:`quantized_bytes`), any other in the weight
    dtype, or after ``prepare_model_for_kbit_training`` (``kbit_quantized``: the 4-bit linears'
    names) as :func:`kbit_dtype` says."""
    if quant:
        assert lora is not None
        if lora.quant is not None:  # GPTQ / AWQ: core.rules.packed_4bit_parts, each buffer its own allocation
            parts = packed_4bit_parts(lora.quant, pt.shape[1], pt.shape[0])
            return wdt, sum(round_up(p, ALLOCATOR_ROUND_BYTES) for p in parts), \
                f"frozen base weights ({lora.quant.upper()})"
        return wdt, quantized_bytes(pt.numel, lora.quant_block, lora.double_quant), "frozen base weights (NF4)"
    pdt = adt if pt.kind == "lora" else wdt if kbit_quantized is None else kbit_dtype(pt.name, wdt, kbit_quantized)
    return pdt, pdt.nbytes(pt.numel), "weights" if pt.trainable or lora is None else "frozen base weights"


def _shard_dtype(pt, pdt: DType, wdt: DType, f2_orig: Optional[DType], f1: bool) -> DType:
    """The dtype of ``pt``'s FSDP shard: the policy's original dtype (``f2_orig``), an adapter in its own.
    FSDP2 under ``--master-weights`` (an fp32 ``f2_orig`` over a 16-bit weight dtype) holds fp32 shards
    of the trainable parameters only: accelerate 1.15 ``utils/fsdp_utils.py`` ``fsdp2_prepare_model``
    casts up ``param.requires_grad and param.dtype != torch.float32`` ones ("FSDP2 requires uniform
    orig_dtype among trainable params in each group"; torch 2.13 ``_fsdp_param_group.py``
    ``_init_mp_dtypes`` checks the trainable ones alone), so a frozen base keeps its 16-bit shards
    (validate/sharded/fsdp2.py ``upcast_trainable`` builds the same). A QLoRA base after PEFT's
    ``prepare_model_for_kbit_training`` holds fp32 shards of its non-4-bit parameters under FSDP2."""
    if not f1 and f2_orig is not None and f2_orig != wdt:
        return f2_orig if pt.trainable else pdt
    if not f1 and pdt != wdt:  # PEFT's k-bit fp32 cast (kbit_dtype): fully_shard keeps each parameter's own dtype
        return pdt  # (torch 2.13 distributed/fsdp/_fully_shard/_fsdp_param.py: the shard is the parameter's chunk)
    return pdt if pt.kind == "lora" else f2_orig  # type: ignore[return-value]


def _quantized_base(lora: Optional[LoraSpec], kbit_fp32: bool) -> tuple[bool, bool]:
    """(whether the base's linears are 4-bit: QLoRA's NF4 or a GPTQ / AWQ base, whether PEFT's
    ``prepare_model_for_kbit_training`` casts the other 16-bit parameters to fp32): not for a GPTQ model
    (peft/utils/other.py ``not is_gptq_quantized``); an AWQ one is cast as a bitsandbytes one."""
    quant = lora is not None and (lora.qlora or lora.quant is not None)
    return quant, quant and kbit_fp32 and not (lora is not None and lora.quant == "gptq")


@lru_cache(maxsize=128)
def _param_rows(local: ModelSpec, lora: Optional[LoraSpec], wdt: DType, adt: DType, n: int, f2: bool, f1: bool,
                f2_orig: Optional[DType], zero3: bool, zero: int, sharding: str, offload_optimizer: bool,
                tp: int, kbit_fp32: bool = False, ds_offload_param: bool = False,
                ep: int = 1, quant_head: bool = False, titan: bool = False) -> tuple[tuple, int, tuple]:
    """Each parameter's allocation as :func:`make_params` makes it: (name, bytes, category,
    elements, width in bits, trainable, gradient bytes, layer, the gradient shard kept after a
    reduce-scatter or None); the ZeRO-3 layer gather bytes; the shapes FSDP shards by. From
    everything make_params reads of the spec: the model one tensor-parallel rank holds, the LoRA
    spec, the weight and adapter dtypes, the GPUs, FSDP2/FSDP1 and FSDP's original dtype, ZeRO-3
    (not FSDP), the ZeRO stage, the sharding, optimizer offload, the tensor-parallel degree and the
    profile's ``qlora_fp32_cast`` (:func:`kbit_dtype`) and DeepSpeed ZeRO-3's ``offload_param`` (the
    partitions on the host: no device bytes, :func:`memcalc.engine.sharding.offload_param`) and the
    expert-parallel degree (this rank's routed experts: :mod:`memcalc.engine.expert_parallel`), whether
    QLoRA quantizes the output head too (:func:`quantized_head`) and whether torchtitan places the experts'
    FSDP2 shards (``titan``, under ``--pp``: :func:`memcalc.engine.expert_fsdp.fsdp_shard_numel`)."""
    rows = []
    gather = 0
    inventory = param_inventory(local, lora, ep)  # expert parallelism: this rank's experts
    n_experts = routed_experts(local)
    qlora, kbit = _quantized_base(lora, kbit_fp32)
    quantized = {pt.name.removesuffix(".weight") for pt in inventory if pt.quantizable} if kbit else set()
    for pt in inventory:
        quant = qlora and (pt.quantizable or (quant_head and pt.name == "lm_head.weight" and not pt.trainable))
        pdt, full, cat = _storage(pt, lora, quant, wdt, adt, quantized if kbit else None)
        nbytes = full
        if f2:  # this rank's padded row shard (FSDP1: its share of the flat shard), original dtype
            elems = -(-pt.numel // n) if f1 else fsdp_shard_numel(pt.shape, pt.kind, n, ep, n_experts, titan)
            nbytes = -(-full * elems // pt.numel) if quant else _shard_dtype(pt, pdt, wdt, f2_orig, f1).nbytes(elems)
            cat += f" (FSDP{1 if f1 else 2} shard 1/{shard_world(pt.kind, n, ep)})"
            if offload_optimizer:  # CPUOffloadPolicy: the shards live in host memory
                nbytes = 0
        elif zero3 and (pt.layer is not None or sharding == "deepspeed"):  # DeepSpeed shards the root too
            nbytes = 0 if ds_offload_param else shard(full, n)
            cat += f" (ZeRO-3 shard 1/{n}{', on the host' if ds_offload_param else ''})"
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
