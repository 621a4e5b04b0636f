"""The optimizer registry: one record per optimizer, read by every consumer.

The spec's allowed names (``memcalc.core.spec``), the CLI's ``--optimizer`` choices and
help, the bytes-per-parameter table (``memcalc.estimate.peak``), the plan's searched
optimizers and their display names (``memcalc.plan``), the simulated state and step
temporaries (``memcalc.engine.optimizers`` dispatches on :attr:`OptimizerRecord.state`
and :attr:`OptimizerRecord.step`) and the validator's builders (``validate/optim.py``)
all read :data:`OPTIMIZERS`. Adding an optimizer is one record here, plus its simulation
kinds in the engine and its builder in validate if they are new (a test checks that
every record is accepted by each of them).

Each record also carries its :class:`Alias` es: the names trainers' configs give it (Hugging Face
``TrainingArguments.optim``, which axolotl takes too; the class paths torchtune's
``_component_`` and LitGPT's ``class_path`` instantiate; LitGPT's short ``torch.optim`` names),
each with the source it follows. The recipe readers and the Trainer callback look names up with
:func:`alias_table`; a name without an alias is not modelled.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal, Optional

from memcalc.core.errors import unknown_name

#: ``optimizer_impl`` values: torch.optim's ``foreach=True`` (multi-tensor), ``fused=True``
#: (one fused CUDA kernel) and ``foreach=False`` (a Python loop over parameters).
IMPLS = ("foreach", "fused", "for-loop")
#: The spec's default ``optimizer_impl`` (CUDA's default for torch.optim); for an optimizer
#: without a multi-tensor step it stands for that optimizer's own (only) step.
DEFAULT_IMPL = "foreach"

#: How the state of one parameter is laid out (``memcalc.engine.optimizers.state_bytes``):
#: none; ``moments`` tensors like the parameter (in the state dtype); Adafactor's factored
#: second moment (a row and a column vector for matrices); bitsandbytes' blockwise 8-bit.
StateLayout = Literal["none", "like_param", "factored", "blockwise_8bit", "fp32", "torchao_4bit", "torchao_8bit",
                      "torchao_fp8"]
#: Which temporaries the step makes (``memcalc.engine.optimizers.per_param_temps``; ``galore``: its own loop,
#: ``memcalc.engine.galore``).
StepKind = Literal["none", "adam", "lion", "adafactor", "torchao", "galore"]

#: bitsandbytes blockwise quantisation: one fp32 absmax per block of this many elements
#: (bitsandbytes/optim/optimizer.py ``Optimizer8bit``, blockwise=True, block size 256).
BNB_BLOCK = 256
#: bitsandbytes ``min_8bit_size``: tensors with fewer elements keep 32-bit state.
BNB_MIN_8BIT_SIZE = 4096
#: bitsandbytes paged optimizers page a state buffer only for parameters of at least this many
#: elements (bitsandbytes/optim/optimizer.py ``Optimizer8bit.get_state_buffer``: ``p.numel() < 1e5``
#: -> ``torch.zeros_like``, else ``F.get_paged``: cudaMallocManaged unified memory)
BNB_PAGED_MIN_NUMEL = 100_000


@dataclass(frozen=True)
class TorchaoLowBit:
    """One torchao low-bit optimizer state (torchao 0.14.1 torchao/optim/adam.py ``_AdamBase._new_buffer``:
    a parameter of at least :data:`TORCHAO_MIN_QUANT_SIZE` elements whose count divides by ``block`` gets a
    quantized state tensor subclass per moment, any other gets ``torch.zeros_like(p)`` in the parameter's
    dtype), and the temporaries of its ``single_param_adam`` step."""

    #: the class's default ``block_size`` (AdamW4bit 128, AdamW8bit / AdamWFp8 256)
    block: int
    #: bytes of the codes per element: subclass_4bit.py ``OptimState4bit.zeros`` packs two 4-bit codes in a
    #: uint8 (``n // 2``); subclass_8bit.py one uint8, subclass_fp8.py one float8_e4m3fn per element
    code_bytes: float
    #: the lookup table each quantized moment holds (``qmap``, fp32): 4-bit ``create_dynamic_map(True, 3, 4)`` /
    #: 16 linear levels = 16 entries; 8-bit ``create_dynamic_map`` = 256 entries; fp8 none
    qmap_bytes: int
    #: the step's temporaries for one quantized parameter, bytes per element and a constant: the peak of
    #: ``single_param_adam`` (adam.py, ``torch.compile(fullgraph=True)``) as the functional graph AOTAutograd
    #: hands Inductor, every intermediate realised and freed at its last use (dequantized moments, the fp32
    #: parameter and gradient, the blockwise ``scale_tensor`` and ``quantize_*_with_qmap`` codes of the
    #: ``copy_`` back, int64 where ``torch.where`` makes them): traced on meta by
    #: ``validate/optim.py`` (``tests/trace/test_torchao_optim.py`` re-traces it). Inductor fuses them on
    #: CUDA, so the step there holds at most this (Triton's plan cannot be traced without CUDA)
    temp_per_elem: float
    temp_const: int


#: torchao ``_new_buffer``: "follow bitsandbytes, only quantize tensors >= 4096 values"
TORCHAO_MIN_QUANT_SIZE = 4096
#: the step of a parameter whose state stays unquantized (``zeros_like(p)``): ``single_param_adam``'s fp32
#: copies of the parameter, gradient and both moments and their updates, per element of the parameter, by
#: its width in bytes (traced as :attr:`TorchaoLowBit.temp_per_elem`)
TORCHAO_PLAIN_TEMP_PER_ELEM = {2: 20, 4: 24}
#: state layout -> the torchao optimizer it is (adam.py AdamW4bit / AdamW8bit / AdamWFp8)
TORCHAO: dict[str, TorchaoLowBit] = {
    "torchao_4bit": TorchaoLowBit(128, 0.5, 64, 44.625, 128),
    "torchao_8bit": TorchaoLowBit(256, 1.0, 1024, 45.0625, 2048),
    "torchao_fp8": TorchaoLowBit(256, 1.0, 0, 20.03125, 0),
}


#: GaLore's projection rank when none is given: transformers 5.24 trainer_optimizer.py ``_get_galore_optimizer``
#: (``optim_args`` rank 128; update_proj_gap 200, scale 0.25, proj_type "std")
GALORE_RANK = 128


def galore_target(name: str, shape: tuple[int, ...]) -> bool:
    """Whether GaLore projects this parameter: a matrix of a decoder layer (its linears: transformers'
    ``_setup_low_rank_optimizer`` takes the ``nn.Linear`` modules ``optim_target_modules`` names, the GaLore
    recipe's ``["attn", "mlp"]`` being every projection of a Llama-style layer); the embedding, head and norms
    step as plain AdamW in galore_torch's loop (their own param group)."""
    return len(shape) == 2 and min(shape) > 1 and "layers." in name


def galore_shapes(m: int, n: int, rank: int, itemsize: int) -> tuple[int, int]:
    """(bytes of one low-rank moment, bytes of the projector) of an m x n weight: the projected gradient is
    max(m, n) x r (r = min(rank, m, n)), in the weight's dtype (galore_torch adamw.py ``zeros_like(grad)``);
    the projector is ``Vh[:r]`` / ``U[:, :r]`` cast to a 16-bit weight's dtype (r x min(m, n)), or for an fp32
    weight a view that keeps the whole fp32 ``Vh`` / ``U`` (min(m, n) squared; galore_projector.py
    ``get_orthogonal_matrix``)."""
    k = min(m, n)
    r = min(rank, k)
    return itemsize * r * max(m, n), (4 * k * k if itemsize == 4 else itemsize * r * k)


def torchao_quantized(numel: int, layout: str) -> bool:
    """torchao ``_new_buffer``'s test: ``numel >= 4096 and numel % block_size == 0``."""
    return numel >= TORCHAO_MIN_QUANT_SIZE and numel % TORCHAO[layout].block == 0


#: Where an external name comes from: ``hf``: transformers ``TrainingArguments.optim``
#: (``OptimizerNames``; axolotl's ``optimizer`` takes the same names); ``class``: an import path
#: (torchtune ``optimizer._component_``, LitGPT ``optimizer.class_path``); ``litgpt``: LitGPT's
#: ``optimizer: AdamW`` (a ``torch.optim`` class name).
AliasKind = Literal["hf", "class", "litgpt"]
ALIAS_KINDS: tuple[AliasKind, ...] = ("hf", "class", "litgpt")


@dataclass(frozen=True)
class Alias:
    """One external name of an optimizer, and the source that says what it builds."""

    kind: AliasKind
    name: str
    source: str
    #: the ``optimizer_impl`` the name implies (None: the optimizer's default)
    impl: Optional[str] = None
    #: said when the name is read: how the estimate approximates what the name builds
    note: Optional[str] = None


@dataclass(frozen=True)
class OptimizerRecord:
    """One optimizer: its name, what its state and step hold, and where that comes from."""

    name: str  # the spec / CLI name
    display: str  # shown in plan labels
    help: str  # one phrase for --help
    state: StateLayout
    moments: int  # state tensors per parameter for like_param / blockwise_8bit layouts
    step: StepKind
    impls: tuple[str, ...]  # implementations that exist, from IMPLS
    plan_order: Optional[int]  # position in `memcalc plan`'s search; None = not searched
    source: str  # the code the state and temporaries follow
    #: bitsandbytes paged state: the moment buffers of large parameters live in CUDA unified memory
    #: (outside PyTorch's caching allocator; they page to the host under memory pressure)
    paged: bool = False
    #: the names trainers give this optimizer (:func:`alias_table`)
    aliases: tuple[Alias, ...] = ()

    @property
    def has_foreach(self) -> bool:
        """torch.optim's multi-tensor step exists (the whole-group temporaries of a foreach step)."""
        return "foreach" in self.impls

    def effective_impl(self, impl: str) -> str:
        """The implementation that runs: ``impl``, or the optimizer's own step when ``impl`` is the
        default and the optimizer has no multi-tensor version."""
        return impl if impl in self.impls else self.impls[0]

    def state_bytes_per_param(self, state_itemsize: float) -> float:
        """Bytes of optimizer state per trainable parameter, for the bytes-per-parameter table:
        ``moments`` state-dtype tensors; 8-bit moments plus an fp32 absmax per block; 0 for a
        factored second moment (rows + columns, negligible per parameter) or no state."""
        if self.state == "like_param":
            return self.moments * state_itemsize
        if self.state == "blockwise_8bit":
            return self.moments * (1 + 4 / BNB_BLOCK)
        if self.state == "fp32":
            return self.moments * 4.0
        if self.state in TORCHAO:
            ao = TORCHAO[self.state]
            return self.moments * (ao.code_bytes + 4 / ao.block)
        return 0.0


_TORCH_OPTIM = "torch/optim/{f}.py (_init_group; _multi_tensor_{n} / _single_tensor_{n} / fused kernel)"

#: transformers 5.24 training_args.py ``OptimizerNames`` and trainer_optimizer.py (``_OPTIMIZER_HANDLERS``,
#: what ``Trainer.get_optimizer_cls_and_kwargs`` dispatches on)
_HF = "transformers 5.24 training_args.py OptimizerNames.{e}; trainer_optimizer.py {f}"
_BNB_HF = _HF.replace("{f}", "_get_bitsandbytes_optimizer: bitsandbytes.optim.{c}(optim_bits={b}, is_paged={p})")
_CLASS = "the class path torchtune's _component_ / LitGPT's class_path instantiate"
_LITGPT = "LitGPT litgpt/utils.py instantiate_torch_optimizer: a bare name is looked up in torch.optim"
_TORCHAO = "torchao 0.14.1 torchao/optim/adam.py {c} (_AdamBase._new_buffer, single_param_adam); subclass_{m}.py"
_TORCHAO_HF_NOTE = ("transformers passes block_size=256 (optim_args block_size); modelled with torchao's default "
                    "block of 128")


def _hf(name: str, enum: str, how: str, impl: Optional[str] = None, note: Optional[str] = None) -> Alias:
    return Alias("hf", name, _HF.format(e=enum, f=how), impl, note)


def _bnb(name: str, enum: str, cls: str, bits: int, paged: bool) -> Alias:
    return Alias("hf", name, _BNB_HF.format(e=enum, c=cls, b=bits, p=paged))


def _cls(path: str, note: Optional[str] = None) -> Alias:
    return Alias("class", path, _CLASS, None, note)


def _lit(name: str) -> Alias:
    return Alias("litgpt", name, _LITGPT)


OPTIMIZERS: dict[str, OptimizerRecord] = {
    r.name: r
    for r in (
        OptimizerRecord("adamw", "AdamW", "torch.optim.AdamW, two moments", "like_param", 2, "adam", IMPLS, 0,
                        _TORCH_OPTIM.format(f="adamw", n="adamw"), aliases=(
                            # torch.optim.AdamW without foreach/fused: CUDA's default, foreach
                            _hf("adamw_torch", "ADAMW_TORCH", "_get_adamw_torch: torch.optim.AdamW", "foreach"),
                            _hf("adamw_torch_fused", "ADAMW_TORCH_FUSED", "_get_adamw_torch: fused=True", "fused"),
                            Alias("hf", "adamw_hf", "transformers 4.x OptimizerNames.ADAMW_HF: transformers."
                                  "optimization.AdamW, a loop over the parameters (gone from 5.x's OptimizerNames)",
                                  "for-loop"),
                            _cls("torch.optim.AdamW"), _lit("AdamW"))),
        OptimizerRecord("adam", "Adam", "torch.optim.Adam, two moments", "like_param", 2, "adam", IMPLS, None,
                        _TORCH_OPTIM.format(f="adam", n="adam"), aliases=(_cls("torch.optim.Adam"), _lit("Adam"))),
        OptimizerRecord("sgd", "SGD", "torch.optim.SGD, no state", "none", 0, "none", IMPLS, None,
                        _TORCH_OPTIM.format(f="sgd", n="sgd"), aliases=(
                            _hf("sgd", "SGD", "_get_sgd: torch.optim.SGD, momentum 0 unless optim_args"),
                            _cls("torch.optim.SGD"), _lit("SGD"))),
        OptimizerRecord("sgd-momentum", "SGD-momentum", "torch.optim.SGD(momentum=0.9), one buffer", "like_param", 1,
                        "none", IMPLS, None, _TORCH_OPTIM.format(f="sgd", n="sgd")),
        OptimizerRecord("adafactor", "Adafactor", "Forgather's Adafactor, factored second moment", "factored", 0,
                        "adafactor", ("for-loop",), 2,
                        "Forgather src/forgather/ml/optim/adafactor.py (commit a0ce9176) _adafactor", aliases=(
                            _hf("adafactor", "ADAFACTOR", "_get_adafactor: transformers.optimization.Adafactor"),)),
        # lion_32bit builds bitsandbytes' Lion, whose one buffer is fp32 (Optimizer1State); lion-pytorch keeps it
        # in the state dtype: the same in fp32, half of it in pure bf16 (an approximation both readers share)
        OptimizerRecord("lion", "Lion", "lion-pytorch, one momentum buffer", "like_param", 1, "lion", ("for-loop",),
                        None, "lion-pytorch lion_pytorch/lion_pytorch.py update_fn", aliases=(
                            _bnb("lion_32bit", "LION", "Lion", 32, False),)),
        OptimizerRecord("adamw-8bit", "AdamW-8bit", "bitsandbytes AdamW8bit, blockwise 8-bit moments",
                        "blockwise_8bit", 2, "none", ("for-loop",), 1,
                        "bitsandbytes bitsandbytes/optim/optimizer.py Optimizer8bit (blockwise, min_8bit_size 4096)",
                        aliases=(
                            _bnb("adamw_bnb_8bit", "ADAMW_BNB", "AdamW", 8, False),
                            _bnb("adamw_8bit", "ADAMW_8BIT", "AdamW", 8, False),
                            _cls("bitsandbytes.optim.AdamW8bit"))),
        OptimizerRecord("paged-adamw", "PagedAdamW", "bitsandbytes PagedAdamW (paged_adamw_32bit), fp32 moments in "
                        "unified memory", "fp32", 2, "none", ("for-loop",), None,
                        "bitsandbytes bitsandbytes/optim/adamw.py PagedAdamW (optim_bits=32, is_paged=True); "
                        "optimizer.py Optimizer2State.init_state, Optimizer8bit.get_state_buffer", paged=True,
                        aliases=(_bnb("paged_adamw_32bit", "PAGED_ADAMW", "AdamW", 32, True),
                                 _cls("bitsandbytes.optim.PagedAdamW"), _cls("bitsandbytes.optim.PagedAdamW32bit"))),
        OptimizerRecord("paged-adamw-8bit", "PagedAdamW-8bit", "bitsandbytes PagedAdamW8bit, blockwise 8-bit moments in "
                        "unified memory", "blockwise_8bit", 2, "none", ("for-loop",), None,
                        "bitsandbytes bitsandbytes/optim/adamw.py PagedAdamW8bit (optim_bits=8, is_paged=True); "
                        "optimizer.py Optimizer2State.init_state, Optimizer8bit.get_state_buffer", paged=True,
                        aliases=(_bnb("paged_adamw_8bit", "PAGED_ADAMW_8BIT", "AdamW", 8, True),
                                 _cls("bitsandbytes.optim.PagedAdamW8bit"))),
        OptimizerRecord("adamw-4bit-torchao", "AdamW-4bit (torchao)", "torchao AdamW4bit, blockwise 4-bit moments "
                        "(block 128)", "torchao_4bit", 2, "torchao", ("for-loop",), None,
                        _TORCHAO.format(c="AdamW4bit", m="4bit"), aliases=(
                            _hf("adamw_torch_4bit", "ADAMW_TORCH_4BIT", "_get_torchao_optimizer: torchao.optim."
                                "AdamW4bit", note=_TORCHAO_HF_NOTE),
                            _cls("torchao.optim.AdamW4bit"), _cls("torchao.prototype.low_bit_optim.AdamW4bit"))),
        OptimizerRecord("adamw-8bit-torchao", "AdamW-8bit (torchao)", "torchao AdamW8bit, blockwise 8-bit moments "
                        "(block 256)", "torchao_8bit", 2, "torchao", ("for-loop",), None,
                        _TORCHAO.format(c="AdamW8bit", m="8bit"), aliases=(
                            _hf("adamw_torch_8bit", "ADAMW_TORCH_8BIT", "_get_torchao_optimizer: torchao.optim."
                                "AdamW8bit (block_size=256)"),
                            _cls("torchao.optim.AdamW8bit"), _cls("torchao.prototype.low_bit_optim.AdamW8bit"))),
        OptimizerRecord("galore-adamw", "GaLore-AdamW", "GaLore AdamW (galore-torch): rank --galore-rank moments "
                        "for every decoder linear, the SVD step's fp32 temporaries", "like_param", 2, "galore",
                        ("for-loop",), None, "galore_torch 1.0 galore_torch/adamw.py AdamW.step; "
                        "galore_projector.py GaLoreProjector (memcalc.engine.galore)", aliases=(
                            _hf("galore_adamw", "GALORE_ADAMW", "_get_galore_optimizer: galore_torch.GaLoreAdamW "
                                "(rank, update_proj_gap, scale from optim_args)",
                                note="GaLore targets every decoder linear (optim_target_modules attn + mlp)"),
                            _cls("galore_torch.GaLoreAdamW"))),
        OptimizerRecord("adamw-fp8-torchao", "AdamW-fp8 (torchao)", "torchao AdamWFp8, blockwise float8 moments "
                        "(block 256)", "torchao_fp8", 2, "torchao", ("for-loop",), None,
                        _TORCHAO.format(c="AdamWFp8", m="fp8"), aliases=(
                            _cls("torchao.optim.AdamWFp8"), _cls("torchao.prototype.low_bit_optim.AdamWFp8"))),
    )
}

#: Every optimizer name, in registry order (the spec's Literal and the CLI's choices).
OPTIMIZER_NAMES: tuple[str, ...] = tuple(OPTIMIZERS)
#: The optimizers `memcalc plan` searches, in its order.
PLANNED_OPTIMIZERS: tuple[str, ...] = tuple(
    sorted((r.name for r in OPTIMIZERS.values() if r.plan_order is not None), key=lambda n: OPTIMIZERS[n].plan_order)
)


@functools.cache
def alias_table(*kinds: AliasKind) -> dict[str, tuple[str, Alias]]:
    """External name -> (memcalc optimizer, its :class:`Alias`) for these kinds of name, in registry
    order (the order an unknown name's error lists the valid ones in)."""
    return {a.name: (r.name, a) for r in OPTIMIZERS.values() for a in r.aliases if a.kind in kinds}


def get_optimizer(name: str) -> OptimizerRecord:
    """The record of ``name``; unknown names list the valid ones."""
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise unknown_name("optimizer", name, OPTIMIZER_NAMES) from None


def impl_error(name: str, impl: str) -> Optional[str]:
    """Why ``impl`` cannot run ``name`` (one line naming the valid ones), or None when it can."""
    rec = OPTIMIZERS[name]
    if impl == DEFAULT_IMPL or impl in rec.impls:
        return None
    return f"optimizer {name} has no {impl} implementation; valid optimizer_impl for it: {', '.join(rec.impls)}"
