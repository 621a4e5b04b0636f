"""The optimizers a :class:`~memcalc.core.spec.TrainingSpec` names, built as the reference code builds them.

One builder per record of the registry (:data:`memcalc.core.optimizers.OPTIMIZERS`, the names the
spec accepts); a test checks that every record has one.

- ``adafactor``: Forgather's Adafactor (src/forgather/ml/optim/adafactor.py at commit
  a0ce9176), line for line: no first moment, factored row/column second moment in the
  parameter's dtype (a full vector for 1-D parameters), a CPU step counter, fp32
  temporaries in the update. (The original wraps the loop in
  ``torch._dynamo.utils.disable_cache_limit()``, which only matters under compile.)
- ``adamw`` / ``adam`` / ``sgd`` / ``sgd-momentum``: ``torch.optim`` with
  ``foreach``/``fused`` per ``optimizer_impl`` (CUDA's default for AdamW is foreach). On
  ``meta``, torch.optim refuses ``fused=True`` by device name only; :func:`allow_fused_on`
  lifts that check (the ``_fused_adamw_`` meta kernel exists).
- ``lion``: lion-pytorch's ``update_fn`` (one momentum buffer; ``exp_avg.clone().lerp_().sign_()``).
- ``adamw-8bit``: bitsandbytes' blockwise 8-bit AdamW *memory*: uint8 moments plus an fp32
  absmax per 256-element block for tensors of at least 4096 elements (``min_8bit_size``),
  fp32 moments below; the update is one in-place kernel, so no temporaries are allocated
  (the numerics are not reproduced).
- ``paged-adamw`` / ``paged-adamw-8bit``: bitsandbytes ``PagedAdamW`` / ``PagedAdamW8bit`` memory:
  the same state, but the moment buffers of parameters of at least 1e5 elements are CUDA unified
  memory (``F.get_paged``), outside the caching allocator; the stand-in allocates them outside the
  tracer (:func:`_unified`).
- ``adamw-4bit-torchao`` / ``adamw-8bit-torchao`` / ``adamw-fp8-torchao``: torchao's own
  ``AdamW4bit`` / ``AdamW8bit`` / ``AdamWFp8`` (torchao 0.14.1 torchao/optim/adam.py), unmodified: its
  state subclasses and its per-parameter ``torch.compile(single_param_adam, fullgraph=True)``. Off CUDA the
  compile's backend is ``aot_eager`` (:class:`_TorchaoOnMeta`): the functional graph AOTAutograd would hand
  Inductor runs op by op (the subclasses flattened to their codes/scale/qmap), every intermediate freed
  at its last use; Inductor (Triton) needs CUDA.
- ``galore-adamw``: galore_torch 1.0's own ``GaLoreAdamW`` (galore_torch/adamw.py), unmodified, with the param
  groups transformers' ``_setup_low_rank_optimizer`` makes (the others first, then the targeted linears with
  rank, scale 0.25, proj_type "std"); ``update_proj_gap`` is 1 so that every traced step is the one that
  recomputes the projection by SVD (the first and every 200th in a run: the peak one, which the estimate
  models). ``torch.linalg.svd`` runs as its meta kernel (its outputs only; cuSOLVER's workspace is not seen).
- ``master_weights``: 16-bit parameters and gradients, fp32 master copies and fp32 moments;
  each gradient is copied to fp32 for the step (``grad.float()``), the master is stepped by a
  fused (temporary-free) kernel like apex/DeepSpeed FusedAdam, then copied back.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Optional, Tuple

import torch
from torch import Tensor
from torch.optim import Optimizer

from memcalc.core.errors import UserError
from memcalc.core.optimizers import (BNB_BLOCK, BNB_MIN_8BIT_SIZE, BNB_PAGED_MIN_NUMEL, GALORE_RANK, galore_target,
                                     get_optimizer)
from memcalc.core.spec import TrainingSpec


# -- Forgather Adafactor --------------------------------------------------------------------
class Adafactor(Optimizer):
    """Forgather's Adafactor (see the module docstring)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, decay_rate: float = -0.8, clip_threshold: float = 1.0,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: Tuple[float, float] = (1e-30, 1e-3),
                 weight_decay: float = 0.0, relative_step: bool = False) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, decay_rate=decay_rate, clip_threshold=clip_threshold,
                        weight_decay=weight_decay, relative_step=relative_step)
        super().__init__(params, defaults)

    def _init_state(self, state, group, p, grad):
        state["step"] = torch.tensor(0.0)
        if grad.dim() <= 1:
            state["row"] = torch.zeros_like(grad, dtype=p.dtype)
            state["col"] = None
        else:
            state["row"] = torch.zeros(grad.shape[0], dtype=p.dtype, device=grad.device)
            state["col"] = torch.zeros(grad.shape[1], dtype=p.dtype, device=grad.device)

    @torch.no_grad()
    def step(self, closure: Callable = None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if "step" not in state:
                    self._init_state(state, group, p, grad)
                state["step"] += 1
                beta1, beta2 = group["betas"]
                eps1, eps2 = group["eps"]
                _adafactor(p, grad, state["step"], state["row"], state["col"], group["lr"], beta1, beta2,
                           group["decay_rate"], group["clip_threshold"], eps1, eps2, group["weight_decay"],
                           group["relative_step"])
        return loss


def _rms(x: Tensor) -> Tensor:
    return x.square().mean().sqrt()


def _adafactor(p, grad, step, r, c, lr, beta1, beta2, decay_rate, clip_threshold, eps1, eps2, weight_decay,
               relative_step):
    """Forgather ``_adafactor`` (bf16 stochastic rounding off, as in the reference configs)."""
    if relative_step:
        lr = max(eps2, _rms(p)) * lr
    if weight_decay > 0.0:
        p.add_(p, alpha=(-lr * weight_decay))
    grad32 = grad.float()
    update = grad32**2 + eps1
    beta2t = (1.0 - step**decay_rate).clamp(max=beta2)
    r32 = r.float()
    if c is None:
        r32.lerp_(update, 1.0 - beta2t)
        update = grad32 / r32.sqrt()
    else:
        c32 = c.float()
        r32.lerp_(update.sum(dim=-1), 1.0 - beta2t)
        c32.lerp_(update.sum(dim=-2), 1.0 - beta2t)
        update = grad32 * torch.outer(torch.rsqrt(r32 / r32.sum()), torch.rsqrt(c32))
        if c32.dtype != c.dtype:
            c.copy_(c32)
    if r32.dtype != r.dtype:
        r.copy_(r32)
    update /= (_rms(update) / clip_threshold).clamp_(min=1.0)
    if p.dtype == update.dtype:
        p.add_(update, alpha=-lr)
    else:
        update = p.float() - lr * update
        p.copy_(update)


# -- Lion -----------------------------------------------------------------------------------
class Lion(Optimizer):
    """lion-pytorch (Chen et al. 2023): one momentum buffer, ``sign`` update."""

    def __init__(self, params: Iterable, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable = None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad, state = p.grad, self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1.0 - lr * wd)
                update = exp_avg.clone().lerp_(grad, 1.0 - beta1).sign_()
                p.add_(update, alpha=-lr)
                del update
                exp_avg.lerp_(grad, 1.0 - beta2)
        return loss


# -- 8-bit AdamW (memory of bitsandbytes' blockwise optimizer) -----------------------------
class AdamW8bit(Optimizer):
    """bitsandbytes ``AdamW8bit`` state layout (see the module docstring)."""

    BLOCK = BNB_BLOCK
    MIN_8BIT_SIZE = BNB_MIN_8BIT_SIZE

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _init_state(self, p: Tensor, state: dict) -> None:
        state["step"] = 0
        n = p.numel()
        if n >= self.MIN_8BIT_SIZE:
            blocks = -(-n // self.BLOCK)
            state["state1"] = torch.zeros_like(p, dtype=torch.uint8)
            state["state2"] = torch.zeros_like(p, dtype=torch.uint8)
            state["absmax1"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)
            state["absmax2"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)
        else:
            state["state1"] = torch.zeros_like(p, dtype=torch.float32)
            state["state2"] = torch.zeros_like(p, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure: Callable = None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    self._init_state(p, state)
                state["step"] += 1
                # one fused in-place kernel in bitsandbytes: no temporaries
                p.mul_(1.0 - lr * wd)
                p.add_(p.grad, alpha=-lr)
        return loss


# -- paged AdamW (memory of bitsandbytes' PagedAdamW / PagedAdamW8bit) ----------------------
def _unified(shape, dtype, device) -> Tensor:
    """A buffer outside PyTorch's caching allocator: bitsandbytes ``F.get_paged`` takes it from
    ``cudaMallocManaged``, which ``max_memory_allocated`` never sees. Stand-in: allocated with the
    tracer's dispatch mode switched off, so the device count leaves it out (bitsandbytes cannot run
    on meta)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return torch.zeros(shape, dtype=dtype, device=device)


class PagedAdamW8bit(AdamW8bit):
    """bitsandbytes ``PagedAdamW8bit`` (``paged=True``): ``Optimizer8bit.get_state_buffer`` pages a
    state buffer when the parameter has at least 1e5 elements; absmax stays an ordinary tensor."""

    BITS = 8

    def _init_state(self, p: Tensor, state: dict) -> None:
        state["step"] = 0
        n = p.numel()
        eight = self.BITS == 8 and n >= self.MIN_8BIT_SIZE
        dtype = torch.uint8 if eight else torch.float32
        for k in ("state1", "state2"):
            state[k] = (_unified(p.shape, dtype, p.device) if n >= BNB_PAGED_MIN_NUMEL
                        else torch.zeros_like(p, dtype=dtype))
        if eight:
            blocks = -(-n // self.BLOCK)
            state["absmax1"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)
            state["absmax2"] = torch.zeros((blocks,), dtype=torch.float32, device=p.device)


class PagedAdamW(PagedAdamW8bit):
    """bitsandbytes ``PagedAdamW`` (``optim_bits=32``): fp32 moments, paged as above."""

    BITS = 32


# -- torchao low-bit AdamW (the real classes) -------------------------------------------------
class _TorchaoOnMeta:
    """Runs a torchao optimizer's step with ``torch.compile``'s backend ``aot_eager`` off CUDA (see the
    module docstring); on CUDA the optimizer is returned unwrapped (Inductor)."""

    def __init__(self, opt: Optimizer) -> None:
        self.opt = opt
        self.state = opt.state
        self.param_groups = opt.param_groups

    def step(self, closure: Optional[Callable] = None):
        real = torch.compile

        def aot_eager(fn, **kw):
            kw.pop("backend", None)
            return real(fn, backend="aot_eager", **kw)
        torch.compile = aot_eager  # type: ignore[assignment]
        try:
            return self.opt.step(closure)
        finally:
            torch.compile = real

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none)


def _torchao(cls_name: str) -> Callable[[list[Tensor], str, bool], Optimizer]:
    def build(ps: list[Tensor], impl: str, master: bool) -> Optimizer:
        import torchao.optim

        opt = getattr(torchao.optim, cls_name)(ps, lr=1e-4, weight_decay=0.01)
        if any(p.device.type == "cuda" for p in ps):
            return opt
        return _TorchaoOnMeta(opt)  # type: ignore[return-value]
    return build


# -- GaLore (the real galore_torch) ---------------------------------------------------------
def galore(ps: list[Tensor], names: Optional[list[str]], rank: int) -> Optimizer:
    """galore_torch ``GaLoreAdamW`` over ``ps`` (see the module docstring); ``names`` pick the targets
    (:func:`memcalc.core.optimizers.galore_target`), every matrix when None."""
    from galore_torch import GaLoreAdamW  # type: ignore[import-untyped]

    named = list(zip(names or [f"layers.{i}" for i in range(len(ps))], ps, strict=True))
    targets = [p for n, p in named if galore_target(n, tuple(p.shape))]
    ids = {id(p) for p in targets}
    rest = [p for p in ps if id(p) not in ids]
    groups: list[dict] = [{"params": rest}] if rest else []
    if targets:
        groups.append({"params": targets, "rank": rank, "update_proj_gap": 1, "scale": 0.25, "proj_type": "std"})
    return GaLoreAdamW(groups, lr=1e-4, weight_decay=0.0, no_deprecation_warning=True)


# -- master weights ------------------------------------------------------------------------
class MasterWeights:
    """fp32 masters beside 16-bit parameters (see the module docstring). Quacks like an
    Optimizer for what the runner needs: ``step``, ``zero_grad``, ``state``, ``step_param``."""

    def __init__(self, params: list[Tensor], make_inner: Callable[[list[Tensor]], Optimizer]) -> None:
        self.params = params
        self.masters = {p: p.detach().float().requires_grad_(True) for p in params}
        self.inner = make_inner(list(self.masters.values()))

    @property
    def state(self) -> dict:
        st = {m: dict(self.inner.state.get(m, {}), master=m) for m in self.masters.values()}
        return st

    @torch.no_grad()
    def step_param(self, p: Tensor) -> None:
        m = self.masters[p]
        m.grad = p.grad.float()
        self.inner.step()
        m.grad = None
        p.copy_(m)

    def step(self) -> None:
        for p in self.params:
            if p.grad is not None:
                self.step_param(p)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


@contextlib.contextmanager
def allow_fused_on(device_type: str) -> Iterator[None]:
    """Let ``torch.optim``'s fused kernels run on ``meta`` (its device check is by name only)."""
    if device_type != "meta":
        yield
        return
    import torch.optim.optimizer as base

    saved = base._get_fused_kernels_supported_devices
    base._get_fused_kernels_supported_devices = lambda: saved() + ["meta"]
    try:
        yield
    finally:
        base._get_fused_kernels_supported_devices = saved


def _impl_kw(impl: str, force_fused: bool) -> dict:
    return {"fused": True} if (impl == "fused" or force_fused) else {"foreach": impl == "foreach"}


#: registry name (memcalc.core.optimizers.OPTIMIZERS) -> builder(params, implementation, fused master step)
BUILDERS: dict[str, Callable[[list[Tensor], str, bool], Optimizer]] = {
    "adamw": lambda ps, impl, m: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01, **_impl_kw(impl, m)),
    "adam": lambda ps, impl, m: torch.optim.Adam(ps, lr=1e-4, **_impl_kw(impl, m)),
    "sgd": lambda ps, impl, m: torch.optim.SGD(ps, lr=1e-3, **_impl_kw(impl, m)),
    "sgd-momentum": lambda ps, impl, m: torch.optim.SGD(ps, lr=1e-3, momentum=0.9, **_impl_kw(impl, m)),
    "adafactor": lambda ps, impl, m: Adafactor(ps, lr=2e-4, weight_decay=0.01),
    "lion": lambda ps, impl, m: Lion(ps),
    "adamw-8bit": lambda ps, impl, m: AdamW8bit(ps),
    "paged-adamw": lambda ps, impl, m: PagedAdamW(ps),
    "paged-adamw-8bit": lambda ps, impl, m: PagedAdamW8bit(ps),
    "adamw-4bit-torchao": _torchao("AdamW4bit"),
    "adamw-8bit-torchao": _torchao("AdamW8bit"),
    "galore-adamw": lambda ps, impl, m: galore(ps, None, GALORE_RANK),
    "adamw-fp8-torchao": _torchao("AdamWFp8"),
}


def build_optimizer(params: list[Tensor], tr: TrainingSpec, names: Optional[list[str]] = None):
    """The optimizer over the trainable ``params`` (an Optimizer, or MasterWeights); ``names``: theirs, for
    an optimizer that treats parameters by name (GaLore's targets)."""
    rec = get_optimizer(tr.optimizer)
    if rec.step == "galore":
        return galore(params, names, tr.galore_rank)
    builder = BUILDERS.get(rec.name)
    if builder is None:
        raise UserError(f"validate has no builder for optimizer {rec.name!r}; it builds: {', '.join(BUILDERS)}")
    impl = rec.effective_impl(tr.optimizer_impl)

    if tr.master_weights:
        return MasterWeights(params, lambda ms: builder(ms, impl, True))
    return builder(params, impl, False)


def optimizer_tensors(opt) -> list[Tensor]:
    """Every tensor the optimizer holds (state, step counters, master copies); a tensor subclass
    (torchao's quantized state) as the plain tensors it holds (``__tensor_flatten__``)."""
    out: list[Tensor] = []
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, Tensor):
                out += plain_tensors(v)
    return out


def plain_tensors(t: Tensor) -> list[Tensor]:
    """``t``, or the inner tensors of a wrapper subclass (torchao ``OptimState4bit``: codes, scale, qmap)."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None or type(t) is torch.nn.Parameter:
        return [t]
    names, _ = flatten()
    return [x for n in names for x in plain_tensors(getattr(t, n))]
