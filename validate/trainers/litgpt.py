"""``memcalc validate --framework litgpt``: LitGPT 0.5.13's own fine-tuning step, traced on ``meta``.

What runs is LitGPT's code, unmodified:

- the model: ``litgpt.model.GPT`` (full fine-tuning, litgpt/finetune/full.py) or ``litgpt.lora.GPT``
  with ``mark_only_lora_as_trainable`` (litgpt/finetune/lora.py), built from a ``litgpt.config.Config``
  (``litgpt.lora.Config``) holding the spec's sizes (:func:`litgpt_config`); LoRA on the fused qkv
  projection is ``LoRAQKVLinear`` (one ``lora_A`` of rank r x the enabled parts, the grouped
  ``conv1d`` and its ``zero_pad``), the other targets ``LoRALinear``;
- Lightning Fabric's precision plugin as ``L.Fabric(precision=...)`` picks it
  (lightning/fabric/connector.py ``_check_and_init_precision``): ``32-true`` ``Precision()``,
  ``bf16-true`` / ``16-true`` ``HalfPrecision``, ``bf16-mixed`` ``MixedPrecision``. The model is
  built under ``module_init_context()`` (``fabric.init_module``) and ``convert_module``-ed
  (``fabric.setup_module``: ``SingleDeviceStrategy.setup_module``); every forward is
  ``_FabricModule.forward`` (lightning/fabric/wrappers.py): ``convert_input``, the model under
  ``forward_context()``, then ``convert_output``, which casts every floating output to
  ``torch.get_default_dtype()`` (fp32): the 16-bit logits (or head chunks) become fp32 copies;
- the step of the finetune scripts' ``fit``: ``model.max_seq_length`` set to the batch length;
  LoRA: ``logits = model(input_ids, lm_head_chunk_size=128)`` (a list of (B, 128, V) head chunks),
  ``logits[-1] = logits[-1][..., :-1, :]``, ``chunked_cross_entropy(logits, targets[..., 1:])``; full:
  ``logits = model(input_ids)``, ``chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:])``
  (litgpt/utils.py: the rows in chunks of 128, ``cross_entropy(reduction="none")`` each, ``cat``, ``sum``);
  ``fabric.backward(loss / accumulation)``; ``optimizer.step(); optimizer.zero_grad()``. ``logits`` is
  ``fit``'s local variable: the fp32 logits stay alive through backward and the optimizer step until
  the next micro-step's ``model(...)`` returns and the name is rebound (kept here the same way);
- ``--checkpoint full``: each ``Block`` wrapped in ``checkpoint_wrapper(block, preserve_rng_state=False)``,
  as litgpt/finetune/lora.py ``parallelize_fn`` does (LitGPT checkpoints only that way).

Only kernel dispatch is patched: :class:`~memcalc.validate.hf_kernels.HFKernels` routes
``F.scaled_dot_product_attention`` to the kernel CUDA picks and ``F.dropout`` to ``native_dropout``,
and emulates autocast for ``bf16-mixed`` (``torch.autocast`` does nothing on meta).
"""

from __future__ import annotations

import contextlib
import gc
import time
import warnings
from collections.abc import Callable
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memcalc.core.allocator import CachingAllocatorSim
from memcalc.core.errors import UserError
from memcalc.core.rules import LITGPT_LM_HEAD_CHUNK, balanced_rows
from memcalc.core.spec import ExperimentSpec, ModelSpec

from ..amp import Amp
from ..hf_kernels import HFKernels, _recompute_as_forward
from ..runner import unsupported
from ..step import Measurement, Probe, run_on_device

EXTRA = "litgpt"

#: memcalc --precision -> Lightning Fabric's precision string (litgpt/finetune/lora.py ``precision``)
PRECISIONS = {"fp32": "32-true", "bf16": "bf16-true", "fp16": "16-true", "amp-bf16": "bf16-mixed"}
#: memcalc LoRA targets -> LitGPT's ``lora_*`` switches (litgpt/lora.py Config)
_QKV = {"q": 0, "k": 1, "v": 2}


def version() -> Optional[str]:
    try:
        from importlib.metadata import version as v

        return v("litgpt")
    except Exception:  # not installed
        return None


def _why_not(exp: ExperimentSpec) -> Optional[str]:
    """Why LitGPT's single-device finetune scripts cannot express ``exp`` (None when they can)."""
    m, tr = exp.model, exp.training
    model = {
        "multi-head latent attention": m.mla is not None,
        f"positions {m.positions}": m.positions != "rope", "sliding-window attention": m.sliding_window is not None,
        "attention softcapping": m.attn_softcap is not None, "final logit softcapping": m.logit_softcap is not None,
        "attention sinks": m.attn_sinks, f"qk_norm {m.qk_norm}": m.qk_norm != "none",
        f"norm placement {m.norm_placement}": m.norm_placement != "pre", "fused gate/up": m.fused_gate_up,
        "tied embeddings (LitGPT's GPT always builds its own lm_head, litgpt/model.py GPT.__init__)":
            m.tie_embeddings,
        "dropout (LitGPT's GPT has none)": bool(m.attn_dropout or m.resid_dropout or m.embd_dropout),
        "scaled residuals or logits": m.residual_scale != 1.0 or m.residual_multiplier != 1.0 or m.logit_scale != 1.0,
        f"activation {m.activation} with the {m.mlp} MLP": not _mlp_ok(m),
        "a bias on only some projections": _bias(m) is None,
        "no final norm": not m.final_norm,
        "a LayerNorm without bias (LitGPT's is torch.nn.LayerNorm)": m.norm == "layernorm" and not m.has_norm_bias,
        "a bias on RMSNorm": m.norm == "rmsnorm" and m.has_norm_bias,
    }
    bad = [k for k, v in model.items() if v] + _moe_why(m, exp.training.lora)
    if bad:
        return f"--framework litgpt: LitGPT's Config cannot express {bad[0]}"
    if m.norm == "rmsnorm" and not exp.profile.norm_upcast:
        return ("--framework litgpt: LitGPT 0.5.13's RMSNorm upcasts to fp32 (litgpt/model.py RMSNorm.forward: "
                "x.float()); lit-gpt's before 6178c7cc (profile litgpt-2023.10, norm_upcast False) is not installed "
                "here: its composite RMSNorm in the input dtype is traced by memcalc's replica (--framework plain, "
                "the field contract's KernelProfile.norm_upcast row)")
    if tr.precision not in PRECISIONS:
        return (f"--framework litgpt: precision {tr.precision} (16-mixed needs CUDA's GradScaler); "
                f"LitGPT runs {', '.join(PRECISIONS)} here")
    train = {
        f"checkpoint {tr.checkpoint}": tr.checkpoint not in ("none", "full"), "torch.compile": tr.compile,
        "ZeRO or more than one GPU": tr.zero > 0 or tr.gpus > 1, "tensor parallelism": tr.tp > 1,
        "a fused optimizer step": tr.fused_optimizer, "fp32 master weights": tr.master_weights,
        "activation offloading": tr.activation_offload, "optimizer offload": tr.offload_optimizer,
        "DeepSpeed": tr.deepspeed is not None,
    }
    bad = [k for k, v in train.items() if v]
    if bad:
        return f"--framework litgpt: LitGPT's single-device finetune scripts do not run {bad[0]}"
    lora = tr.lora
    if lora is not None:
        if lora.qlora and tr.precision not in ("bf16", "fp16"):
            return ("--framework litgpt: QLoRA is BitsandbytesPrecision(mode, dtype) with bf16-true or 16-true "
                    "(finetune/lora.py: mixed precision refused; 32-true is not traced)")
        if lora.quant is not None:
            return "--framework litgpt: LitGPT quantizes with bitsandbytes (--quantize bnb.*), not GPTQ / AWQ"
        if lora.dora:
            return "--framework litgpt: LitGPT 0.5.13 has no DoRA"
        if lora.dtype == "fp32" and tr.weight_dtype.value != "fp32":
            return "--framework litgpt: Fabric's precision converts the adapters with the base (no --lora-dtype fp32)"
        why = _lora_why(m, lora.targets)
        if why:
            return why
    return None


def _moe_why(m: ModelSpec, lora) -> list[str]:
    """What of ``m.moe`` LitGPT 0.5.13's ``LLaMAMoE`` (litgpt/model.py, litgpt/lora.py) cannot build."""
    moe = m.moe
    if moe is None:
        return []
    bad = {
        "an MoE with experts other than LLaMAMLP (LLaMAMoE's experts are SiLU-gated)":
            m.mlp != "gated" or m.activation != "silu",
        "shared experts (litgpt/lora.py LLaMAMoE.__init__ builds none; not traced here)": moe.n_shared_experts > 0,
        "a sparse step other than every layer (LitGPT has no decoder_sparse_step)": moe.every != 1,
        "router or expert biases (LLaMAMoE's gate and experts have none)": moe.router_bias or moe.expert_bias,
        "the sigmoid group-limited router (LitGPT's GroupedTopkRouter is not traced here)": moe.router == "sigmoid",
        "dense first layers under LoRA (litgpt/lora.py Block.__init__ replaces first_k_dense_replace's LLaMAMLP "
        "with config.mlp_class: every layer is LLaMAMoE)": lora is not None and moe.first_dense_layers > 0,
    }
    return [k for k, v in bad.items() if v]


def _mlp_ok(m: ModelSpec) -> bool:
    if m.mlp == "gated":
        return m.activation in ("silu", "gelu_tanh", "gelu_new", "gelu")
    return m.activation in ("gelu", "gelu_tanh", "gelu_new")


def _bias(m: ModelSpec) -> Optional[tuple[bool, bool]]:
    """LitGPT's (``bias``, ``attn_bias``): ``bias`` puts one on every projection (qkv, proj, the MLP),
    ``attn_bias`` on qkv alone (litgpt/model.py CausalSelfAttention, LLaMAMLP); None: not expressible."""
    if m.qkv_bias and m.o_bias and m.mlp_bias:
        return True, False
    if not m.o_bias and not m.mlp_bias:
        return False, m.qkv_bias
    return None


def _mlp_parts(m: ModelSpec) -> tuple[str, ...]:
    return ("gate", "up", "down") if m.mlp == "gated" else ("up", "down")


def _lora_why(m: ModelSpec, targets: tuple[str, ...]) -> Optional[str]:
    ts = set(targets)
    mlp = set(_mlp_parts(m))
    if ts & mlp and not mlp <= ts:
        return (f"--framework litgpt: lora_mlp adapts every MLP projection ({', '.join(sorted(mlp))}) together; "
                f"targets {', '.join(targets)} split them")
    extra = ts - {"q", "k", "v", "qkv", "o", "head"} - mlp
    if extra:
        return f"--framework litgpt: LitGPT has no LoRA on {', '.join(sorted(extra))}"
    return None


def check(exp: ExperimentSpec) -> None:
    """The one-line UserError for a setup LitGPT cannot express (see :func:`_why_not`)."""
    why = _why_not(exp)
    if why:
        raise UserError(why)


def litgpt_config(m: ModelSpec, lora=None):
    """The ``litgpt.config.Config`` (``litgpt.lora.Config`` with ``lora``) of the spec's sizes: the
    fields LitGPT's config table sets for a model (litgpt/config.py ``configs``)."""
    from litgpt.config import Config  # type: ignore[import-untyped]
    from litgpt.lora import Config as LoraConfig  # type: ignore[import-untyped]

    bias, attn_bias = _bias(m) or (False, False)
    gated = "LLaMAMLP" if m.activation == "silu" else "GemmaMLP"
    mlp = gated if m.mlp == "gated" else "GptNeoxMLP"
    kw = dict(
        name=m.name, block_size=m.max_seq_len, vocab_size=m.vocab_size, padded_vocab_size=m.vocab_size,
        n_layer=m.n_layers, n_head=m.n_heads, n_embd=m.d_model, head_size=m.dim_head,
        n_query_groups=m.kv_heads, intermediate_size=m.d_ff, rotary_percentage=m.rotary_pct,
        parallel_residual=m.block == "parallel", shared_attention_norm=m.block == "parallel" and m.parallel_norms == 1,
        bias=bias, attn_bias=attn_bias, lm_head_bias=m.lm_head_bias,
        norm_class_name="RMSNorm" if m.norm == "rmsnorm" else "LayerNorm", norm_eps=m.norm_eps,
        mlp_class_name=mlp, gelu_approximate="none" if m.activation in ("gelu", "silu") else "tanh",
        scale_embeddings=m.embedding_scale != 1.0,
    )
    if m.moe is not None:  # litgpt/config.py Mixtral / Qwen3-MoE rows: LLaMAMoE of n_expert LLaMAMLPs
        kw.update(mlp_class_name="LLaMAMoE", n_expert=m.moe.n_experts, n_expert_per_token=m.moe.top_k,
                  moe_intermediate_size=m.moe.d_ff_expert, first_k_dense_replace=m.moe.first_dense_layers or None)
    if lora is None:
        return Config(**kw)
    ts = set(lora.targets)
    qkv = [("qkv" in ts) or (p in ts) for p in _QKV]
    return LoraConfig(**kw, lora_r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      lora_query=qkv[0], lora_key=qkv[1], lora_value=qkv[2], lora_projection="o" in ts,
                      lora_mlp=bool(ts & set(_mlp_parts(m))), lora_head="head" in ts)


def precision_plugin(precision: str):
    """Lightning Fabric's plugin for ``precision`` as ``L.Fabric(precision=...)`` builds it
    (lightning/fabric/connector.py ``_check_and_init_precision``)."""
    from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision

    name = PRECISIONS[precision]
    if name == "32-true":
        return Precision()
    if name.endswith("-true"):
        return HalfPrecision(name)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MixedPrecision(name, device="cuda")  # type: ignore[arg-type]


def measure(exp: ExperimentSpec, device: str, scale_layers: Optional[int] = None,
            progress: Optional[Callable[[str], None]] = None, allocator_sim: bool = False,
            debug: bool = False) -> Measurement:
    """Trace (meta) or measure (cpu, cuda) LitGPT's fine-tuning step of ``exp`` (module docstring)."""
    t0 = time.perf_counter()
    say = progress or (lambda _msg: None)
    meas = Measurement(device=device, framework="litgpt")
    meas.library_versions = {"litgpt": version() or "?", "lightning": _lightning_version()}
    why = _why_not(exp) or unsupported(exp, device)
    if why:
        meas.status, meas.reason = "skipped", why
        meas.seconds = round(time.perf_counter() - t0, 3)
        return meas
    m = exp.model if scale_layers is None else exp.model.model_copy(update={"n_layers": scale_layers})
    meas.layers = m.n_layers
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _run(exp, m, device, say, meas, debug, CachingAllocatorSim() if allocator_sim else None)
    except torch.cuda.OutOfMemoryError as e:  # type: ignore[attr-defined]
        meas.status = "oom"
        meas.reason = str(e).strip().splitlines()[0] if str(e).strip() else "CUDA out of memory"
    finally:
        gc.collect()
        if device == "cuda" and torch.cuda.is_available():
            torch.cuda.empty_cache()
    meas.seconds = round(time.perf_counter() - t0, 3)
    return meas


def _lightning_version() -> str:
    try:
        import lightning

        return lightning.__version__
    except ImportError:
        return "?"


def build(m: ModelSpec, lora, plugin, device: str, checkpoint: bool):
    """LitGPT's model as the finetune scripts' ``main`` builds it: ``GPT(config)`` under
    ``fabric.init_module()`` (the plugin's ``module_init_context``), ``mark_only_lora_as_trainable``,
    ``fabric.setup_module`` (``convert_module``, then the device)."""
    from litgpt import lora as litgpt_lora  # type: ignore[import-untyped]
    from litgpt.model import GPT  # type: ignore[import-untyped]

    config = litgpt_config(m, lora)
    with torch.device(device), plugin.module_init_context():
        model = litgpt_lora.GPT(config) if lora is not None else GPT(config)
    if lora is not None:
        litgpt_lora.mark_only_lora_as_trainable(model)
    if checkpoint:  # litgpt/finetune/lora.py parallelize_fn
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        model.transformer.h = torch.nn.ModuleList(
            [checkpoint_wrapper(el, preserve_rng_state=False) for el in model.transformer.h])
    model = plugin.convert_module(model)
    if lora is not None and lora.qlora:
        to_4bit(model, lora, device)
    return model.to(device)


def to_4bit(module: torch.nn.Module, lora, device: str) -> None:
    """``BitsandbytesPrecision.convert_module`` (lightning/fabric/plugins/precision/bitsandbytes.py
    ``_convert_layers``, ``ignore_modules`` empty as finetune/lora.py builds it): every ``torch.nn.Linear``
    child, LoRA layers' ``.linear`` and ``lm_head`` included, becomes the 4-bit class. Here that class
    is memcalc's replica of bitsandbytes' ``Linear4bit`` (``validate/blocks/adapters.py`` ``Linear``:
    ``x.to(compute_dtype)``, ``MatMul4Bit``, ``.to(inp_dtype)``; ``--bnb-saves-input``: 0.41/0.42's
    ``MatMul4Bit``, which LitGPT 0.4 pinned), since bitsandbytes' quantization and 0.42 need CUDA; the
    storage is what ``quantize_4bit`` leaves. The bias stays a parameter in the model dtype."""
    from ..amp import Amp as _Amp
    from ..blocks.adapters import Linear as Replica

    for name, child in module.named_children():
        if type(child) is torch.nn.Linear:
            q = Replica(child.in_features, child.out_features, child.bias is not None, _Amp(None),
                        dtype=child.weight.dtype, device=device, trainable=False, lora=lora,
                        init=torch.device(device).type != "meta")
            # an nn.Linear subclass's sizes; its ``weight`` the packed storage (LoRAQKVLinear.lora_ind reads its device)
            for attr, value in (("in_features", child.in_features), ("out_features", child.out_features),
                                ("weight", q.nf4.packed if q.nf4 is not None else None)):
                setattr(q, attr, value)
            if child.bias is not None:
                q.bias = child.bias
            setattr(module, name, q)
        else:
            to_4bit(child, lora, device)


def fabric_forward(model, plugin) -> Callable:
    """``_FabricModule.forward`` (lightning/fabric/wrappers.py): ``convert_input``, the model under
    ``forward_context()``, ``convert_output``."""
    def forward(*args, **kwargs):
        args, kwargs = plugin.convert_input((args, kwargs))
        with plugin.forward_context():
            output = model(*args, **kwargs)
        return plugin.convert_output(output)
    return forward


def _run(exp: ExperimentSpec, m: ModelSpec, device: str, say, meas: Measurement, debug: bool,
         sim: Optional[CachingAllocatorSim]) -> None:
    from litgpt.utils import chunked_cross_entropy  # type: ignore[import-untyped]

    tr = exp.training
    torch.manual_seed(0)
    plugin = precision_plugin(tr.precision)
    amp = Amp(torch.bfloat16 if tr.precision == "amp-bf16" else None)
    say(f"building {m.name} ({m.n_layers} layers) with LitGPT on {device}")
    model = build(m, tr.lora, plugin, device, tr.checkpoint == "full")
    # fit(): min(longest_seq_length, train.max_seq_length): the longest micro-batch, the first one with first_seq
    model.max_seq_length = max(tr.seq, tr.first_seq or 0)
    meas.params = sum(p.numel() for p in model.parameters())
    kernels = HFKernels(exp.profile, amp)
    run = fabric_forward(model, plugin)
    chunked_head = tr.lora is not None  # lora.py fit: model(input_ids, lm_head_chunk_size=128); full.py: no chunks
    held: dict = {}  # fit()'s `logits`: rebound only once the next model(...) has returned
    blocks = list(model.transformer.h)
    hooks: list = []

    def attach(probe: Probe) -> None:
        hooks.extend(b.register_forward_pre_hook(lambda *_a, i=i: probe.label(f"layer {i}"))
                     for i, b in enumerate(blocks))
        hooks.append(model.lm_head.register_forward_pre_hook(lambda *_a: probe.label("head & loss")))

    def forward(ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with amp.region() if amp.dtype is not None else contextlib.nullcontext():
            logits = run(ids, lm_head_chunk_size=LITGPT_LM_HEAD_CHUNK) if chunked_head else run(ids)
        held["logits"] = logits
        if chunked_head:  # litgpt/finetune/lora.py fit
            logits[-1] = logits[-1][..., :-1, :]
            return chunked_cross_entropy(logits, targets[..., 1:])
        return chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:])  # litgpt/finetune/full.py fit

    contexts: tuple = (kernels,)
    if tr.checkpoint == "full":
        contexts = (_recompute_in_mode(blocks, kernels), kernels)
    if m.moe is not None:
        contexts = (BalancedRouting(model, m.moe.n_experts, m.moe.top_k), *contexts)
    run_on_device(exp, m, device, model, meas, say, debug, sim, forward, attach, contexts=contexts)
    held.clear()
    for h in hooks:
        h.remove()


class BalancedRouting(TorchDispatchMode):
    """The routing answer ``LLaMAMoE.forward``'s loop needs on meta (litgpt/model.py: ``token_idx, expert_idx =
    torch.where(mask)`` per expert, ``aten.nonzero``, whose row count is data): expert ``j`` of a block's loop
    gets its share of the ``N x k`` routed rows, ``MoESpec.routing`` balanced (:func:`balanced_rows`), the
    first ``N k mod E`` experts one more. Only that shape is answered; every op of the loop is LitGPT's. Each
    ``LLaMAMoE`` forward (and its checkpointed recompute) restarts the count (a forward pre-hook)."""

    def __init__(self, model, n_experts: int, top_k: int) -> None:
        super().__init__()
        from litgpt.model import LLaMAMoE  # type: ignore[import-untyped]

        self.E, self.k, self.j = n_experts, top_k, 0
        self.hooks = [mod.register_forward_pre_hook(self._restart) for mod in model.modules()
                      if isinstance(mod, LLaMAMoE)]

    def _restart(self, *_a) -> None:
        self.j = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.nonzero.default and args[0].device.type == "meta":
            rows = balanced_rows(args[0].size(0) * self.k, self.E)[self.j % self.E]
            self.j += 1
            return torch.empty((rows, args[0].dim()), dtype=torch.int64, device="meta")
        return func(*args, **kwargs)

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        return super().__exit__(*exc)


@contextlib.contextmanager
def _recompute_in_mode(blocks, mode: HFKernels):
    """``CheckpointWrapper.checkpoint_fn`` run as the forward ran: the kernel routing on and the autocast
    region re-entered (the recomputation runs inside ``loss.backward()``, where the mode is off)."""
    saved = [(b, b.checkpoint_fn) for b in blocks]
    for b, fn in saved:
        b.checkpoint_fn = _recompute_as_forward(fn, mode)
    try:
        yield
    finally:
        for b, fn in saved:
            b.checkpoint_fn = fn

