"""The optimizer registry: one record per optimizer, read by every consumer.

The spec's allowed names (``memcalc.core.spec``), the CLI's ``--optimizer`` choices and
help, the bytes-per-parameter table (``memcalc.estimate.peak``), the plan's searched
optimizers and their display names (``memcalc.plan``), the simulated state and step
temporaries (``memcalc.engine.optimizers`` dispatches on :attr:`OptimizerRecord.state`
and :attr:`OptimizerRecord.step`) and the validator's builders (``validate/optim.py``)
all read :data:`OPTIMIZERS`. Adding an optimizer is one record here, plus its simulation
kinds in the engine and its builder in validate if they are new (a test checks that
every record is accepted by each of them).
"""

from __future__ import annotations

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
StateLayout = Literal["none", "like_param", "factored", "blockwise_8bit", "fp32"]
#: Which temporaries the step makes (``memcalc.engine.optimizers.per_param_temps``).
StepKind = Literal["none", "adam", "lion", "adafactor"]

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
        return 0.0


_TORCH_OPTIM = "torch/optim/{f}.py (_init_group; _multi_tensor_{n} / _single_tensor_{n} / fused kernel)"

OPTIMIZERS: dict[str, OptimizerRecord] = {
    r.name: r
    for r in (
        OptimizerRecord("adamw", "AdamW", "torch.optim.AdamW, two moments", "like_param", 2, "adam", IMPLS, 0,
                        _TORCH_OPTIM.format(f="adamw", n="adamw")),
        OptimizerRecord("adam", "Adam", "torch.optim.Adam, two moments", "like_param", 2, "adam", IMPLS, None,
                        _TORCH_OPTIM.format(f="adam", n="adam")),
        OptimizerRecord("sgd", "SGD", "torch.optim.SGD, no state", "none", 0, "none", IMPLS, None,
                        _TORCH_OPTIM.format(f="sgd", n="sgd")),
        OptimizerRecord("sgd-momentum", "SGD-momentum", "torch.optim.SGD(momentum=0.9), one buffer", "like_param", 1,
                        "none", IMPLS, None, _TORCH_OPTIM.format(f="sgd", n="sgd")),
        OptimizerRecord("adafactor", "Adafactor", "Forgather's Adafactor, factored second moment", "factored", 0,
                        "adafactor", ("for-loop",), 2,
                        "Forgather src/forgather/ml/optim/adafactor.py (commit a0ce9176) _adafactor"),
        OptimizerRecord("lion", "Lion", "lion-pytorch, one momentum buffer", "like_param", 1, "lion", ("for-loop",),
                        None, "lion-pytorch lion_pytorch/lion_pytorch.py update_fn"),
        OptimizerRecord("adamw-8bit", "AdamW-8bit", "bitsandbytes AdamW8bit, blockwise 8-bit moments",
                        "blockwise_8bit", 2, "none", ("for-loop",), 1,
                        "bitsandbytes bitsandbytes/optim/optimizer.py Optimizer8bit (blockwise, min_8bit_size 4096)"),
        OptimizerRecord("paged-adamw", "PagedAdamW", "bitsandbytes PagedAdamW (paged_adamw_32bit), fp32 moments in "
                        "unified memory", "fp32", 2, "none", ("for-loop",), None,
                        "bitsandbytes bitsandbytes/optim/adamw.py PagedAdamW (optim_bits=32, is_paged=True); "
                        "optimizer.py Optimizer2State.init_state, Optimizer8bit.get_state_buffer", paged=True),
        OptimizerRecord("paged-adamw-8bit", "PagedAdamW-8bit", "bitsandbytes PagedAdamW8bit, blockwise 8-bit moments in "
                        "unified memory", "blockwise_8bit", 2, "none", ("for-loop",), None,
                        "bitsandbytes bitsandbytes/optim/adamw.py PagedAdamW8bit (optim_bits=8, is_paged=True); "
                        "optimizer.py Optimizer2State.init_state, Optimizer8bit.get_state_buffer", paged=True),
    )
}

#: Every optimizer name, in registry order (the spec's Literal and the CLI's choices).
OPTIMIZER_NAMES: tuple[str, ...] = tuple(OPTIMIZERS)
#: The optimizers `memcalc plan` searches, in its order.
PLANNED_OPTIMIZERS: tuple[str, ...] = tuple(
    sorted((r.name for r in OPTIMIZERS.values() if r.plan_order is not None), key=lambda n: OPTIMIZERS[n].plan_order)
)


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
