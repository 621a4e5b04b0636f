"""The real Hugging Face training step (transformers + PEFT), traced on ``meta`` (or run on ``cpu``/``cuda``).

``measure_hf(exp, device)`` is :func:`~.runner.measure` for ``--framework hf``: the same step (two
steps, the second measured; the optimizer of the spec from :mod:`.optim`; ``zero_grad(set_to_none=True)``;
gradient accumulation and fused-optimizer hooks as in :mod:`.runner`), counted by the same
:class:`~.tracer.StorageTracer`, but the model is ``transformers``' own
(:func:`~.hf_model.build_hf_model`: ``AutoModelForCausalLM.from_config`` under ``torch.device``, PEFT
LoRA on top) and the loss is HF's (``model(input_ids=ids, labels=labels).loss``: ``ForCausalLMLoss``
upcasts the logits to fp32 and shifts the labels). The output object (logits, KV cache) is dropped
when ``.loss`` is taken, as HF Trainer's ``compute_loss`` drops it before backward.

Training setup as HF Trainer (transformers 5.23 ``Trainer.__init__``) makes it:

- ``--checkpoint full`` / ``every-K``: ``model.activation_checkpointing_enable(
  activation_checkpointing_kwargs={"use_reentrant": ...}, every_n_layers=1 | K)`` after PEFT is applied
  (Trainer enables it on the PEFT model); the default is non-reentrant, as ``_activation_checkpointing_enable``
  chooses when no kwargs are given; the spec's ``checkpoint_reentrant`` selects the other. That call also registers
  ``enable_input_require_grads`` (the embedding output requires grad). ``sqrt`` and ``selective``
  have no HF equivalent: ``skipped``.
- AMP: the forward and the loss run in an autocast region (Trainer's ``autocast_smart_context_manager``),
  emulated on meta by :class:`~.hf_kernels.HFKernels`; backward and the optimizer step outside it.
- ``use_cache`` stays the config's (True: without checkpointing the forward fills a ``DynamicCache``,
  a ``torch.cat`` copy of each layer's K and V that attention then uses and saves).

Only kernel dispatch is patched (:mod:`.hf_kernels`). QLoRA loads its base through bitsandbytes as
``from_pretrained`` does (:mod:`.hf_qlora`; meta or cuda). torch.compile off CUDA, ZeRO across GPUs
and optimizer offload are ``skipped`` with the reason.
"""

from __future__ import annotations

import contextlib
import gc
import time
import warnings
from collections.abc import Iterator
from typing import Callable, Optional

import torch

from memcalc.core.allocator import CachingAllocatorSim
from memcalc.core.errors import UserError
from memcalc.core.spec import ExperimentSpec

from .amp import Amp
from .hf_kernels import HFKernels, hf_patches
from .offload import OffloadActivations
from .hf_model import build_hf_model, choose_family, param_counts, peft_targets
from .model import torch_dtype
from .runner import unsupported
from .step import Measurement, Probe, run_on_device


def library_versions() -> tuple[Optional[str], Optional[str]]:
    """(transformers, peft) versions, None where not installed."""
    out = []
    for name in ("transformers", "peft"):
        try:
            out.append(__import__(name).__version__)
        except ImportError:
            out.append(None)
    return out[0], out[1]


def _has_every_n_layers() -> bool:
    from transformers import PreTrainedModel

    return hasattr(PreTrainedModel, "activation_checkpointing_enable")


def hf_unsupported(exp: ExperimentSpec, device: str) -> Optional[str]:
    """Why ``--framework hf`` cannot run this experiment on ``device`` (None when it can)."""
    tr = exp.training
    if tr.checkpoint in ("sqrt", "selective", "selective-op"):
        return (f"--framework hf: checkpoint {tr.checkpoint} has no Hugging Face equivalent "
                "(activation_checkpointing_enable checkpoints every layer or every N-th: full, every-K)")
    if tr.checkpoint == "every-k" and not _has_every_n_layers():
        return "--framework hf: checkpoint every-K needs transformers' activation_checkpointing_enable(every_n_layers)"
    if tr.lora is not None and tr.lora.qlora and tr.lora.bnb_saves_input:
        return ("--framework hf: --bnb-saves-input is bitsandbytes before 0.43.2; the installed one keeps only the "
                "packed weight (memcalc's replica, --framework plain, traces it)")
    if tr.lora is not None and tr.lora.qlora and device == "cpu":
        return "--framework hf: QLoRA runs bitsandbytes' CUDA kernels; traced on meta (their allocations) or run on cuda"
    if exp.profile.kernels == "liger" and tr.lora is not None and "head" in tr.lora.targets:
        return ("--kernels liger: the fused cross-entropy reads lm_head.weight directly (liger_kernel "
                "model/llama.py lce_maybe_trainable_lm_head), so a LoRA adapter on the head is bypassed")
    if tr.lora is not None and tr.lora.dropout and _adapts_experts(exp.model, tr.lora.targets):
        return ("--framework hf: PEFT adapts MoE experts through lora.ParamWrapper, which refuses lora_dropout != 0 "
                "(peft/tuners/lora/layer.py ParamWrapper.__init__); use --lora-dropout 0 or targets "
                "without the experts (and, where PEFT maps gate/up/down onto them, without those)")
    return unsupported(exp, device)


def _adapts_experts(m, targets) -> bool:
    """LoRA reaches the 3-D expert parameters: target ``experts``, or gate/up/down on a family whose
    MLP names PEFT 0.21 converts to expert adapters (``MoeSpec.lora_mlp_to_experts``)."""
    if m.moe is None:
        return False
    return "experts" in targets or (m.moe.lora_mlp_to_experts and bool({"gate", "up", "down"} & set(targets)))


#: families whose projections are transformers' ``Conv1D`` (pytorch_utils.py), weights stored (in, out)
CONV1D_FAMILIES = ("gpt2",)


def check_hf(exp: ExperimentSpec) -> None:
    """Raise the one-line UserError for a model or LoRA setup the HF families cannot express."""
    fam = choose_family(exp.model)
    if exp.training.lora is not None:
        peft_targets(fam, exp.training.lora)
        if exp.training.lora.qlora and fam.model_type in CONV1D_FAMILIES:
            raise UserError(f"--qlora on {fam.model_type}: its projections are transformers' Conv1D, which the "
                            "QLoRA trace does not quantize yet (validate/hf_qlora.py load_4bit reads nn.Linear "
                            "weights); memcalc estimate models it")
    if exp.profile.kernels == "liger":
        from .hf_liger import check_liger

        check_liger(exp, fam.model_type)
    if exp.profile.kernels == "cce":
        from .hf_cce import check_cce_setup

        check_cce_setup(exp, fam.model_type)


def hf_measurement(exp: ExperimentSpec, device: str, framework: str) -> Measurement:
    """A new measurement of a transformers step: the framework and the transformers (and, with LoRA,
    PEFT) versions it runs."""
    tv, pv = library_versions()
    meas = Measurement(device=device)
    meas.framework, meas.transformers_version = framework, tv
    meas.peft_version = pv if exp.training.lora is not None else None
    return meas


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' logging at error level ("use_cache=True is incompatible with checkpointing" and
    the like) and FutureWarnings off (transformers 5 deprecations PEFT still calls) while a step runs;
    the logging level restored and the garbage collected after."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        gc.collect()


def measure_hf(exp: ExperimentSpec, device: str, scale_layers: Optional[int] = None,
               progress: Optional[Callable[[str], None]] = None, debug: bool = False, allocator_sim: bool = False,
               capacity: Optional[int] = None,
               kernels_seen: Optional[list] = None, snapshot: Optional[str] = None) -> Measurement:
    """Trace (meta) or measure (cpu, cuda) the HF step of ``exp``; see the module docstring.
    ``kernels_seen``, when given, receives :attr:`HFKernels.calls` (one entry per SDPA call); ``snapshot``
    (CUDA): a ``_dump_snapshot`` of both steps (:func:`.step.run_on_device`)."""
    t0 = time.perf_counter()
    say = progress or (lambda _msg: None)
    meas = hf_measurement(exp, device, "hf")
    why = hf_unsupported(exp, device)
    if why:
        meas.status, meas.reason = "skipped", why
        meas.seconds = round(time.perf_counter() - t0, 3)
        return meas
    m = exp.model if scale_layers is None else exp.model.model_copy(update={"n_layers": scale_layers})
    meas.layers = m.n_layers
    try:
        with quiet_transformers():
            _run(exp, m, device, say, meas, debug, CachingAllocatorSim(capacity) if allocator_sim else None,
                 exp.training.checkpoint_reentrant, kernels_seen, snapshot)
    except UserError as e:  # a setup the kernel library's rules refuse (memcalc.core.liger)
        meas.status, meas.reason = "skipped", str(e)
    except torch.cuda.OutOfMemoryError as e:  # type: ignore[attr-defined]
        meas.status = "oom"
        meas.reason = str(e).strip().splitlines()[0] if str(e).strip() else "CUDA out of memory"
    finally:
        if device == "cuda" and torch.cuda.is_available():
            torch.cuda.empty_cache()
    meas.seconds = round(time.perf_counter() - t0, 3)
    return meas


def _decoder_layers(model, n_layers: int):
    for mod in model.modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == n_layers:
            return mod
    return []


def _run(exp: ExperimentSpec, m, device: str, say, meas: Measurement, debug: bool,
         sim: Optional[CachingAllocatorSim], reentrant: bool, kernels_seen: Optional[list],
         snapshot: Optional[str] = None) -> None:
    if exp.profile.kernels not in ("liger", "cce"):
        return _run_step(exp, m, device, say, meas, debug, sim, reentrant, kernels_seen, snapshot)
    from .hf_cce import cce_trace
    from .hf_liger import liger_trace

    model_type = choose_family(m).model_type
    with (liger_trace if exp.profile.kernels == "liger" else cce_trace)(model_type):
        _run_step(exp, m, device, say, meas, debug, sim, reentrant, kernels_seen, snapshot)


def _run_step(exp: ExperimentSpec, m, device: str, say, meas: Measurement, debug: bool,
              sim: Optional[CachingAllocatorSim], reentrant: bool, kernels_seen: Optional[list],
              snapshot: Optional[str] = None) -> None:
    tr = exp.training
    dev_type = torch.device(device).type
    if dev_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)
    amp = Amp(torch_dtype(tr.compute_dtype.value) if tr.is_amp else None)
    say(f"building {m.name} ({m.n_layers} layers) with transformers on {device}")
    model, family = build_hf_model(m, tr.lora, torch_dtype(tr.weight_dtype.value), device,
                                   compute_dtype=torch_dtype(tr.compute_dtype.value),
                                   kbit_prepare=exp.profile.qlora_fp32_cast)
    quant_state: tuple = ()
    if tr.lora is not None and tr.lora.qlora:
        from .hf_qlora import quant_state_tensors

        quant_state = tuple(quant_state_tensors(model))
    if exp.profile.kernels == "liger":  # Trainer.train: apply_liger_kernel, then checkpointing (hf_liger.py)
        from .hf_liger import apply_liger, check_liger

        check_liger(exp, family.model_type)
        apply_liger(model, exp)
    if exp.profile.kernels == "cce":  # axolotl's CutCrossEntropyPlugin: cce_patch before training (hf_cce.py)
        from .hf_cce import apply_cce, check_cce_setup

        check_cce_setup(exp, family.model_type)
        apply_cce(model)
    if tr.checkpoint in ("full", "every-k"):
        every = tr.checkpoint_every if tr.checkpoint == "every-k" else 1
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x (every_n_layers)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant},
                                                  every_n_layers=every)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    meas.params = param_counts(model)[0]
    head = model.get_output_embeddings()
    hooks: list = []

    # torchtune get_act_offloading_ctx_manager on an HF model: OffloadActivations around the forward,
    # nothing offloaded from lm_head on (here the loss runs inside the forward, so the context closes there)
    offload = OffloadActivations() if tr.activation_offload else None

    def attach(probe: Probe) -> None:
        hooks.extend(layer.register_forward_pre_hook(lambda *_a, i=i: probe.label(f"layer {i}"))
                     for i, layer in enumerate(_decoder_layers(model, m.n_layers)))
        if head is not None:
            hooks.append(head.register_forward_pre_hook(lambda *_a: probe.label("head & loss")))
            if offload is not None:
                hooks.append(head.register_forward_pre_hook(lambda *_a: offload.close()))

    def forward(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with amp.region():
            if offload is not None:
                offload.__enter__()
            loss = model(input_ids=ids, labels=labels).loss
            if offload is not None:
                offload.close()
        return loss

    kernels = HFKernels(exp.profile, amp)
    run_on_device(exp, m, device, model, meas, say, debug, sim, forward, attach,
                  contexts=(hf_patches(model, kernels), kernels), extra=quant_state, snapshot=snapshot)
    if offload is not None:
        meas.host_activation_bytes = offload.max_pinned_bytes
    if kernels_seen is not None:
        kernels_seen.extend(kernels.calls)
    for h in hooks:
        h.remove()
