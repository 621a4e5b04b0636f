"""GaLore AdamW's optimizer step on the simulator (``--optimizer galore-adamw``).

galore_torch 1.0 (the ``galore-torch`` package transformers' ``optim="galore_adamw"`` builds:
transformers 5.24 trainer_optimizer.py ``_get_galore_optimizer`` / ``_setup_low_rank_optimizer``, rank 128,
update_proj_gap 200, scale 0.25, proj_type "std"; the targeted linears in their own param group after
every other parameter). ``galore_torch/adamw.py`` ``AdamW.step`` runs a Python loop over the parameters;
for a targeted weight W (m x n, r = min(rank, min(m, n))) ``galore_projector.py``
``GaLoreProjector.project`` recomputes the projection every ``update_proj_gap`` steps (the first
included) by ``get_orthogonal_matrix``: ``matrix = W.grad.float()`` (16-bit weights), ``torch.linalg.svd
(full_matrices=False)`` (U m x k, S k, Vh k x n in fp32), then ``B = Vh[:r]`` cast back (m >= n, "right"),
or ``A = U[:, :r]`` cast back (m < n, "left"), each beside the fp32 ``U[:, :r] @ diag(S[:r])`` /
``diag(S[:r]) @ Vh[:r]`` it also computes; an fp32 weight keeps the view, so the whole U or Vh stays
as the projector. The projected gradient (max(m, n) x r) is what the moments (``zeros_like``) follow;
``denom`` and ``norm_grad`` are low-rank, ``project_back`` makes the full m x n update and its ``* scale``
copy. ``grad``, ``denom`` and ``norm_grad`` are loop locals: each lives until the next parameter's
iteration rebinds it (the full-size ``norm_grad`` of one weight is alive through the next one's SVD).

The step simulated is the one that recomputes the projection (the first and every
``update_proj_gap``-th step): the peak one. Not seen on meta and not modelled: the workspace cuSOLVER's
SVD allocates inside ``torch.linalg.svd`` on CUDA.
"""

from __future__ import annotations

from typing import Any, Optional

from memcalc.core.optimizers import galore_shapes
from memcalc.engine.sim import T

#: the category of memcalc.engine.optimizers (which imports this module) for a step's temporaries
TMP = "temporaries"
WHAT = "optimizer-step temporaries"
#: ``opt`` below is a memcalc.engine.optimizers.OptimizerSim (its sim, on_gpu, galore, state, create_state)
OptimizerSim = Any


def galore_state(m: int, n: int, rank: int, itemsize: int) -> list[int]:
    """A targeted weight's state: two low-rank moments and the projector (see the module docstring)."""
    low, proj = galore_shapes(m, n, rank, itemsize)
    return [low, low, proj]


class _Carry:
    """The loop locals that outlive a parameter's iteration (``grad``, ``denom``, ``norm_grad``)."""

    def __init__(self, opt: OptimizerSim) -> None:
        self.opt = opt
        self.live: dict[str, Optional[T]] = {"grad": None, "denom": None, "norm": None}

    def put(self, key: str, t: Optional[T]) -> None:
        old = self.live[key]
        self.live[key] = t
        if old is not None:
            self.opt.sim.unref(old)


def galore_step(opt: OptimizerSim, rank: int, params: list) -> None:
    """``optimizer.step()`` of GaLore AdamW over ``params``: the untargeted ones (AdamW in galore_torch's own
    loop, their param group first), then the targeted weights, in order. One parameter (a step in its
    post-accumulate-grad hook: transformers' ``galore_adamw_layerwise``, one optimizer per parameter) frees
    its loop locals when its step returns."""
    if not opt.on_gpu:
        return
    sim = opt.sim
    carry = _Carry(opt)
    gal = opt.galore or {}
    order = [p for p in params if p.name not in gal] + [p for p in params if p.name in gal]
    for p in order:
        if p.grad is None:
            continue
        carry.put("grad", None)  # grad = p.grad: the previous projected gradient dies
        s = p.weight.itemsize_bits // 8
        if p.name not in gal:
            opt.create_state(p)
            carry.put("denom", sim.alloc(s * p.numel, TMP, WHAT))  # exp_avg_sq.sqrt()
            carry.put("norm", sim.alloc(s * p.numel, TMP, WHAT))  # exp_avg / denom
            continue
        m, n = gal[p.name]
        low_b, _ = galore_shapes(m, n, rank, s)
        opt.create_state(p)
        _svd(opt, m, n, rank, s)
        carry.put("grad", sim.alloc(low_b, TMP, WHAT))  # project: the low-rank gradient
        carry.put("denom", sim.alloc(low_b, TMP, WHAT))
        carry.put("norm", sim.alloc(low_b, TMP, WHAT))
        full = sim.alloc(s * m * n, TMP, WHAT)  # project_back: ortho @ low / low @ ortho
        carry.put("norm", sim.alloc(s * m * n, TMP, WHAT))  # ... * self.scale
        sim.unref(full)
    for key in ("grad", "denom", "norm"):
        carry.put(key, None)


def _svd(opt: OptimizerSim, m: int, n: int, rank: int, s: int) -> None:
    """``get_orthogonal_matrix`` for one weight, then ``self.ortho_matrix = new``: the old projector dies as
    the new one takes its place. The state keeps one block for the projector (allocated before the step, so
    that a step frees only what it allocates); the new projector is a temporary of the same size that stands
    for it until the assignment, and freed there."""
    sim = opt.sim
    k = min(m, n)
    r = min(rank, k)
    right = m >= n
    tmp = [] if s == 4 else [sim.alloc(4 * m * n, TMP, WHAT)]  # matrix = grad.float()
    tmp += [sim.alloc(4 * m * k, TMP, WHAT), sim.alloc(4 * k, TMP, WHAT), sim.alloc(4 * k * n, TMP, WHAT)]  # U S Vh
    d = sim.alloc(4 * r * r, TMP, WHAT)  # torch.diag(s[:r])
    tmp.append(sim.alloc(4 * (m * r if right else r * n), TMP, WHAT))  # U[:, :r] @ diag / diag @ Vh[:r]
    sim.unref(d)
    if s != 4:  # B / A .type(original_type); an fp32 weight's projector is the view of Vh / U itself
        tmp.append(sim.alloc(s * r * k, TMP, WHAT))
    for t in tmp:
        sim.unref(t)
