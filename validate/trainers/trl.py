"""TRL's ``SFTTrainer`` step, traced on ``meta`` (``memcalc validate --framework trl``).

The model is the Hugging Face one, built as ``--framework hf`` builds it
(:func:`~memcalc.validate.hf_model.build_hf_model`: transformers' ``from_config`` under
``torch.device``, PEFT LoRA on top, activation checkpointing as HF Trainer enables it); the step is
the one every harness runs (:func:`~memcalc.validate.step.run_on_device`: two steps, the second
measured, the same optimizer and tracer). What TRL changes is the loss, and that is TRL's own code,
run unmodified (trl 1.16.0):

- ``SFTTrainer.__init__`` (trl/trainer/sft_trainer.py) calls
  ``add_fused_lm_head(self.model.get_base_model() if is_peft_model(self.model) else self.model,
  outputs=("log_probs", "entropy", "is_top1"))``: done here on the built model, with the same outputs
  (:data:`SFT_OUTPUTS`);
- ``SFTTrainer.compute_loss`` (the ``loss_type="nll"`` branch, no ``compute_loss_func``, no label
  smoothing) is called as the unbound function on a stand-in trainer (:class:`_Trainer`) that holds
  only the attributes it reads (``model``, ``args.loss_type``, ``accelerator`` with one process and no
  parallelism config, the metric dictionaries): ``model(**inputs, fused_lm_head=True)``, the fused
  forward of ``trl/trainer/utils.py add_fused_lm_head`` and ``trl/kernels/chunked_logprob.py
  ChunkedLogProbFunction`` as they are.

Only kernel dispatch and the data-dependent answers meta cannot give are patched (:func:`trl_patches`):

- ``_use_triton(device)`` is true for ``meta`` as for ``cuda`` (the compact path: only the positions
  whose label is not -100 are projected), and the two Triton launches (``_forward_kernel[grid](...)``,
  ``_backward_kernel[grid](...)``) are shape-correct no-ops: they read the tile and write in place
  (the fold into the per-token statistics, the tile overwritten by its gradient), allocating nothing;
- ``torch.is_autocast_enabled("meta")`` (which raises: meta has no autocast dispatch key) is False;
- ``_addmm_fp32`` takes its CUDA branch (``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)``:
  accumulated in place, no fp32 copies of the operands), which its ``acc.device.type == "cuda"``
  test refuses on meta;
- :class:`LabelMask` (a dispatch mode): ``nonzero`` of the (B, T-1) label mask returns
  :func:`memcalc.core.rules.loss_token_count` rows (how many labels are not -100: the profile's
  ``loss_tokens``), as CUDA's data would; ``.item()`` / ``bool()`` (``_local_scalar_dense``: the
  metrics, transformers' all-ones padding check) answer 1 / True.

Not traced (``check`` refuses them): AMP (TRL reads ``torch.is_autocast_enabled(device.type)``, which
meta does not have, and autocast is emulated here), LoRA on the head (the fused head reads
``lm_head.weight`` directly: the adapter is bypassed), QLoRA with DoRA, and sharding (as ``--framework hf``).

QLoRA: the bitsandbytes 4-bit base of ``--framework hf --qlora`` (:mod:`..hf_qlora`), then what
``SFTTrainer.__init__`` does to the model (:func:`_sft_peft_init`): no ``prepare_model_for_kbit_training``,
``enable_input_require_grads`` under checkpointing, the trainable parameters cast to bf16.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from types import SimpleNamespace
from collections.abc import Callable, Iterator
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memcalc.core.allocator import CachingAllocatorSim
from memcalc.core.errors import UserError
from memcalc.core.rules import loss_token_count
from memcalc.core.spec import ExperimentSpec

from ..hf_kernels import HFKernels, hf_patches
from ..hf_model import build_hf_model, param_counts
from ..hf_runner import _decoder_layers, check_hf, hf_measurement, hf_unsupported, quiet_transformers
from ..amp import Amp
from ..model import torch_dtype
from ..step import Measurement, Probe, run_on_device
from ..trl_offload import MetaOffload

EXTRA = "trl"

#: SFTTrainer.__init__'s ``add_fused_lm_head(..., outputs=("log_probs", "entropy", "is_top1"))``
#: (trl 1.16.0 trl/trainer/sft_trainer.py: ``is_top1`` feeds the ``mean_token_accuracy`` metric)
SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")


def why_not(exp: ExperimentSpec) -> Optional[str]:
    """Why TRL's step cannot be traced for ``exp`` (None when it can)."""
    tr = exp.training
    if exp.profile.cross_entropy != "trl-fused":
        return (f"--framework trl runs SFTTrainer's fused LM head (loss trl-fused); the profile's loss is "
                f"{exp.profile.cross_entropy} (drop --loss)")
    if tr.is_amp:
        return ("--framework trl: AMP is not traced (ChunkedLogProbFunction reads "
                "torch.is_autocast_enabled(device.type), which the meta device does not have); use --bf16 or fp32")
    if tr.lora is not None and tr.lora.qlora and tr.lora.dora:
        return "--framework trl: QLoRA with DoRA is not traced (its fp32 magnitude beside bf16 adapters)"
    if tr.lora is not None and "head" in tr.lora.targets:
        return ("--framework trl: LoRA on the head is bypassed by TRL's fused head (add_fused_lm_head reads "
                "lm_head.weight directly); drop head from --lora-targets")
    return None


def check(exp: ExperimentSpec) -> None:
    """One-line UserError for a setup TRL's traced step cannot express."""
    why = why_not(exp)
    if why:
        raise UserError(why)
    check_hf(exp)


class LabelMask(TorchDispatchMode):
    """The answers meta cannot compute (see the module docstring): ``nonzero`` of the label mask
    (``rows`` true positions, as the labels would have) and host reads (``.item()``, ``bool()``)."""

    def __init__(self, mask_shape: tuple[int, int], rows: int) -> None:
        super().__init__()
        self.mask_shape, self.rows = mask_shape, rows

    def _nonzero(self, m: torch.Tensor) -> torch.Tensor:
        if tuple(m.shape) != self.mask_shape or m.dtype != torch.bool:
            raise RuntimeError(f"nonzero of {tuple(m.shape)} {m.dtype}: only the label mask is answered on "
                               "meta")
        return torch.empty((self.rows, m.dim()), dtype=torch.long, device=m.device)

    def _long_indices(self, indices) -> list:
        """A bool index as CUDA's ``index``/``index_put_`` expand it (``expandTensors``: its ``nonzero``,
        one long index per dimension), the nonzero answered here."""
        out: list = []
        for ix in indices:
            if ix is not None and ix.dtype == torch.bool and ix.device.type == "meta":
                nz = self._nonzero(ix)
                out.extend(nz.select(1, d) for d in range(ix.dim()))
            else:
                out.append(ix)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func is aten.nonzero.default and args[0].device.type == "meta":
            return self._nonzero(args[0])
        if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                    aten._index_put_impl_.default) and any(
                ix is not None and ix.dtype == torch.bool for ix in args[1]) and args[0].device.type == "meta":
            return func(args[0], self._long_indices(args[1]), *args[2:], **kwargs)
        if func is aten.masked_select.default and args[0].device.type == "meta":
            # masked_select_cuda: index(self, mask) after expanding both (its nonzero first)
            return aten.index.Tensor(args[0], self._long_indices([args[1]]))
        if func is aten._local_scalar_dense.default and args[0].device.type == "meta":
            return True if args[0].dtype == torch.bool else 1
        return func(*args, **kwargs)


class _Launch:
    """A Triton kernel's ``kernel[grid](...)`` on meta: the launch writes in place; nothing allocated."""

    def __getitem__(self, grid):
        return lambda *a, **kw: None


def _addmm_fp32_cuda(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """trl/kernels/chunked_logprob.py ``_addmm_fp32``'s CUDA branch (in place, fp32 accumulate)."""
    import trl.kernels.chunked_logprob as cl

    if cl._MM_OUT_DTYPE and a.dtype in (torch.float16, torch.bfloat16):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


@contextlib.contextmanager
def trl_patches() -> Iterator[None]:
    """The kernel-dispatch patches of the module docstring; undone on exit."""
    import trl.kernels.chunked_logprob as cl
    import trl.trainer.utils as tu

    def use_triton(device: torch.device) -> bool:
        return device.type in ("cuda", "xpu", "meta")

    is_autocast_enabled = torch.is_autocast_enabled

    def autocast_enabled(*a, **kw) -> bool:  # meta has no autocast state: none (AMP is refused, why_not)
        return False if a and a[0] == "meta" else is_autocast_enabled(*a, **kw)

    saved = (cl._use_triton, tu._use_triton, cl._forward_kernel, cl._backward_kernel, cl._addmm_fp32)
    cl._use_triton = tu._use_triton = use_triton
    torch.is_autocast_enabled = autocast_enabled
    cl._forward_kernel = cl._backward_kernel = _Launch()
    cl._addmm_fp32 = _addmm_fp32_cuda
    try:
        yield
    finally:
        cl._use_triton, tu._use_triton, cl._forward_kernel, cl._backward_kernel, cl._addmm_fp32 = saved
        torch.is_autocast_enabled = is_autocast_enabled


@contextlib.contextmanager
def _peft_without_old_torchao() -> Iterator[None]:
    """PEFT 0.21's LoRA dispatch asks ``is_torchao_available()``, which *raises* when a torchao older
    than 0.16 is installed (torchtune's extra pins 0.14.1); the torchao dispatcher is only for
    torchao-quantized bases, which no setup here has: it answers False while the model is built."""
    import peft.tuners.lora.torchao as pt

    saved = pt.is_torchao_available

    def available() -> bool:
        try:
            return saved()
        except ImportError:
            return False

    pt.is_torchao_available = available  # type: ignore[assignment]
    try:
        yield
    finally:
        pt.is_torchao_available = saved


class _Trainer:
    """What ``SFTTrainer.compute_loss`` reads of ``self`` on one process with ``loss_type="nll"``."""

    def __init__(self, model) -> None:
        self.model = model
        self.aux_loss_enabled = False
        self.compute_loss_func = None
        self.label_smoother = None
        self.args = SimpleNamespace(loss_type="nll", average_tokens_across_devices=False)
        self.accelerator = SimpleNamespace(parallelism_config=None, num_processes=1,
                                           gather_for_metrics=lambda t: t)
        self._metrics: dict[str, defaultdict] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._total_train_tokens = 0
        self._tp_size = 1
        self.current_gradient_accumulation_steps = 1

    def get_tp_size(self) -> int:
        return 1


def measure(exp: ExperimentSpec, device: str, scale_layers: Optional[int] = None,
            progress: Optional[Callable[[str], None]] = None, allocator_sim: bool = False,
            debug: bool = False) -> Measurement:
    """Trace TRL's SFT step of ``exp`` (see the module docstring)."""
    import trl

    t0 = time.perf_counter()
    say = progress or (lambda _msg: None)
    meas = hf_measurement(exp, device, "trl")
    meas.library_versions = {"trl": trl.__version__}  # type: ignore[attr-defined]
    why = why_not(exp) or hf_unsupported(exp, device)
    if why is None and device != "meta":
        why = "--framework trl is traced on meta only (TRL's Triton kernels are replaced by no-ops)"
    if why:
        meas.status, meas.reason = "skipped", why
        meas.seconds = round(time.perf_counter() - t0, 3)
        return meas
    m = exp.model if scale_layers is None else exp.model.model_copy(update={"n_layers": scale_layers})
    meas.layers = m.n_layers
    run = lambda: _run(exp, m, device, say, meas, debug,  # noqa: E731
                       CachingAllocatorSim() if allocator_sim else None)
    with quiet_transformers():
        if exp.profile.kernels == "liger":  # Liger's layer kernels, traced as --framework hf traces them
            from ..hf_liger import liger_trace
            from ..hf_model import choose_family

            with liger_trace(choose_family(m).model_type):
                run()
        else:
            run()
    meas.seconds = round(time.perf_counter() - t0, 3)
    return meas


def _sft_peft_init(model, checkpointing: bool, quantized: bool) -> None:
    """What ``SFTTrainer.__init__`` (trl 1.16.0 trl/trainer/sft_trainer.py) does to the model after
    ``get_peft_model``: with PEFT and ``gradient_checkpointing``, ``model.enable_input_require_grads()``
    (line 899-900: the embedding output requires grad, so the first checkpointed layer's input has a
    gradient); on a quantized base (``_is_quantized_model``: ``is_loaded_in_4bit``), every trainable
    parameter but a DoRA magnitude vector is cast with ``param.data = param.data.to(torch.bfloat16)``
    (lines 908-911: the QLoRA paper's bf16 adapters). It does not call ``prepare_model_for_kbit_training``
    (no line of sft_trainer.py does; only trl/experimental's trainers)."""
    from peft import PeftModel

    if isinstance(model, PeftModel) and checkpointing:
        model.enable_input_require_grads()
    if quantized:
        for name, param in model.named_parameters():
            if param.requires_grad and "lora_magnitude_vector" not in name:
                param.data = param.data.to(torch.bfloat16)


def _run(exp: ExperimentSpec, m, device: str, say, meas: Measurement, debug: bool,
         sim: Optional[CachingAllocatorSim]) -> None:
    from peft import PeftModel
    from trl.trainer.sft_trainer import SFTTrainer
    from trl.trainer.utils import add_fused_lm_head

    tr = exp.training
    torch.manual_seed(0)
    amp = Amp(None)
    say(f"building {m.name} ({m.n_layers} layers) with transformers on {device}, TRL's fused LM head")
    qlora = tr.lora is not None and tr.lora.qlora
    with _peft_without_old_torchao():  # QLoRA: the bitsandbytes 4-bit base, no prepare_model_for_kbit_training
        model, _family = build_hf_model(m, tr.lora, torch_dtype(tr.weight_dtype.value), device,
                                        compute_dtype=torch_dtype(tr.compute_dtype.value),
                                        kbit_prepare=exp.profile.qlora_fp32_cast)
    quant_state: tuple = ()
    if qlora:
        from ..hf_qlora import quant_state_tensors

        quant_state = tuple(quant_state_tensors(model))
    _sft_peft_init(model, tr.checkpoint in ("full", "every-k"), qlora)
    if exp.profile.kernels == "liger":  # Trainer.train: apply_liger_kernel (rope, rms_norm, glu), then checkpointing
        from ..hf_liger import apply_liger

        apply_liger(model, exp)
    if tr.checkpoint in ("full", "every-k"):  # SFTConfig.gradient_checkpointing: Trainer's call, non-reentrant
        every = tr.checkpoint_every if tr.checkpoint == "every-k" else 1  # unless gradient_checkpointing_kwargs say
        kwargs = {"use_reentrant": tr.checkpoint_reentrant}
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, every_n_layers=every)
    add_fused_lm_head(model.get_base_model() if isinstance(model, PeftModel) else model,  # type: ignore[arg-type]
                      outputs=SFT_OUTPUTS)
    meas.params = param_counts(model)[0]
    trainer = _Trainer(model)
    rows = loss_token_count(tr.batch, tr.seq, exp.profile.loss_tokens)
    # SFTTrainer.__init__: get_act_offloading_ctx_manager(model=self.model) with activation_offloading, TRL's own
    # OffloadActivations, run on meta with what has no meaning there answered (..trl_offload)
    meta_offload = MetaOffload() if tr.activation_offload else None
    offload = meta_offload.build(model) if meta_offload is not None else None
    hooks: list = []

    def attach(probe: Probe) -> None:
        hooks.extend(layer.register_forward_pre_hook(lambda *_a, i=i: probe.label(f"layer {i}"))
                     for i, layer in enumerate(_decoder_layers(model, m.n_layers)))

    def forward(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        inputs = {"input_ids": ids, "labels": labels, "attention_mask": mask}
        if offload is not None:  # SFTTrainer.training_step: `with self.maybe_activation_offload_context:` around
            offload.__enter__()  # Trainer.training_step (compute_loss, then the backward)
        return SFTTrainer.compute_loss(trainer, model, inputs)  # type: ignore[arg-type]

    def backward(loss: torch.Tensor) -> None:
        loss.backward()
        if offload is not None:
            offload.__exit__(None, None, None)

    mask = torch.ones((tr.batch, tr.seq), dtype=torch.int64, device=device)
    kernels = HFKernels(exp.profile, amp)
    run_on_device(exp, m, device, model, meas, say, debug, sim, forward, attach,
                  contexts=(trl_patches(), hf_patches(model, kernels), kernels,
                            LabelMask((tr.batch, tr.seq - 1), rows),
                            *((meta_offload.patches(),) if meta_offload is not None else ())),
                  backward=backward, extra=quant_state)
    if meta_offload is not None:
        meas.host_activation_bytes = meta_offload.host.max_pinned_bytes
    for h in hooks:
        h.remove()
