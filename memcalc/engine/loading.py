"""What loading the model allocates before the first step: the "load" phase of the timeline.

A QLoRA base is quantized on the GPU while it loads, one 16-bit tensor at a time, so loading has a
peak of its own: what is loaded so far, plus one 16-bit copy of the tensor being quantized, plus the
quantizer's locals and outputs. ``torch.cuda.max_memory_allocated`` read over a whole run without a
reset sees it (LitGPT's finetune scripts); a trainer that calls ``reset_peak_memory_stats`` after
set-up does not (torchtune's ``get_memory_stats(reset_stats=True)``), but the allocator keeps the
blocks those tensors freed (``max_memory_reserved``). Each framework's loader, as its code runs:

- **hf** (transformers 5.24 ``from_pretrained(..., quantization_config=BitsAndBytesConfig(
  load_in_4bit=True))``, core_model_loading.py ``convert_and_load_state_dict_in_model``): on-the-fly
  quantization turns the loader threads off (l.1863-1873: "to avoid worker threads loading
  full-precision tensors to GPU faster than the main thread can quantize them"); the checkpoint's
  tensors are taken in ``dot_natural_key`` order (l.1893, l.1497-1515); each is materialized on the
  GPU in the model dtype (``_materialize_copy``, l.1461-1466), a 4-bit linear's weight then goes through
  ``Bnb4bitQuantize.convert`` -> ``Params4bit._quantize`` -> bitsandbytes ``functional.quantize_4bit``
  (:func:`bnb_quantize_steps`), and the 16-bit copy is dropped before the next tensor (``del
  realized_value``, l.1990). With the profile's ``qlora_fp32_cast`` PEFT 0.21's
  ``prepare_model_for_kbit_training`` then casts every 16-bit parameter that is not a ``Params4bit``
  to fp32 in ``model.parameters()`` order (peft/utils/other.py l.193-207: ``param.data =
  param.data.to(torch.float32)``: the fp32 copy is made while the 16-bit one is alive), and
  ``get_peft_model`` adds the adapters.
- **torchtune** (0.6.1 recipes/lora_finetune_single_device.py ``_setup_model`` l.431-452): the model
  is built on the GPU (``with training.set_default_dtype(dtype), self._device``); every quantized
  linear makes its 16-bit ``nn.Linear`` weight and calls torchao's ``to_nf4`` on it
  (modules/peft/lora.py ``LoRALinear.__init__`` l.74-78, modules/low_precision/nf4_linear.py
  ``FrozenNF4Linear.__init__``), the 16-bit weight dropped with the local ``nn.Linear``; then
  ``model.load_state_dict(base_model_state_dict)`` from the CPU: torchao 0.14.1's NF4 ``copy_``
  (dtypes/nf4tensor.py l.434-458) copies each 16-bit tensor to the GPU (``copy_in.to(original.device)``),
  quantizes it again (``NF4Tensor.from_tensor``, :func:`torchao_to_nf4_steps`) and copies the
  quantized tensors into the parameter's; a 16-bit parameter is copied into in place.
- **litgpt** (0.5.13 finetune/lora.py l.210-236; lightning 2.6.6 fabric/plugins/precision/
  bitsandbytes.py): ``fabric.init_module(empty_init=False)`` on one device builds the model on the
  GPU, each ``_Linear4bit.__init__`` quantizing its freshly initialised weight (l.313-321:
  ``quantize_()``, whose ``quantize`` makes ``weight.contiguous().to(device, torch.half)``, l.343,
  and calls ``quantize_4bit``); ``load_checkpoint`` then runs ``model.load_state_dict`` whose
  pre-hook ``_quantize_on_load_hook`` (l.160-168) quantizes the checkpoint's tensor the same way and
  replaces the parameter (``_replace_param``: the old 4-bit storage freed after). Between the two,
  with bitsandbytes precision, lora.py l.219-227 swaps ``transformer.wte`` for a bitsandbytes
  ``StableEmbedding`` built on the CPU, copied into and moved to the GPU while the old embedding is
  alive (its LayerNorm's two vectors are not counted: the step's model does not have them either).

Without QLoRA every loader writes each tensor into its parameter (or materializes it in its dtype):
the load's peak is the weights. Everything here is arithmetic over the parameter rows of
:func:`memcalc.engine.weights.param_rows`; the validator traces the same loaders
(``memcalc.validate.loading``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from collections.abc import Iterator
from typing import Optional

from memcalc.core.dtypes import DType
from memcalc.core.rules import torchtune_rope_buffers
from memcalc.core.spec import ExperimentSpec
from memcalc.core.units import round_up
from memcalc.engine.params import param_inventory
from memcalc.engine.weights import param_rows

#: torchao 0.14.1 dtypes/nf4tensor.py ``CHUNK_SIZE = 1024**2``: ``convert_to_norm_float_weight``
#: finds the nearest NF4 value for this many elements at a time
TORCHAO_CHUNK = 1024**2
#: torchao ``to_nf4`` defaults (``block_size=64, scaler_block_size=256``), as torchtune calls it
TORCHAO_BLOCK, TORCHAO_SCALER_BLOCK = 64, 256

#: one step of a loader: ("+", key, bytes) allocates, ("-", key, 0) frees what ``key`` allocated
Step = tuple[str, str, int]


@lru_cache(maxsize=256)
def bnb_quantize_steps(numel: int, block: int, double_quant: bool) -> tuple[Step, ...]:
    """bitsandbytes 0.50 ``functional.quantize_4bit(A, blocksize, compress_statistics, "nf4")``
    as its CUDA kernel and code run (the fake kernels allocate the same outputs; traced on meta):
    the op's outputs, the packed weight (uint8, numel/2, key ``packed``) and the absmax (fp32 per
    block); the NF4 code (``get_4bit_type``: 16 fp32, built with an ``abs``/``max`` pair of 0-dim
    temporaries); with double quantisation ``offset = absmax.mean()``, ``absmax - offset``, the
    dynamic map copied to the device, ``quantize_blockwise``'s uint8 per block and fp32 per 256
    blocks, the map's second copy, and the fp32 absmax and its difference freed. Keys ending in
    ``*`` stay (the quantized tensor's storage)."""
    blocks = -(-numel // block)
    out: list[Step] = [("+", "packed*", (numel + 1) // 2), ("+", "absmax", 4 * blocks),
                       ("+", "code_abs", 4), ("+", "code_max", 4), ("-", "code_abs", 0),
                       ("+", "code*", 4 * 16), ("-", "code_max", 0)]
    if not double_quant:
        return tuple((s, "absmax*" if k == "absmax" else k, n) for s, k, n in out)
    return (*out, ("+", "offset*", 4), ("+", "centred", 4 * blocks),
            ("+", "qabsmax*", blocks), ("+", "absmax2*", 4 * -(-blocks // 256)), ("+", "map2*", 4 * 256),
            ("-", "absmax", 0), ("-", "centred", 0))


@lru_cache(maxsize=256)
def torchao_to_nf4_steps(numel: int, elem: int) -> tuple[Step, ...]:
    """torchao 0.14.1 ``to_nf4`` -> ``NF4Tensor.from_tensor`` of a ``numel``-element weight of
    ``elem`` bytes per element (dtypes/nf4tensor.py l.633-700), op by op:
    ``torch.tensor`` of the 16 NF4 values (a CUDA allocation the meta trace does not see: a
    factory outside dispatch); ``double_quantize_scalers`` (l.705-762: ``get_block_absmax``'s
    ``abs`` of the whole weight and ``max`` values/indices, the mean, the centred scalers, their
    absmax per 256, the quantization factor over every scaler (``256 / (2 * expanded)``: the
    comment at l.750 says it realizes n_scalers entries), the scaled, rounded and clamped
    scalers, their int8 copy and the factor made contiguous); ``convert_to_norm_float_weight``
    (l.790-827: the absmax again, ``blocks / scales`` (the whole weight), the uint8 index
    buffer, then per chunk of :data:`TORCHAO_CHUNK` elements ``quantize_tensor_nearest``
    (l.858-864: ``(value - nf4).abs()``, a (chunk, 16) tensor made twice, and ``min``'s values
    and int64 indices) and the uint8 copy; then the two nibbles packed (``<<``, ``|``)). The
    chunks run one after another, each freeing what it made, so one chunk is stepped (the
    first, the largest). Keys ending in ``*`` stay (the NF4 tensor)."""
    e = elem
    b = numel // TORCHAO_BLOCK
    sb = b // TORCHAO_SCALER_BLOCK
    c = min(numel, TORCHAO_CHUNK)
    return (
        ("+", "nf4*", 16 * e),
        # double_quantize_scalers
        ("+", "abs", e * numel), ("+", "s1", e * b), ("+", "idx", 8 * b), ("-", "abs", 0), ("-", "idx", 0),
        ("+", "mean*", e), ("+", "s1c", e * b), ("-", "s1", 0),
        ("+", "abs", e * b), ("+", "sabs", e * sb), ("+", "idx", 8 * sb), ("-", "abs", 0), ("-", "idx", 0),
        ("+", "t2", e * b), ("+", "recip", e * b), ("+", "qf", e * b), ("-", "t2", 0), ("-", "recip", 0),
        ("+", "m", e * b), ("+", "r", e * b), ("-", "m", 0), ("+", "cl", e * b), ("-", "r", 0),
        ("+", "qscalers*", b), ("+", "qfc*", e * sb),
        ("-", "cl", 0), ("-", "sabs", 0), ("-", "qf", 0), ("-", "s1c", 0),
        # convert_to_norm_float_weight
        ("+", "abs", e * numel), ("+", "scalers", e * b), ("+", "idx", 8 * b), ("-", "abs", 0), ("-", "idx", 0),
        ("+", "scaled", e * numel), ("+", "qblocks", numel),
        ("+", "sub", 16 * e * c), ("+", "diff", 16 * e * c), ("-", "sub", 0),
        ("+", "minv", e * c), ("+", "mini", 8 * c), ("-", "minv", 0), ("-", "diff", 0),
        ("+", "u8", c), ("-", "mini", 0), ("-", "u8", 0),
        ("+", "lsh", numel // 2), ("+", "packed*", numel // 2), ("-", "lsh", 0),
        ("-", "scalers", 0), ("-", "qblocks", 0), ("-", "scaled", 0),
    )


@lru_cache(maxsize=512)
def _summary(steps: tuple[Step, ...], round_bytes: int) -> tuple[int, tuple[tuple[str, int], ...]]:
    """What ``steps`` do to the live bytes: the highest point above where they start, and what stays
    (key, rounded bytes), for a phase that does not record its events."""
    live = top = 0
    held: dict[str, int] = {}
    for sign, key, n in steps:
        if sign == "+":
            held[key] = round_up(n, round_bytes)
            live += held[key]
            top = max(top, live)
        else:
            live -= held.pop(key)
    return top, tuple(held.items())


@dataclass
class LoadPhase:
    """The load phase: its allocated peak, where it is, what stays, and its allocations in order
    (``(uid, bytes)``, bytes 0 = free) for the allocator replay."""

    framework: str
    peak_bytes: int = 0
    peak_label: str = ""
    live_bytes: int = 0
    events: Optional[list[tuple[int, int]]] = None  # recorded when a list is given
    round_bytes: int = 512
    _next: int = 0
    _held: dict[str, tuple[int, int]] = field(default_factory=dict)

    def alloc(self, key: str, nbytes: int, label: str) -> int:
        """Allocate ``nbytes`` (rounded as the caching allocator does) under ``key``."""
        n = round_up(nbytes, self.round_bytes)
        self._next += 1
        uid = -self._next  # apart from the step's block ids
        if self.events is not None:
            self.events.append((uid, n))
        self._held[key] = (uid, n)
        self.live_bytes += n
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_label = self.live_bytes, label
        return uid

    def free(self, key: str) -> None:
        uid, n = self._held.pop(key)
        if self.events is not None:
            self.events.append((uid, 0))
        self.live_bytes -= n

    def run(self, steps: tuple[Step, ...], prefix: str, label: str) -> list[str]:
        """Run ``steps`` under ``prefix``; the keys that stay (``*``), as held now. Without recorded
        events, from their :func:`_summary` (the same peak and what stays, in one step)."""
        if self.events is None:
            top, stays = _summary(steps, self.round_bytes)
            if self.live_bytes + top > self.peak_bytes:
                self.peak_bytes, self.peak_label = self.live_bytes + top, label
            out = []
            for key, n in stays:
                self._next += 1
                self._held[f"{prefix}:{key}"] = (-self._next, n)
                self.live_bytes += n
                out.append(f"{prefix}:{key}")
            return out
        kept = []
        for sign, key, n in steps:
            k = f"{prefix}:{key}"
            if sign == "+":
                self.alloc(k, n, label)
                if key.endswith("*"):
                    kept.append(k)
            else:
                self.free(k)
        return kept


def _hf_key(name: str) -> list[tuple]:
    """transformers' ``dot_natural_key`` (core_model_loading.py l.1497-1515) of the checkpoint name
    of memcalc's parameter ``name`` (the Llama layout's names: ``model.`` prefix, ``self_attn``,
    ``input_layernorm`` / ``post_attention_layernorm``, ``model.norm``)."""
    hf = (name.replace(".attn.", ".self_attn.").replace(".norm1.", ".input_layernorm.")
          .replace(".norm2.", ".post_attention_layernorm.").replace("final_norm.", "norm."))
    if not hf.startswith("lm_head."):
        hf = "model." + hf
    parts: list[tuple] = []
    for part in hf.split("."):
        if part.isdigit():
            parts.append((0, int(part)))
        else:
            text = part.rstrip("0123456789")
            digits = part[len(text):]
            parts.append((1, text, int(digits)) if digits else (1, text))
    return parts


def _rows(exp: ExperimentSpec) -> Iterator[tuple[str, int, int, bool, str]]:
    """(name, bytes as the step holds it, elements, quantized, kind) of every parameter, in module order."""
    kinds = {p.name: (p.kind, p.quantizable) for p in param_inventory(exp.model, exp.training.lora)}
    qlora = exp.training.lora is not None and exp.training.lora.qlora
    for name, nbytes, _cat, numel, bits, *_ in param_rows(exp):
        kind, _quantizable = kinds[name]
        yield name, nbytes, numel, qlora and bits == 4, kind  # (LitGPT's head too: weights.quantized_head)


def load_phase(exp: ExperimentSpec, events: bool = False) -> LoadPhase:
    """The load phase of ``exp`` (see the module docstring): every framework's QLoRA loader; without
    QLoRA (or under sharding, whose loaders are not modelled) the weights as the step holds them.
    ``events`` records every allocation and free (``LoadPhase.events``, for an allocator replay)."""
    fw = exp.profile.framework
    ld = LoadPhase(fw, round_bytes=exp.profile.allocator_round_bytes, events=[] if events else None)
    tr = exp.training
    qlora = tr.lora is not None and tr.lora.qlora and tr.gpus == 1 and tr.tp == 1
    rows = list(_rows(exp))
    if not qlora:
        for name, nbytes, *_ in rows:
            ld.alloc(name, nbytes, "weights")
        _torchtune_rope(ld, exp)
        return ld
    {"torchtune": _torchtune, "litgpt": _litgpt}.get(fw, _hf)(ld, exp, rows)
    return ld


def _torchtune_rope(ld: LoadPhase, exp: ExperimentSpec) -> None:
    if exp.profile.framework == "torchtune" and exp.model.positions == "rope":  # built with the model
        for n, b in zip(("rope.theta", "rope.cache"), torchtune_rope_buffers(exp.model), strict=True):
            ld.alloc(n, b, "RoPE cache")


def _bnb(ld: LoadPhase, numel: int, exp: ExperimentSpec, prefix: str, label: str) -> list[str]:
    """bitsandbytes ``quantize_4bit`` of one weight (:func:`bnb_quantize_steps`); the first double
    quantisation also makes the process-wide dynamic map (``name2qmap["dynamic"]``, 256 fp32)."""
    lora = exp.training.lora
    assert lora is not None
    if lora.double_quant and "bnb:name2qmap" not in ld._held:
        ld.alloc("bnb:name2qmap", 4 * 256, label)
    return ld.run(bnb_quantize_steps(numel, lora.quant_block, lora.double_quant), prefix, label)


def _hf(ld: LoadPhase, exp: ExperimentSpec, rows: list) -> None:
    tr = exp.training
    e = tr.weight_dtype.nbytes(1)
    base = sorted((r for r in rows if r[4] != "lora"), key=lambda r: _hf_key(r[0]))
    for name, _nbytes, numel, quant, _kind in base:
        label = f"loading {name}"
        if not quant:
            ld.alloc(name, e * numel, label)  # materialized in the model dtype, kept
            continue
        ld.alloc(f"{name}:bf16", e * numel, f"quantizing {name}")
        _bnb(ld, numel, exp, name, f"quantizing {name}")
        ld.free(f"{name}:bf16")
    if exp.profile.qlora_fp32_cast:  # prepare_model_for_kbit_training, module order
        for name, _nbytes, numel, quant, kind in rows:
            if kind == "lora" or quant or e != 2:
                continue
            ld.alloc(f"{name}:fp32", 4 * numel, f"prepare_model_for_kbit_training: {name} to fp32")
            ld.free(name)
    adt = exp.adapter_dtype or tr.weight_dtype
    for name, _nbytes, numel, _quant, kind in rows:  # get_peft_model
        if kind == "lora":
            ld.alloc(name, adt.nbytes(numel), "get_peft_model")


def _torchtune(ld: LoadPhase, exp: ExperimentSpec, rows: list) -> None:
    e = exp.training.weight_dtype.nbytes(1)
    _torchtune_rope(ld, exp)
    for name, nbytes, numel, quant, _kind in rows:  # built on the GPU, module order
        if not quant:
            ld.alloc(name, nbytes, f"building {name}")
            continue
        ld.alloc(f"{name}:init", e * numel, f"building {name} (to_nf4)")
        ld.run(torchao_to_nf4_steps(numel, e), name, f"building {name} (to_nf4)")
        ld.free(f"{name}:init")
    for name, _nbytes, numel, quant, _kind in rows:  # load_state_dict: NF4Tensor.copy_
        if quant:
            label = f"load_state_dict: {name} (NF4 copy_)"
            ld.alloc(f"{name}:in", e * numel, label)
            for k in ld.run(torchao_to_nf4_steps(numel, e), f"{name}:new", label):
                ld.free(k)
            ld.free(f"{name}:in")


def _litgpt(ld: LoadPhase, exp: ExperimentSpec, rows: list) -> None:
    tr = exp.training
    e = tr.weight_dtype.nbytes(1)
    half = tr.weight_dtype != DType.fp16  # quantize's .to(torch.half) copies unless already fp16
    kept: dict[str, list[str]] = {}
    for name, nbytes, numel, quant, _kind in rows:  # fabric.init_module on the GPU, module order
        if not quant:
            ld.alloc(name, nbytes, f"building {name}")
            continue
        label = f"building {name} (_Linear4bit.quantize_)"
        ld.alloc(f"{name}:init", e * numel, label)
        if half:
            ld.alloc(f"{name}:fp16", 2 * numel, label)
        kept[name] = _bnb(ld, numel, exp, f"{name}:0", label)
        if half:
            ld.free(f"{name}:fp16")
        ld.free(f"{name}:init")
    emb = next((r for r in rows if r[4] == "embedding"), None)
    if emb is not None:  # lora.py l.219-227: wte -> bnb StableEmbedding, built on the CPU, copied, moved
        ld.alloc(f"{emb[0]}:stable", emb[1], "bitsandbytes StableEmbedding replaces wte")
        ld.free(emb[0])
    for name, _nbytes, numel, quant, _kind in rows:  # load_checkpoint: _quantize_on_load_hook
        if quant:
            label = f"load_checkpoint: {name} (_quantize_on_load_hook)"
            ld.alloc(f"{name}:fp16", 2 * numel, label)
            new = _bnb(ld, numel, exp, f"{name}:1", label)
            for k in kept.pop(name):  # _replace_param: the old storage goes
                ld.free(k)
            kept[name] = new
            ld.free(f"{name}:fp16")


__all__ = ["LoadPhase", "bnb_quantize_steps", "load_phase", "torchao_to_nf4_steps"]
