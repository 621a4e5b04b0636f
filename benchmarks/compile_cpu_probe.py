"""Measure a real torch.compile (inductor, CPU) training step of a Deep-One-like model and
print it beside memcalc's compiled timeline. Evidence for memcalc.compile.compiled without a GPU.

    python benchmarks/compile_cpu_probe.py --layers 6 --batch 4 --budget 0.05

What it measures: the bytes the compiled forward saves for backward (saved_tensors_hooks see
AOTAutograd's ctx.save_for_backward) and the step's allocated peak above the weights (the
profiler's CPU memory events, counted from the step's start, so the weights are excluded).
The model follows Forgather's Deep One (trainable ALiBi slopes and the per-layer mask,
post-norm RMSNorm, ReLU-gated FFN). Attention calls ``aten._scaled_dot_product_efficient_attention``
as CUDA does, with CPU kernels registered here that allocate what the CUDA kernels return
(out, logsumexp; dq/dk/dv, a (B,H,T,T) bias gradient, delta) and compute per (batch, head) in
T x T scratch, so inductor partitions, schedules and reuses buffers as it would on CUDA.
Two CPU differences remain: the bias is passed as (1,H,T,T) (on CPU inductor copies an
expanded bias in full; CUDA keeps the batch stride 0), and the kernels' T x T scratch (a few
MiB). No optimizer runs: memcalc's forward and backward phases are compared.

Seen with PyTorch 2.8 CPU (MiB), peak above the weights, measured / memcalc: 6 layers, batch
4 x 768, fp32, budgets 1.0 / 0.6 / 0.05: 3006 / 3006, 2476 / 2473, 2101 / 2128 (saved for
backward 2536 / 1479 / 120, equal); 4 layers, batch 2, --bf16, budgets 1.0 / 0.6: 647 / 644,
625 / 603; bf16_budget_60 itself (32 layers, batch 4, --bf16, budget 0.6): 5206 / 5166,
saved 4018 / 4018, so weights + peak = 8.1 GiB against the published 6.709; memory_budget_05
itself (32 layers, fp32, budget 0.05): 7543 / 7526, saved 648 / 648, so weights + peak =
13.44 GiB against the published (CUDA) 13.561 GiB (-0.9%); memory_budget_60 itself: 9656 /
10281 (+6.5%, the residual stream: see tests/unit/test_compile.py), 15.51 GiB against the published
15.636. A few minutes per small run on
two cores (compile about a minute, three steps); the 32-layer runs take 10 to 20 minutes
and up to 14 GiB of memory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile

import torch
import torch._functorch.config as fconfig
import torch.nn as nn
import torch.nn.functional as F

aten = torch.ops.aten
V = 8000
_lib = torch.library.Library("aten", "IMPL")


def _efficient_forward(q, k, v, bias, compute_lse, dropout_p=0.0, is_causal=False, scale=None):
    B, H, T, Dh = q.shape
    s = scale if scale is not None else 1 / math.sqrt(Dh)
    out = torch.empty(B, T, H, Dh, dtype=q.dtype).transpose(1, 2)  # the CUDA kernel's layout
    lse = torch.zeros((B, H, math.ceil(T / 32) * 32 if compute_lse else 0), dtype=torch.float32)
    for b in range(B):
        for h in range(H):
            att = (q[b, h].float() @ k[b, h].float().T) * s  # per-head scratch in fp32
            if bias is not None:
                att += bias[b if bias.size(0) > 1 else 0, h].float()
            if compute_lse:
                lse[b, h, :T] = torch.logsumexp(att, -1)
            out[b, h] = torch.softmax(att, -1) @ v[b, h].float()
            del att
    return out, lse, torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64)


def _efficient_backward(g, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_input_mask, is_causal=False, scale=None):
    B, H, T, Dh = q.shape
    s = scale if scale is not None else 1 / math.sqrt(Dh)

    def bthd():
        return torch.empty(B, T, H, Dh, dtype=q.dtype).transpose(1, 2)

    dq, dk, dv = bthd(), bthd(), bthd()
    db = torch.empty(bias.shape, dtype=bias.dtype) if grad_input_mask[3] else None
    # CUDA returns the bias gradient with the broadcast (B,H,T,T) shape: hold that much
    wide = torch.empty((B,) + tuple(bias.shape[1:]), dtype=bias.dtype) if db is not None else None
    delta = torch.empty((B, H, T), dtype=torch.float32)  # the CUDA kernel's scratch
    for b in range(B):
        for h in range(H):
            qf, kf, vf, gf = q[b, h].float(), k[b, h].float(), v[b, h].float(), g[b, h].float()
            delta[b, h] = (gf * out[b, h].float()).sum(-1)
            att = (qf @ kf.T) * s + bias[b if bias.size(0) > 1 else 0, h].float()
            p = torch.exp(att - lse[b, h, :T, None])
            del att
            dv[b, h] = p.T @ gf
            ds = p * (gf @ vf.T - delta[b, h, :, None])
            del p
            dq[b, h] = (ds @ kf) * s
            dk[b, h] = (ds.T @ qf) * s
            if db is not None:
                if b == 0:
                    db[0, h] = ds
                else:
                    db[0, h] += ds
            del ds
    del delta, wide
    return dq, dk, dv, db


_lib.impl("_scaled_dot_product_efficient_attention", _efficient_forward, "CPU")
_lib.impl("_scaled_dot_product_efficient_attention_backward", _efficient_backward, "CPU")


class Layer(nn.Module):
    def __init__(self, n_layers: int, d: int, heads: int, ff: int) -> None:
        super().__init__()
        self.d, self.heads = d, heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.slopes = nn.Parameter(1.0 / torch.logspace(0, 7, heads, base=2))
        self.up, self.gate = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
        self.down = nn.Linear(ff, d, bias=False)
        self.n1, self.n2 = nn.RMSNorm(d, eps=1e-6), nn.RMSNorm(d, eps=1e-6)
        self.alpha = (2 * n_layers) ** 0.25

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        pos = torch.arange(t, dtype=q.dtype)
        bias = (pos[None, :] - pos[:, None]) * self.slopes.view(-1, 1, 1)
        bias = bias.masked_fill(torch.tril(torch.ones(t, t, dtype=torch.bool)).logical_not(), float("-inf"))
        a = aten._scaled_dot_product_efficient_attention(
            q, k, v, bias.unsqueeze(0), True, 0.0, False, scale=1 / math.sqrt(self.d // self.heads))[0]
        a = a.transpose(1, 2).reshape(b, t, self.d)
        x = self.n1(x * self.alpha + self.o(a))
        return self.n2(x * self.alpha + self.down(self.up(x) * F.relu(self.gate(x))))


class Model(nn.Module):
    def __init__(self, n_layers: int, d: int, heads: int, ff: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.layers = nn.ModuleList([Layer(n_layers, d, heads, ff) for _ in range(n_layers)])
        self.norm, self.head = nn.RMSNorm(d, eps=1e-6), nn.Linear(d, V, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def measure(a: argparse.Namespace) -> tuple[int, int]:
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    m = Model(a.layers, a.d_model, a.heads, a.d_ff)
    if a.bf16:
        m = m.to(torch.bfloat16)  # Forgather's module_to_dtype: pure bf16
    fconfig.activation_memory_budget = a.budget
    m.compile(backend="inductor", mode="default", dynamic=False)
    ids = torch.randint(0, V, (a.batch, a.seq))
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
    mem = [e for e in events if e.get("name") == "[memory]"]
    peak = max(e["args"].get("Total Allocated", 0) for e in mem)
    if a.trace:  # memory events (time, total, bytes, address) and ops (time, duration, name)
        ops = [(e["ts"], e.get("dur", 0), e["name"]) for e in events if e.get("ph") == "X"]
        rows = [(e["ts"], e["args"].get("Total Allocated", 0), e["args"].get("Bytes", 0), e["args"].get("Addr", 0))
                for e in mem]
        with open(a.trace, "w") as f:
            json.dump({"mem": rows, "ops": ops}, f)
    return saved_bytes, peak


def predict(a: argparse.Namespace) -> tuple[int, int]:
    from memcalc.compile.compiled import compiled_plan
    from memcalc.inputs.configs import load_config
    from memcalc.estimate.peak import estimate

    exp = load_config("memory_budget_60")
    exp = exp.model_copy(update={
        "model": exp.model.model_copy(update={
            "n_layers": a.layers, "d_model": a.d_model, "n_heads": a.heads, "d_ff": a.d_ff,
            "residual_scale": (2 * a.layers) ** 0.25}),
        "training": exp.training.model_copy(update={
            "memory_budget": a.budget, "batch": a.batch, "seq": a.seq, "precision": "bf16" if a.bf16 else "fp32"}),
    })
    est = estimate(exp, timeline=False)
    # the probe runs no optimizer: compare the forward and backward phases, above the weights
    # (and Adafactor's few MiB of state)
    step = max(est.phases.get("forward", 0), est.phases.get("backward", 0))
    weights = exp.training.weight_dtype.nbytes(est.params)
    return compiled_plan(exp).saved_bytes, step - weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--budget", type=float, default=1.0)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=768)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--d-ff", type=int, default=5400)
    ap.add_argument("--bf16", action="store_true", help="the model in bfloat16 (bf16_budget_60)")
    ap.add_argument("--trace", help="also write the step's memory events and ops to this JSON file")
    a = ap.parse_args()
    ms, mp = measure(a)
    ps, pp = predict(a)
    from memcalc.core.units import MiB as mib
    print(f"torch {torch.__version__}, {a.layers} layers, batch {a.batch} x {a.seq}, budget {a.budget}"
          f"{', bf16' if a.bf16 else ''}")
    print(f"saved for backward: measured {ms / mib:.1f} MiB, memcalc {ps / mib:.1f} MiB")
    print(f"peak above weights: measured {mp / mib:.1f} MiB, memcalc {pp / mib:.1f} MiB ({100 * (pp - mp) / mp:+.1f}%)")


if __name__ == "__main__":
    main()
