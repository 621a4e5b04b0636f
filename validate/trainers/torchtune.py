"""``memcalc validate --framework torchtune``: torchtune 0.6.1's own model, loss and training step,
traced on ``meta`` (or run on ``cpu`` / ``cuda``).

The step is torchtune's single-device recipes' (recipes/full_finetune_single_device.py and
recipes/lora_finetune_single_device.py at the v0.6.1 tag; the recipes are not in the wheel, so
their ``train`` / ``_loss_step`` loop is transcribed here line for line, everything it calls is
torchtune's own code):

- the model: :func:`.torchtune_model.build` (torchtune's component builders, adapters trainable);
- ``_setup_model``: ``training.set_activation_checkpointing(model, auto_wrap_policy={
  modules.TransformerSelfAttentionLayer})`` with ``--checkpoint full``; then
  ``training.get_act_offloading_ctx_manager(model, enable_activation_offloading)`` (its
  ``NoOpManager`` hooks on ``model.output``), whose ``OffloadActivations`` is the device-free twin
  :class:`memcalc.validate.offload.OffloadActivations` (torchtune's class creates CUDA streams in
  ``__init__`` and copies to pinned host memory: neither exists off CUDA; the twin runs its
  pack/unpack logic with the host copy kept as a layout);
- the loss: ``CEWithChunkedOutputLoss()`` (8 chunks) and ``model.set_num_output_chunks(
  loss_fn.num_output_chunks)`` when the profile's ``cross_entropy`` is ``chunked`` (the model
  returns ``[self.output(chunk) for chunk in h.chunk(n, dim=1)]``,
  ``TransformerDecoder.chunked_output``; ``loss_chunks`` sets ``num_output_chunks``), else
  ``torch.nn.CrossEntropyLoss(ignore_index=-100)`` on the model's ``self.output(h).float()``
  (``TransformerDecoder.unembed``);
- ``_loss_step``: ``with activations_handling_ctx: logits = model(tokens)``; labels shifted with
  ``torch.hstack((labels[..., 1:], ignore_labels_cache[:b]))``; reshaped when not chunked;
  ``loss = loss_fn(logits, labels)``; ``del logits``;
- ``train``: ``current_num_tokens = (labels != ignore_index).sum()``; ``current_loss =
  _loss_step(batch) * current_num_tokens``; ``running_loss += current_loss``;
  ``current_loss.backward()``; at the accumulation boundary ``training.scale_grads(model, 1 /
  num_tokens)``, ``optimizer.step()``, ``optimizer.zero_grad(set_to_none=True)``;
- ``optimizer_in_bwd`` (full fine-tuning only): one optimizer per parameter and
  ``training.register_optim_in_bwd_hooks`` (full_finetune_single_device.py ``_setup_optimizer``).

Only kernel dispatch is patched (:class:`.torchtune_model.TorchtuneKernels`). Two steps run, the
second measured (:func:`memcalc.validate.step.two_steps`). The recipes train in one dtype (fp32 or
bf16; no autocast), single device, no gradient clipping (``clip_grad_norm: null``, the configs'
default). torch.compile (``compile_scope layer``): the recipes' ``training.compile_model`` and
``compile_loss`` (the full fine-tuning recipe drops ``compile_loss``'s return value: its unchunked
loss stays eager, :meth:`setup_loss`), run with :func:`~..compiled.meta_backend` off CUDA
(:func:`~..compiled.compile_with`).
"""

from __future__ import annotations

import gc
import time
from contextlib import nullcontext
import warnings
from collections.abc import Callable
from typing import Any, Optional

import torch

from memcalc.core.allocator import CachingAllocatorSim
from memcalc.core.errors import UserError
from memcalc.core.spec import ExperimentSpec

from ..compiled import MetaCrossEntropy, compile_with
from ..model import torch_dtype
from ..offload import OffloadActivations as OffloadTwin
from ..optim import allow_fused_on, build_optimizer
from ..step import Measurement, Probe, Step, fill_measurement, track_inputs, two_steps, train_step
from ..tracer import StorageTracer
from .torchtune_model import TorchtuneKernels, build, check_spec, recompute_in_mode

EXTRA = "torchtune"
IGNORE_INDEX = -100  # CEWithChunkedOutputLoss / CrossEntropyLoss ignore_index


def library_versions() -> dict[str, str]:
    """torchtune's and torchao's versions (the ones installed)."""
    from contextlib import suppress
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torchtune", "torchao"):
        with suppress(PackageNotFoundError):
            out[name] = version(name)
    return out


def refusal(exp: ExperimentSpec) -> Optional[str]:
    """Why torchtune's single-device recipes cannot run this setup (None when they can)."""
    tr = exp.training
    checks = (
        (tr.precision in ("fp32", "bf16"),
         f"precision {tr.precision}: the recipes train in one dtype, fp32 or bf16 (training.get_dtype; fp16 and "
         "autocast are refused)"),
        (tr.checkpoint in ("none", "full"),
         f"checkpoint {tr.checkpoint}: the recipes checkpoint every layer (set_activation_checkpointing on "
         "TransformerSelfAttentionLayer): none or full"),
        (not tr.activation_offload or tr.checkpoint == "full",
         "activation offloading without checkpointing: the recipes raise (\"enable_activation_offloading should "
         "only be True when enable_activation_checkpointing is True\")"),
        (not tr.fused_optimizer or tr.lora is None, "optimizer in backward with LoRA: lora_finetune_single_device "
                                                    "has no optimizer_in_bwd"),
        (not tr.fused_optimizer or tr.grad_accum == 1, "optimizer in backward with gradient accumulation: the "
                                                       "recipe raises (\"Gradient accumulation is not supported with "
                                                       "optimizer in bwd\")"),
        (tr.gpus == 1 and tr.zero == 0 and tr.tp == 1, "several GPUs: validate traces the single-device recipes"),
        (tr.first_seq is None, "first_seq (a longer first micro-batch): the recipes' loop is not traced with one "
                               "(the single-process harnesses of validate/step.py are)"),
        (not tr.offload_optimizer and not tr.master_weights, "optimizer offload or fp32 master weights: the "
                                                             "single-device recipes have neither"),
        (not tr.compile or tr.compile_scope == "layer",
         "compile_scope model: the recipes compile each layer apart (training.compile_model) and the loss apart: "
         "compile_scope layer"),
        (tr.lora is None or tr.lora.dtype in (None, "model"), "adapters in fp32 over a 16-bit base: the recipes "
                                                              "build every parameter in the training dtype"),
        (tr.lora is None or not tr.lora.qlora or tr.precision == "bf16", "QLoRA in fp32: torchao's NF4 linear "
                                                                         "dequantizes to bf16"),
    )
    for ok, why in checks:
        if not ok:
            return f"--framework torchtune: {why}"
    return None


def check(exp: ExperimentSpec) -> None:
    """A setup torchtune's recipes or builders cannot express: one-line UserError."""
    check_spec(exp)
    why = refusal(exp)
    if why:
        raise UserError(why)


def measure(exp: ExperimentSpec, device: str, scale_layers: Optional[int] = None,
            progress: Optional[Callable[[str], None]] = None, allocator_sim: bool = False,
            debug: bool = False) -> Measurement:
    """Trace (meta) or measure (cpu, cuda) torchtune's step of ``exp``; see the module docstring."""
    t0 = time.perf_counter()
    say = progress or (lambda _msg: None)
    meas = Measurement(device=device)
    meas.framework = "torchtune"
    meas.library_versions = library_versions()
    meas.transformers_version = None
    m = exp.model if scale_layers is None else exp.model.model_copy(update={"n_layers": scale_layers})
    meas.layers = m.n_layers
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # rms_norm's "Mismatch dtype ... fused implementation"
            sim = CachingAllocatorSim() if allocator_sim else None
            if sim is not None and device == "meta":
                _setup_cache(exp.model_copy(update={"model": m}), sim)
            Run(exp, m, device, say, meas, debug, sim).run()
    finally:
        gc.collect()
    meas.seconds = round(time.perf_counter() - t0, 3)
    return meas


def _setup_cache(exp: ExperimentSpec, sim: CachingAllocatorSim) -> None:
    """A QLoRA model's build and ``load_state_dict`` (:func:`..loading.trace_torchtune_load`) through the
    allocator the step then uses, every block freed after (the load's model is dropped; the step's own
    model takes its place in those segments): ``_setup_model`` runs on the GPU before training and the
    recipe never calls ``torch.cuda.empty_cache`` (recipes/lora_finetune_single_device.py, v0.6.1)."""
    lora = exp.training.lora
    if lora is None or not lora.qlora:
        return
    from ..loading import trace_torchtune_load

    trace_torchtune_load(exp, sim)
    gc.collect()


class Run:
    """One traced torchtune step: setup as the recipe's ``setup``, then two steps of ``train``."""

    def __init__(self, exp: ExperimentSpec, m, device: str, say, meas: Measurement, debug: bool,
                 sim: Optional[CachingAllocatorSim]) -> None:
        self.exp, self.m, self.device, self.say, self.meas, self.debug, self.sim = exp, m, device, say, meas, debug, sim
        self.tr = exp.training
        self.dev_type = torch.device(device).type
        self.running_loss: Any = 0
        self.num_tokens: Any = 0
        self.model: Any = None

    # -- recipe setup -----------------------------------------------------------------------
    def setup_model(self) -> None:
        """``_setup_model``: build, (compile), checkpointing, the offloading context."""
        from torchtune import modules, training

        tr = self.tr
        self.say(f"building {self.m.name} ({self.m.n_layers} layers) with torchtune on {self.device}")
        self.model = build(self.m, tr.lora, torch_dtype(tr.weight_dtype.value), self.device)
        if tr.compile:  # before checkpointing, as the recipes do (compile_model then set_activation_checkpointing)
            compile_with(self.dev_type, tr.memory_budget, lambda: training.compile_model(self.model, verbose=False),
                         reset=True)
        if tr.checkpoint == "full":
            training.set_activation_checkpointing(self.model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
        self.offload = None
        self.ctx = _offloading_ctx(self.model, tr.activation_offload)
        if tr.activation_offload:
            self.offload = self.ctx

    def setup_loss(self) -> None:
        """``setup``: the loss, and ``set_num_output_chunks`` for the chunked one."""
        prof = self.exp.profile
        if prof.cross_entropy == "chunked":
            from torchtune.modules.loss import CEWithChunkedOutputLoss

            self.loss_fn = CEWithChunkedOutputLoss(num_output_chunks=prof.loss_chunks)
            self.model.set_num_output_chunks(self.loss_fn.num_output_chunks)
        else:
            self.loss_fn = torch.nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX)
        if self.tr.compile:
            from torchtune import training

            compiled = compile_with(self.dev_type, self.tr.memory_budget,
                                    lambda: training.compile_loss(self.loss_fn, verbose=False), fused=True)
            # lora_finetune_single_device.py (v0.6.1) ``self._loss_fn = training.compile_loss(self._loss_fn)``;
            # full_finetune_single_device.py calls ``training.compile_loss(self._loss_fn)`` and drops what it
            # returns, so only CEWithChunkedOutputLoss (compute_cross_entropy replaced in place) is compiled there:
            # a CrossEntropyLoss (``torch.compile(loss)``, a new module) runs eagerly
            if self.tr.lora is not None:
                self.loss_fn = compiled

    def setup_optimizer(self):
        """``_setup_optimizer``: one optimizer, or one per parameter with hooks (optimizer_in_bwd)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.tr.fused_optimizer:
            from torchtune import training

            optim_dict = {p: build_optimizer([p], self.tr) for p in self.model.parameters()}
            training.register_optim_in_bwd_hooks(model=self.model, optim_dict=optim_dict)
            return list(optim_dict.values())
        return [build_optimizer(params, self.tr)]

    # -- the recipe's train loop ------------------------------------------------------------
    def loss_step(self) -> torch.Tensor:
        """``_loss_step``."""
        labels = self.labels
        with self.ctx:
            logits = self.model(self.tokens)
        labels = torch.hstack((labels[..., 1:], self.ignore_labels_cache[: labels.shape[0]]))
        if not isinstance(logits, list):
            labels = labels.reshape(-1)
            logits = logits.reshape(-1, logits.size(-1))
        loss = self.loss_fn(logits, labels)
        del logits
        return loss

    def micro_step(self) -> torch.Tensor:
        current_num_tokens = (self.labels != IGNORE_INDEX).sum()
        self.num_tokens = self.num_tokens + current_num_tokens
        current_loss = self.loss_step() * current_num_tokens
        self.running_loss = self.running_loss + current_loss
        return current_loss

    def optimizer_step(self) -> None:
        from torchtune import training

        training.scale_grads(self.model, 1 / self.num_tokens)
        for opt in self.opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        self.running_loss, self.num_tokens = 0, 0

    def before(self) -> None:
        self.running_loss, self.num_tokens = 0, 0

    # -- run --------------------------------------------------------------------------------
    def run(self) -> None:
        tr = self.tr
        self.setup_model()
        self.setup_loss()
        self.opts = self.setup_optimizer()
        self.meas.params = sum(p.numel() for p in self.model.parameters())
        B, T = tr.batch, tr.seq
        dev = self.device
        if self.dev_type == "meta":
            self.tokens = torch.empty((B, T), dtype=torch.int64, device=dev)
        else:
            self.tokens = torch.randint(0, self.m.vocab_size, (B, T), device=dev)
        self.labels = self.tokens.clone() if self.dev_type != "meta" else torch.empty_like(self.tokens)
        self.ignore_labels_cache = torch.full((B, 1), IGNORE_INDEX, device=dev)
        tracer = None
        if self.dev_type != "cuda":
            tracer = StorageTracer(self.dev_type, self.exp.profile.allocator_round_bytes, debug=self.debug,
                                   allocator=self.sim)
        probe = Probe(dev, tracer)
        hooks = [layer.register_forward_pre_hook(lambda *_a, i=i: probe.label(f"layer {i}"))
                 for i, layer in enumerate(self.model.layers)] if not tr.compile else []  # (no graph breaks)
        hooks.append(self.model.norm.register_forward_pre_hook(lambda *_a: probe.label("head & loss")))
        step = Step(forward=self.micro_step, grad_accum=tr.grad_accum,
                    optimizer_step=None if tr.fused_optimizer else self.optimizer_step,
                    backward=lambda loss: torch.autograd.backward(loss), scale=False, before=self.before)
        if tracer is not None:
            track_inputs(tracer, _Flat(self.model), self.tokens, self.labels, None)
            tracer.track([self.ignore_labels_cache])
        kernels = TorchtuneKernels(self.exp.profile)
        recompute_in_mode(self.model, kernels)
        with allow_fused_on(self.dev_type), kernels, MetaCrossEntropy() if tr.compile else nullcontext():
            if tracer is not None:
                with tracer:
                    self.meas.first_step_bytes, result = two_steps(probe, lambda: train_step(step, probe.set_phase),
                                                                   self.say)
            else:
                self.meas.first_step_bytes, result = two_steps(probe, lambda: train_step(step, probe.set_phase),
                                                               self.say)
        fill_measurement(self.meas, result, probe, self.dev_type, self.sim, tracer, self.debug)
        if self.offload is not None:
            self.meas.host_activation_bytes = self.offload.max_pinned_bytes
        for h in hooks:
            h.remove()


class _Flat:
    """The model's parameters and buffers as plain tensors: an NF4 weight (a tensor subclass) is its
    inner tensors (``__tensor_flatten__``), which are what the device holds."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def parameters(self):
        return _leaves(self.model.parameters())

    def buffers(self):
        return _leaves(self.model.buffers())


def _leaves(tensors):
    for t in tensors:
        flatten = getattr(type(t), "__tensor_flatten__", None)
        if flatten is None or type(t) in (torch.Tensor, torch.nn.Parameter):
            yield t
            continue
        names, _ctx = t.__tensor_flatten__()
        yield from _leaves(getattr(t, n) for n in names)


def _offloading_ctx(model: torch.nn.Module, enable: bool):
    """``training.get_act_offloading_ctx_manager(model, enable)``, its ``OffloadActivations`` the
    device-free twin (see the module docstring); the NoOpManager hooks on the output are torchtune's."""
    from torchtune.training import _activation_offloading as ao

    saved = ao.OffloadActivations
    ao.OffloadActivations = OffloadTwin  # type: ignore[misc]
    try:
        return ao.get_act_offloading_ctx_manager(model, enable)
    finally:
        ao.OffloadActivations = saved  # type: ignore[misc]
