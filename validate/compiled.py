"""PyTorch's own partitioner on the spec-built model, without a GPU.

``torch.compile`` needs CUDA to run the reference model, but the decision that
sets its activation memory, AOTAutograd's min-cut partition of the joint graph
(``torch/_functorch/partitioners.py``), only needs shapes. ``partition`` traces
the model's compiled region (embedding to logits) through dynamo and AOTAutograd on
the ``meta`` device, with inductor's decompositions, under a given
``activation_memory_budget``, and returns what the forward graph hands to
backward: the bytes memcalc's own partitioner (``memcalc.compile.compiled``) must match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch._functorch import config as functorch_config
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from memcalc.core.spec import ExperimentSpec

from .model import build_model

#: ops that return a view of their input (the saved node shares its base's storage)
_VIEWS = {"aten.permute.default", "aten.view.default", "aten.alias.default", "aten.t.default",
          "aten.expand.default", "aten.slice.Tensor", "aten.unsqueeze.default", "aten.squeeze.dim",
          "aten._unsafe_view.default", "aten.transpose.int", "aten.select.int", "aten.reshape.default"}


@dataclass
class PartitionResult:
    saved_bytes: int  # activations saved for backward (storages, graph inputs and their views excluded)
    saved_tensors: int
    torch_version: str


def partition(exp: ExperimentSpec, budget: Optional[float] = None, scale_layers: Optional[int] = None) -> PartitionResult:
    """Trace ``exp``'s compiled region on meta and partition it as ``torch.compile`` would."""
    from torch._inductor.decomposition import select_decomp_table

    m = exp.model if scale_layers is None else exp.model.model_copy(update={"n_layers": scale_layers})
    tr = exp.training.model_copy(update={"compile": False, "memory_budget": None, "checkpoint": "none"})
    model = build_model(m, tr, exp.profile, device="meta")
    ids = torch.zeros(tr.batch, tr.seq, dtype=torch.long, device="meta")
    graphs: dict[str, torch.fx.GraphModule] = {}

    def fw_compiler(gm, args):
        graphs["fw"] = gm
        return gm

    # dynamo marks the parameters as static inputs, which the partitioner saves for free
    # (config.treat_parameters_as_free_to_save), as under model.compile()
    backend = aot_autograd(fw_compiler=fw_compiler, bw_compiler=lambda gm, a: gm,
                           partition_fn=min_cut_rematerialization_partition,
                           decompositions=select_decomp_table())
    b = exp.training.memory_budget if budget is None else budget
    torch._dynamo.reset()
    with functorch_config.patch(activation_memory_budget=1.0 if b is None else b):
        compiled = torch.compile(_Logits(model), backend=backend, dynamic=False, fullgraph=True)
        compiled(ids)
    torch._dynamo.reset()
    fw = graphs["fw"]
    placeholders = {n for n in fw.graph.nodes if n.op == "placeholder"}
    outs = list(fw.graph.nodes)[-1].args[0]

    def base(n):
        while n.op == "call_function" and str(n.target) in _VIEWS:
            n = n.args[0]
        return n

    seen = set()
    total = 0
    for o in outs[1:]:  # the first output is the logits
        if o is None:
            continue
        bo = base(o)
        if bo in placeholders or bo in seen:
            continue
        seen.add(bo)
        v = bo.meta.get("val")
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return PartitionResult(total, len(seen), torch.__version__)


def meta_backend(fused: bool = False):
    """A ``torch.compile`` backend that runs on ``meta``: dynamo and AOTAutograd as under inductor
    (inductor's decompositions, the min-cut partitioner at ``activation_memory_budget``), with the
    partitioned forward and backward graphs run as FX code (each value freed after its last use)
    instead of inductor's generated kernels, which need a device to compile for. The graph
    boundaries, the saved sets and what reaches ``ctx.save_for_backward`` (a saved-tensor hook) are
    PyTorch's; inductor's fusion and buffer reuse inside a graph are not traced. ``fused``: for a
    graph of pointwise ops and reductions only (a loss), which inductor generates as fused kernels
    that materialise only their outputs, each graph is counted by its outputs (:func:`_fused`)."""
    from torch._inductor.decomposition import select_decomp_table

    from torch._functorch.aot_autograd import make_boxed_func

    def run_as_fx(gm, _args):  # boxed arguments, the calling convention AOTAutograd expects (as inductor's)
        return make_boxed_func(_fused(gm) if fused else gm)

    return aot_autograd(fw_compiler=run_as_fx, bw_compiler=run_as_fx,
                        partition_fn=min_cut_rematerialization_partition, decompositions=select_decomp_table())


def compile_layers(model, budget: Optional[float]) -> None:
    """``compile_scope layer`` on the replica: each decoder layer compiled apart, as torchtune's
    ``training.compile_model`` does (``m.compile()`` per ``TransformerSelfAttentionLayer``,
    torchtune/training/_compile.py 0.6.1), with :func:`meta_backend`; the budget is the
    partitioner's global config."""
    torch._dynamo.reset()
    functorch_config.activation_memory_budget = 1.0 if budget is None else budget
    backend = meta_backend()
    for layer in model.layers:
        layer.compile(backend=backend, dynamic=False)


#: extern kernels: a graph that calls one is not all fused (inductor gives their outputs buffers of their own)
_EXTERN = ("mm", "bmm", "addmm", "scaled_dot_product", "convolution", "embedding")


def _fused(gm):
    """``gm`` run as one fused kernel under the storage tracer: its intermediates are not counted,
    its outputs are (inductor's code for a graph of pointwise ops and reductions: each kernel
    writes only the buffers later kernels or the caller read, here row statistics and the
    outputs; torch/_inductor/scheduler.py fuses the rest). Refuses a graph with an extern kernel."""
    from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode

    from .tracer import StorageTracer

    calls = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    bad = [c for c in calls if any(e in c for e in _EXTERN)]
    assert not bad, f"a fused graph calls extern kernels: {bad}"

    def run(*args):
        mode = _get_current_dispatch_mode()
        if not isinstance(mode, StorageTracer):
            return gm(*args)
        with _disable_current_modes():
            out = gm(*args)
        mode.track(out if isinstance(out, (list, tuple)) else [out])
        return out

    return run


#: the name :func:`compile_with` registers :func:`meta_backend` under (a trainer's own compile helper reads
#: its backend by name: torchtune's ``TORCH_COMPILE_BACKEND``), and the fused one (a loss)
META_BACKEND = "memcalc_meta"
FUSED_BACKEND = "memcalc_meta_fused"


def compile_with(device_type: str, budget: Optional[float], fn, reset: bool = False, fused: bool = False):
    """Run a trainer's own compile helper ``fn`` (torchtune's ``training.compile_model`` /
    ``compile_loss``, which read ``os.environ["TORCH_COMPILE_BACKEND"]``, default inductor) with
    :func:`meta_backend` off CUDA, at the activation memory budget; returns what ``fn`` returns.
    ``reset``: dynamo's caches emptied first (a fresh compile per traced setup); ``fused``: the
    graphs are counted as fused kernels (``meta_backend(fused=True)``: a loss)."""
    import os

    from torch._dynamo import list_backends, register_backend

    if reset:
        torch._dynamo.reset()
    functorch_config.activation_memory_budget = 1.0 if budget is None else budget
    if device_type == "cuda":
        return fn()
    name = FUSED_BACKEND if fused else META_BACKEND
    if name not in list_backends(exclude_tags=()):
        register_backend(name=name)(meta_backend(fused))
    before = os.environ.get("TORCH_COMPILE_BACKEND")
    os.environ["TORCH_COMPILE_BACKEND"] = name
    try:
        return fn()
    finally:
        if before is None:
            del os.environ["TORCH_COMPILE_BACKEND"]
        else:
            os.environ["TORCH_COMPILE_BACKEND"] = before


_REDUCTION = {"none": 0, "mean": 1, "sum": 2}  # at::Reduction


class MetaCrossEntropy(torch.overrides.TorchFunctionMode):
    """``F.cross_entropy`` on a 2-D meta input dispatched as aten's composite does on CUDA
    (aten/src/ATen/native/LossNLL.cpp ``cross_entropy_loss`` -> ``log_softmax`` + ``nll_loss_nd`` ->
    ``nll_loss_forward`` for 2-D input). Needed under torch.compile only: AOTAutograd's joint trace of
    ``aten.nll_loss`` on meta tensors (PyTorch 2.13) records no backward and saves nothing, where
    on CPU it saves the input, the labels and the two row reductions; this routing gives the CPU
    graph (tests/trace/test_compile_scope.py ``test_compiled_chunk_saves``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.cross_entropy and args[0].device.type == "meta" and args[0].dim() == 2 \
                and kwargs.get("label_smoothing", 0.0) == 0.0:
            inp, target = args[0], args[1]
            lsm = torch.nn.functional.log_softmax(inp, 1)
            return torch.ops.aten.nll_loss_forward(lsm, target, kwargs.get("weight"),
                                                   _REDUCTION[kwargs.get("reduction", "mean")],
                                                   kwargs.get("ignore_index", -100))[0]
        return func(*args, **kwargs)


class _Logits(torch.nn.Module):
    """The compiled region as a module: input ids -> logits."""

    def __init__(self, m) -> None:
        super().__init__()
        self.m = m

    def forward(self, ids):
        with self.m.amp.region():
            return self.m.logits(ids)
