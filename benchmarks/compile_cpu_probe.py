"""Measure a real torch.compile (inductor, CPU) training step of a Deep-One-like model and
print it beside memcalc's compiled timeline. Evidence for memcalc.compiled without a GPU.

    python benchmarks/compile_cpu_probe.py --layers 4 --budget 0.05

What it measures: the bytes the compiled forward saves for backward (saved_tensors_hooks
see AOTAutograd's ctx.save_for_backward) and the step's allocated peak above the weights
(the profiler's CPU memory events). The model follows Forgather's Deep One (ALiBi mask,
post-norm RMSNorm, ReLU-gated FFN) with frozen slopes (the CPU SDPA kernel takes no mask
gradient); on CPU, SDPA with a mask runs the math path, so memcalc is run with the math
attention kernel. Takes a few minutes per budget on two cores (compile ~1 min, 3 steps).
Seen with PyTorch 2.8 CPU at 4 layers, batch 4 x 768 (MiB): saved for backward at budget
1.0 / 0.6 / 0.05 measured 2128 / 1226 / 96, memcalc 2139 / 1226 / 96; peak above the weights
measured 2459 / 2084 / 2175, memcalc 2512 / 1908 / 1817.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch._functorch.config as fconfig
import torch.nn as nn
import torch.nn.functional as F

D, H, FF, V = 2048, 16, 5400, 8000


class Layer(nn.Module):
    def __init__(self, n_layers: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.slopes = nn.Parameter(1.0 / torch.logspace(0, 7, H, base=2), requires_grad=False)
        self.up, self.gate = nn.Linear(D, FF, bias=False), nn.Linear(D, FF, bias=False)
        self.down = nn.Linear(FF, D, bias=False)
        self.n1, self.n2 = nn.RMSNorm(D, eps=1e-6), nn.RMSNorm(D, eps=1e-6)
        self.alpha = (2 * n_layers) ** 0.25

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, H, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        pos = torch.arange(t, dtype=q.dtype)
        bias = (pos[None, :] - pos[:, None]) * self.slopes.view(-1, 1, 1)
        bias = bias.masked_fill(torch.tril(torch.ones(t, t, dtype=torch.bool)).logical_not(), float("-inf"))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(b, t, D)
        x = self.n1(x * self.alpha + self.o(a))
        return self.n2(x * self.alpha + self.down(self.up(x) * F.relu(self.gate(x))))


class Model(nn.Module):
    def __init__(self, n_layers: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.layers = nn.ModuleList([Layer(n_layers) for _ in range(n_layers)])
        self.norm, self.head = nn.RMSNorm(D, eps=1e-6), nn.Linear(D, V, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def measure(layers: int, budget: float, batch: int, seq: int) -> tuple[int, int]:
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    m = Model(layers)
    fconfig.activation_memory_budget = budget
    m.compile(backend="inductor", mode="default", dynamic=False)
    ids = torch.randint(0, V, (batch, seq))
    saved: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        saved[st.data_ptr()] = st.nbytes()
        return t

    def step(count: bool = False) -> None:
        if count:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                logits = m(ids)
        else:
            logits = m(ids)
        loss = F.cross_entropy(logits[:, :-1].contiguous().view(-1, V), ids[:, 1:].reshape(-1))
        del logits  # as a trainer that keeps only the loss
        loss.backward()
        for p in m.parameters():
            p.grad = None

    step()
    step(count=True)
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    saved_bytes = sum(n for ptr, n in saved.items() if ptr not in params)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    events = json.load(open(path))["traceEvents"]
    peak = max(e["args"].get("Total Allocated", 0) for e in events if e.get("name") == "[memory]")
    return saved_bytes, peak


def predict(layers: int, budget: float, batch: int, seq: int) -> tuple[int, int]:
    from memcalc.compiled import compiled_plan
    from memcalc.configs import load_config
    from memcalc.estimate import estimate

    exp = load_config("memory_budget_60")
    exp = exp.model_copy(update={
        "model": exp.model.model_copy(update={"n_layers": layers}),
        "training": exp.training.model_copy(update={"memory_budget": budget, "batch": batch, "seq": seq}),
        "profile": exp.profile.model_copy(update={"attention": "math"}),
    })
    est = estimate(exp, timeline=False)
    # the probe runs no optimizer: compare the forward and backward phases, above the weights
    # (and Adafactor's few MiB of state)
    step = max(est.phases.get("forward", 0), est.phases.get("backward", 0))
    weights = exp.training.weight_dtype.nbytes(est.params)
    return compiled_plan(exp).saved_bytes, step - weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--budget", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=768)
    a = ap.parse_args()
    ms, mp = measure(a.layers, a.budget, a.batch, a.seq)
    ps, pp = predict(a.layers, a.budget, a.batch, a.seq)
    from memcalc.units import MiB as mib
    print(f"torch {torch.__version__}, {a.layers} layers, batch {a.batch} x {a.seq}, budget {a.budget}")
    print(f"saved for backward: measured {ms / mib:.1f} MiB, memcalc {ps / mib:.1f} MiB")
    print(f"peak above weights: measured {mp / mib:.1f} MiB, memcalc {pp / mib:.1f} MiB ({100 * (pp - mp) / mp:+.1f}%)")


if __name__ == "__main__":
    main()
