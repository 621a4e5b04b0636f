"""A cross-entropy compiled apart: torchtune's ``training.compile_loss`` (torchtune 0.6.1).

torchtune/training/_compile.py ``compile_loss``: for ``CEWithChunkedOutputLoss`` only
``compute_cross_entropy`` (``F.cross_entropy(logits.float(), labels, reduction="sum")``, one chunk)
is compiled, "not the chunking"; any other loss is compiled whole. The recipes call it when
``compile`` is set (recipes/full_finetune_single_device.py and lora_finetune_single_device.py
``setup``), which memcalc's ``compile_scope layer`` stands for.

What the compiled chunk saves is AOTAutograd's min-cut partition of its joint graph (inductor's
decompositions: ``_log_softmax`` as ``x - amax - log(sum(exp(x - amax)))``, ``nll_loss_forward``):
the upcast and the log-probabilities are pointwise, so the backward recomputes them; the two row
reductions are banned from recomputation (``should_ban_recomputation``: a reduction four times
smaller than its input) and saved. Traced on CPU with PyTorch 2.13 (tests/trace/test_compile_scope.py
``test_compiled_chunk_saves``): the chunk's 16-bit logits (a graph input: kept alive, not copied),
the labels, and two (rows, 1) fp32 tensors. So per chunk, where the eager loss keeps the fp32
log-probabilities (rows x V x 4 bytes), the compiled one keeps the 16-bit logits past the recipe's
``del logits`` (rows x V x 2) and 8 bytes a row; its forward materialises no fp32 copy (the upcast
is fused into the reductions), and its backward returns the 16-bit gradient of the chunk directly.
The labels (rows x 8 bytes, the batch's own or a reshaped copy) are left out, as in the eager rule.

The backward's gradient is a new buffer, allocated while the saved 16-bit logits are still alive (they
are freed after the fused kernel has read them): the logits are a forward *input* of the compiled graph,
and AOTAutograd donates only saved intermediates (torch/_functorch/_aot_autograd/graph_compile.py
``collect_fw_donated_buffer_idxs``: no alias of a forward input, user output or backward output; the
``donated_buffer`` config, on in OSS since PyTorch 2.6, pytorch/pytorch#139669), and inductor reuses or
writes in place into a graph input only when it is donated (torch/_inductor/codegen/wrapper.py
``can_reuse``; scheduler ``name_to_donated_buffer``). So the first chunk's backward holds every chunk's
logits and one gradient. Measured with inductor itself (CPU C++ backend, PyTorch 2.13; allocator events
of torch.profiler): tests/trace/test_compile_scope.py ``test_compiled_chunk_backward_allocates_beside_saved_logits``,
and torchtune 0.6.1's whole LoRA step (compiled layers, checkpointing, offloading, 8 chunks) on a
scaled-down Llama 3.2 matches the estimate at the head to 0.01 of a chunk (docs/torchtune.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.core.dtypes import DType
from memcalc.engine.blocks.head import CATEGORY
from memcalc.engine.sim import T

if TYPE_CHECKING:  # pragma: no cover
    from memcalc.engine.context import ForwardContext


def compiles_loss(fwd: ForwardContext) -> bool:
    """Whether the trainer compiles its loss apart (``compile_scope layer``: torchtune's
    ``compile_loss`` beside ``compile_model``)."""
    return fwd.tr.compile and fwd.tr.compile_scope == "layer"


def loss_in_model_graph(fwd: ForwardContext) -> bool:
    """Whether the loss is part of the one compiled graph (``compile_scope model``): ``model.compile()``
    compiles the module's ``forward``, and the forward the validator measures computes its loss there
    (validate/model.py ``Decoder.forward``: ``lm_loss`` on the logits; so do Hugging Face's
    ``*ForCausalLM.forward`` with labels and Forgather's models). Inductor then fuses the shift, the
    upcast and the cross-entropy's reductions into kernels over the logits, and the graph's output is the
    scalar loss, as :func:`compiled_cross_entropy` models: measured on an H200 (PyTorch 2.11,
    data/reference/measured/protocol-cuda-nvidia-h200-20261128-070544.json, config-compile at 8 layers:
    the forward keeps the logits and two row statistics of 12 KiB, no shifted copy, no log-probabilities;
    the backward makes one logits-sized gradient and frees it after the head's backward). The plain
    full cross-entropy only: a chunked or fused loss, or tensor parallelism's loss_parallel, is modelled as
    it runs eagerly."""
    tr = fwd.tr
    return (tr.compile and tr.compile_scope == "model" and fwd.ops.profile.cross_entropy == "full"
            and fwd.ops.profile.kernels == "none" and fwd.tp is None)


def graph_loss(fwd: ForwardContext, logits: T) -> T:
    """The loss inside the model's compiled graph (:func:`loss_in_model_graph`; takes the reference to
    ``logits``), its tensors in the category "logits & loss" as the eager loss's
    (memcalc.engine.blocks.head.loss)."""
    fwd.sim.set_role("loss")
    o = fwd.ops
    o.category = CATEGORY
    rows = fwd.B * (fwd.T - 1 if o.profile.shift_copy else fwd.T)
    out = compiled_cross_entropy(fwd, logits, rows)
    o.category = "saved activations"
    o.drop(logits)
    return out


def compiled_cross_entropy(fwd: ForwardContext, y: T, rows: int) -> T:
    """One compiled ``F.cross_entropy(y.float(), labels, reduction="sum")`` over ``rows`` rows of
    logits ``y``: saves ``y`` and the two row statistics; returns the summed loss (the caller
    drops its own reference to ``y``)."""
    o = fwd.ops
    stats = [o.new(rows, DType.fp32, CATEGORY), o.new(rows, DType.fp32, CATEGORY)]  # amax, logsumexp
    part = o.new(1, DType.fp32, CATEGORY)
    fwd.sim.node("compiled_cross_entropy", [y, *stats], [y], [], [part],
                 grad_input_bytes=[-(-y.numel * y.itemsize_bits // 8)])
    o.drop(*stats)
    return part
