"""The decoder's forward pass, op by op, as the model code runs it.

Mirrors the module code of the families we model: Hugging Face Llama/Mistral/
Qwen2 (pre-norm, SwiGLU, RoPE, ``repeat_kv`` for GQA), GPT-2 (learned
positions, LayerNorm, GELU), phi (parallel block, partial rotary) and
Forgather's Deep One (DeepNet post-norm, per-layer ALiBi mask, ReLU-gated FFN,
shifted-copy loss). Python references are dropped where the Python variable
dies, so the simulator frees what real code frees.

Checkpointing follows ``torch.utils.checkpoint(use_reentrant=False)``: the
region's first forward keeps nothing but its input; at the region's first
backward node the whole region is recomputed (all its saved tensors alive at
once) and then back-propagated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from memcalc.core.dtypes import DType
from memcalc.engine.ops import Ops
from memcalc.engine.params import ParamTensor, param_inventory
from memcalc.engine.sim import Node, Param, Sim, T
from memcalc.engine.sharding import shard
from memcalc.core.spec import ExperimentSpec, ModelSpec, sqrt_segments


def quantized_bytes(numel: int, block: int, double_quant: bool) -> int:
    """NF4 storage of a QLoRA base weight: packed 4-bit values (numel/2 bytes) plus absmax
    constants: fp32 per block, or with double quantisation uint8 per block plus an fp32
    scale and offset per 256 blocks (Dettmers et al. 2023, bitsandbytes ``QuantState``)."""
    blocks = -(-numel // block)
    consts = blocks + 8 * -(-blocks // 256) if double_quant else 4 * blocks
    return DType.nf4.nbytes(numel) + consts


@dataclass
class Model:
    """Parameters (as simulator blocks) grouped for the forward code."""

    spec: ModelSpec
    params: dict[str, Param]
    order: list[Param]
    compute: DType
    layer_gather_bytes: int = 0  # ZeRO-3: one layer's weights all-gathered whole (0 = not sharded)
    gathered: dict = None  # layer index -> gathered buffer (ZeRO-3)

    def __post_init__(self) -> None:
        self.gathered = {}


def make_params(sim: Sim, exp: ExperimentSpec) -> Model:
    """Allocate every parameter at the precision policy's weight dtype (weights exist before the step)."""
    tr = exp.training
    lora = tr.lora
    wdt = tr.weight_dtype
    n = tr.gpus
    zero3 = tr.zero >= 3 and n > 1
    params: dict[str, Param] = {}
    order: list[Param] = []
    gather = 0
    for pt in param_inventory(exp.model, lora):
        quant = lora is not None and lora.qlora and pt.quantizable
        if quant:
            full = quantized_bytes(pt.numel, lora.quant_block, lora.double_quant)
            cat = "frozen base weights (NF4)"
        else:
            full = wdt.nbytes(pt.numel)
            cat = "weights" if pt.trainable or lora is None else "frozen base weights"
        nbytes = full
        if zero3 and pt.layer is not None:
            nbytes = shard(full, n)
            cat += f" (ZeRO-3 shard 1/{n})"
            if pt.layer == 0:
                gather += full
        w = sim.alloc(nbytes, "weights", cat, name=pt.name)
        w.numel, w.itemsize_bits = pt.numel, (4 if quant else wdt.bits)
        p = Param(pt.name, w, pt.trainable, wdt.nbytes(pt.numel), pt.layer, pt.numel)
        if tr.zero >= 2 and n > 1:
            p.grad_keep_bytes = shard(p.grad_bytes, n)
        params[pt.name] = p
        order.append(p)
    return Model(exp.model, params, order, tr.compute_dtype, gather)


def _chain(first: Optional[Callable[[Sim, Node], None]], then: Optional[Callable[[Sim, Node], None]]) -> Callable[[Sim, Node], None]:
    """Two node hooks, one after the other (either may be None)."""
    def both(s: Sim, nd: Node) -> None:
        for f in (first, then):
            if f is not None:
                f(s, nd)
    return both


class Forward:
    """Runs one forward pass on the simulator; returns the loss tensor."""

    def __init__(self, sim: Sim, exp: ExperimentSpec, model: Model) -> None:
        self.sim = sim
        self.exp = exp
        self.m = exp.model
        self.tr = exp.training
        self.model = model
        self.ops = Ops(sim, exp.profile, tr_autocast(exp))
        self.B = self.tr.batch
        self.T = self.tr.seq
        self.rows = self.B * self.T
        self.lora = self.tr.lora
        self.rope_tables: Optional[T] = None
        self.ckpt_nodes: list[Node] = []
        self.compiled_nodes: list[Node] = []
        # called with the nodes each mlp() call creates (the compiled backward's reuse pool)
        self.mlp_nodes_sink: Optional[Callable[[list[Node]], None]] = None
        self.mlp_pool: Optional[T] = None  # MLP buffers a compiled layer leaves for the next
        self.compiled_tangent: Optional[T] = None  # d logits, held by the compiled backward's caller

    # -- helpers ----------------------------------------------------------------------
    def p(self, name: str) -> Param:
        return self.model.params[name]

    def maybe(self, name: str) -> Optional[Param]:
        return self.model.params.get(name)

    def proj(self, x: T, layer: int, name: str, short: str, d_out: int) -> T:
        """A projection, with its LoRA adapter when targeted: y = base(x) + B(A(drop(x))) * s."""
        o = self.ops
        base = f"layers.{layer}.{name}"
        w = self.p(base + ".weight")
        qt = 0
        if self.lora is not None and self.lora.qlora and w.weight.itemsize_bits == 4:
            qt = self.model.compute.nbytes(w.numel)
        y = o.linear(x, self.rows, w, self.maybe(base + ".bias"), d_out, quant_transient_bytes=qt)
        a_p = self.maybe(base + ".lora_A")
        if a_p is None:
            return y
        xd = o.dropout(x, self.lora.dropout)
        a = o.linear(xd, self.rows, a_p, None, self.lora.rank)
        o.drop(xd)
        b = o.linear(a, self.rows, self.p(base + ".lora_B"), None, d_out)
        o.drop(a)
        bs = o.scale(b, self.lora.alpha / self.lora.rank + 1e-12)
        o.drop(b)
        out = o.add(y, bs)
        o.drop(y, bs)
        return out

    def norm(self, x: T, name: str) -> T:
        o = self.ops
        if self.m.norm == "rmsnorm":
            return o.rmsnorm(x, self.rows, self.m.d_model, self.p(name + ".weight"))
        return o.layernorm(x, self.rows, self.m.d_model, self.p(name + ".weight"), self.maybe(name + ".bias"))

    # -- blocks -----------------------------------------------------------------------
    def attention(self, h: T, i: int) -> T:
        o, m = self.ops, self.m
        q = self.proj(h, i, "attn.q_proj", "q", m.q_dim)
        k = self.proj(h, i, "attn.k_proj", "k", m.kv_dim)
        v = self.proj(h, i, "attn.v_proj", "v", m.kv_dim)
        if self.tr.checkpoint == "selective":
            out = self.checkpoint(lambda: [q, k, v], lambda: self.core_attention(q, k, v, i), f"layer {i} attention")
        else:
            out = self.core_attention(q, k, v, i)
        o.drop(q, k, v)
        y = self.proj(out, i, "attn.o_proj", "o", m.d_model)
        o.drop(out)
        return y

    def core_attention(self, q: T, k: T, v: T, i: int) -> T:
        o, m = self.ops, self.m
        H, D = m.n_heads, m.dim_head
        bias, bias_bytes = None, 0
        if m.positions == "alibi":
            slopes = self.maybe(f"layers.{i}.attn.alibi_slopes")
            if slopes is not None:
                bias, bias_bytes = o.alibi_mask(H, self.T, slopes)
                bias_bytes = bias_bytes * self.B
        kernel = o.attention_kernel(bias is not None, q)
        if m.positions == "rope":
            q2, k2 = o.rope(q, m.rotary_pct), o.rope(k, m.rotary_pct)
        else:
            q2, k2 = o.ref_(q), o.ref_(k)
        n_rep = m.n_heads // m.kv_heads
        k3, v3 = o.repeat_kv(k2, n_rep), o.repeat_kv(v, n_rep)
        o.drop(k2)
        out = o.sdpa(q2, k3, v3, self.B, H, self.T, D, bias, bias_bytes, m.attn_dropout, kernel)
        o.drop(q2, k3, v3, bias)
        return out

    def mlp(self, h: T, i: int) -> T:
        n0 = len(self.sim.nodes)
        y = self._mlp(h, i)
        if self.mlp_nodes_sink is not None and len(self.sim.nodes) > n0:
            self.mlp_nodes_sink(self.sim.nodes[n0:])
        return y

    def _mlp(self, h: T, i: int) -> T:
        o, m = self.ops, self.m
        if m.mlp == "gated":
            g = self.proj(h, i, "mlp.gate_proj", "gate", m.d_ff)
            u = self.proj(h, i, "mlp.up_proj", "up", m.d_ff)
            a = o.activation(g, m.activation)
            o.drop(g)
            x = o.mul(a, u)
            o.drop(a, u)
            y = self.proj(x, i, "mlp.down_proj", "down", m.d_model)
        else:
            f = self.proj(h, i, "mlp.fc1", "up", m.d_ff)
            a = o.activation(f, m.activation)
            o.drop(f)
            x = a
            y = self.proj(x, i, "mlp.fc2", "down", m.d_model)
        o.drop(x)
        return y

    def resid_drop(self, x: T) -> T:
        y = self.ops.dropout(x, self.m.resid_dropout)
        self.ops.drop(x)
        return y

    def layer(self, x: T, i: int) -> T:
        """One decoder layer; takes a reference to x and returns a new output reference."""
        o, m = self.ops, self.m
        if m.block == "parallel":
            h = self.norm(x, f"layers.{i}.norm1")
            a = self.resid_drop(self.attention(h, i))
            f = self.resid_drop(self.mlp(h, i))
            o.drop(h)
            s = o.add(a, f)
            o.drop(a, f)
            y = o.add(s, x)
            o.drop(s)
            return y
        if m.norm_placement == "pre":
            h = self.norm(x, f"layers.{i}.norm1")
            a = self.resid_drop(self.attention(h, i))
            o.drop(h)
            x1 = o.add(x, a)
            o.drop(a)
            h2 = self.norm(x1, f"layers.{i}.norm2")
            f = self.resid_drop(self.mlp(h2, i))
            o.drop(h2)
            y = o.add(x1, f)
            o.drop(x1, f)
            return y
        # post-norm (DeepNet): x = norm(x * alpha + f(x))
        a = self.resid_drop(self.attention(x, i))
        r = o.scale(x, m.residual_scale)
        z = o.add(r, a)
        o.drop(r, a)
        x1 = self.norm(z, f"layers.{i}.norm1")
        o.drop(z)
        f = self.resid_drop(self.mlp(x1, i))
        r2 = o.scale(x1, m.residual_scale)
        z2 = o.add(r2, f)
        o.drop(r2, f, x1)
        y = self.norm(z2, f"layers.{i}.norm2")
        o.drop(z2)
        return y

    # -- checkpointing ------------------------------------------------------------------
    def checkpoint(self, inputs: Callable[[], list[T]], fn: Callable[[], T], label: str) -> T:
        """Non-reentrant checkpoint of ``fn``: forward keeps only the inputs; backward recomputes."""
        sim = self.sim
        ins = inputs()
        sim.grad_enabled = False
        out = fn()
        sim.grad_enabled = True
        out.requires_grad = True
        fwd = self

        def recompute(s: Sim, node: Node) -> None:
            saved_nodes, saved_phase = s.nodes, s.phase
            s.phase = "backward"
            s.label = f"bwd {label} (recompute)"
            # Non-reentrant checkpoint stops recomputing once the last tensor the region saves
            # is recomputed (early stop): a dry run without memory finds that point.
            s.nodes = []
            c0 = s.alloc_count
            s.ghost_after = c0
            s.last_save_count = c0
            dry = fn()
            fwd.ops.exit_autocast()
            for n in s.nodes:
                for p in n.params:
                    p.uses -= 1
                s._release_node(n)
            s.unref(dry)
            stop = s.last_save_count - c0
            s.nodes = []
            s.ghost_after = s.alloc_count + stop
            out2 = fn()
            fwd.ops.exit_autocast()
            s.ghost_after = None
            sub = s.nodes
            s.nodes = saved_nodes
            s.phase = saved_phase
            # the recomputed output is discarded; its gradient is the region output's gradient
            out2.grad_buffer, node.outputs[0].grad_buffer = node.outputs[0].grad_buffer, None
            s.unref(out2)
            # back-propagate the region now; the checkpoint node itself then has no work left
            s.run_nodes(sub, lambda n: f"bwd {label}")
            out2.grad_buffer = None
            node.outputs = []
            node.inputs = []

        node = Node(f"checkpoint {label}", [], [t for t in ins if t.requires_grad], [], [out], on_backward=recompute)
        node.fwd_label = f"fwd {label}"
        for t in ins:
            sim.ref(t)
        node.saved = list(ins)
        out.producer = node
        sim.nodes.append(node)
        return out

    def layers(self, x: T) -> T:
        tr, n = self.tr, self.m.n_layers
        mode = tr.checkpoint
        i = 0
        plan = None
        # checkpointed regions inside a compiled graph are recomputed whole (the partitioner
        # must recompute what torch.utils.checkpoint tags), which is the eager checkpoint's memory
        if tr.compile_partitions:
            from memcalc.compile.compiled import compiled_plan
            plan = compiled_plan(self.exp)
        while i < n:
            self.sim.mark(f"fwd layer {i}")
            self.gather([i, i + 1] if i + 1 < n else [i])
            if plan is not None:
                y = self.compiled_layer(x, i, plan.extra_by_layer.get(i, 0), plan.mlp_pool_by_layer.get(i, 0))
                step = 1
            elif mode == "full" or (mode == "every-k" and i % tr.checkpoint_every == 0):
                j = i
                y = self.checkpoint(lambda: [x], lambda j=j, x=x: self.layer(x, j), f"layer {i}")
                step = 1
            elif mode == "sqrt":
                seg = sqrt_segments(n)
                lo, hi = i, min(n, i + seg)

                def run_seg(x0: T = x, lo: int = lo, hi: int = hi) -> T:
                    h = self.sim.ref(x0)
                    for j in range(lo, hi):
                        h2 = self.layer(h, j)
                        self.ops.drop(h)
                        h = h2
                    return h

                y = self.checkpoint(lambda: [x], run_seg, f"layers {lo}-{hi - 1}")
                step = hi - lo
            else:
                y = self.layer(x, i)
                step = 1
            self.ops.drop(x)
            x = y
            i += step
        self.gather([])
        if plan is not None:
            self._held_across_steps(plan.held)
        return x

    def _held_across_steps(self, held: dict[tuple[int, int], int]) -> None:
        """What the compiled backward computes at one step and keeps for a later one (see
        memcalc.compile.compiled.chain_hold): allocated when step ``c`` starts (the head's step, the
        first, at the last layer's), freed when step ``last`` starts."""
        n = len(self.compiled_nodes)
        if not held or not n:
            return
        blocks: dict[int, list[T]] = {}

        for k, node in enumerate(self.compiled_nodes):
            inner = node.on_backward
            here = [(last, b) for (c, last), b in held.items() if c == k or (c >= n and k == n - 1)]

            def start(s: Sim, nd: Node, k: int = k, here=here, inner=inner) -> None:
                for t in blocks.pop(k, []):  # their last reader is this layer's backward
                    s.unref(t)
                for last, b in here:
                    if last != k:
                        blocks.setdefault(last, []).append(
                            s.alloc(b, "activations", "recomputed in backward (compiled)"))
                inner(s, nd)
                if k == 0:  # what the embedding's backward reads goes with the graph's end
                    for ts in blocks.values():
                        for t in ts:
                            s.unref(t)
                    blocks.clear()

            node.on_backward = start

    def compiled_layer(self, x: T, i: int, saved_bytes: int, pool_bytes: int = 0) -> T:
        """One layer inside the compiled graph (``torch.compile``; see memcalc.compile.compiled).

        Forward: inductor frees every intermediate once used, so what stays is the saved set the
        partitioner chose: the layer's input (or, when the budget recomputes it, the residual
        stream the backward graph rebuilds before its first layer, one tensor per layer, which
        is the same memory once backward starts) plus ``saved_bytes`` more. Backward: the
        saved set is consumed and the layer's values the backward reads are computed again
        (the saved set and the recomputation together are the layer's eager saved set; the
        simulator recomputes the eager layer, as a checkpointed region). Once the layer's MLP
        backward is done, its buffers (``pool_bytes``, see memcalc.compile.compiled.mlp_pool) stay
        allocated for the next layer's MLP to reuse, so they overlap this layer's attention
        backward; layer 0 has no next layer and frees them."""
        sim = self.sim
        block = sim.alloc(saved_bytes, "activations", "saved activations (compiled)") if saved_bytes else None
        y = self.checkpoint(lambda: [x], lambda: self.layer(x, i), f"layer {i}")
        node = y.producer
        recompute = node.on_backward
        fwd = self

        def release_pool(s: Sim, nd: Node) -> None:  # the MLP backward reuses the pool
            if fwd.mlp_pool is not None:
                s.unref(fwd.mlp_pool)
                fwd.mlp_pool = None

        def keep_pool(s: Sim, nd: Node) -> None:
            if i > 0 and pool_bytes:
                release_pool(s, nd)
                fwd.mlp_pool = s.alloc(pool_bytes, "temporaries", "compiled backward buffers kept for reuse")

        def hook_mlp(nodes: list[Node]) -> None:
            nodes[-1].on_backward = _chain(release_pool, nodes[-1].on_backward)  # first in backward
            nodes[0].after_backward = _chain(nodes[0].after_backward, keep_pool)  # last in backward

        def on_backward(s: Sim, nd: Node) -> None:
            if block is not None:
                nd.saved.remove(block)  # the backward graph consumes (frees) the saved set
                s.unref(block)
            fwd.mlp_nodes_sink = hook_mlp if pool_bytes else None
            try:
                recompute(s, nd)
            finally:
                fwd.mlp_nodes_sink = None

        node.on_backward = on_backward
        if block is not None:
            node.saved.append(block)
        self.compiled_nodes.append(node)
        return y

    def release_compiled(self) -> None:
        """End of the compiled backward: what it kept to the end goes."""
        for t in (self.mlp_pool, self.compiled_tangent):
            if t is not None:
                self.sim.unref(t)
        self.mlp_pool = self.compiled_tangent = None

    def gather(self, layers: list[int]) -> None:
        """ZeRO-3: keep exactly these layers' weights all-gathered (current + prefetched next)."""
        if not self.model.layer_gather_bytes:
            return
        bufs = self.model.gathered
        for j in [j for j in bufs if j not in layers]:
            self.sim.unref(bufs.pop(j))
        for j in layers:
            if j not in bufs:
                bufs[j] = self.sim.alloc(self.model.layer_gather_bytes, "weights", "all-gathered layer weights (ZeRO-3)")

    def run(self) -> T:
        """The whole forward: inputs, embedding, layers, final norm, head, loss."""
        sim, o, m = self.sim, self.ops, self.m
        sim.mark("inputs", "forward")
        ids = sim.alloc(self.rows * 8, "activations", "inputs")
        labels = sim.alloc(self.rows * 8, "activations", "inputs")
        self.ids_labels = (ids, labels)
        x = o.embedding(ids, self.rows, self.p("embed_tokens.weight"), m.d_model)
        pos = self.maybe("embed_positions.weight")
        if pos is not None:
            pe = o.embedding(ids, self.T, pos, m.d_model)
            x2 = o.add(x, pe)
            o.drop(x, pe)
            x = x2
        if m.positions == "rope":
            self.rope_tables = sim.alloc(2 * DType.fp32.nbytes(self.rows * m.rotary_dim), "activations", "rope tables")
        x = self.resid_drop_embd(x)
        x = self.layers(x)
        sim.mark("final norm & head")
        if m.final_norm:
            h = self.norm(x, "final_norm")
            o.drop(x)
            x = h
        head = self.maybe("lm_head.weight") or self.p("embed_tokens.weight")
        logits = o.linear(x, self.rows, head, self.maybe("lm_head.bias"), m.vocab_size)
        o.drop(x)
        if self.tr.compile and logits.producer is not None:
            # the compiled graph ends at the logits: their gradient is an argument of
            # CompiledFunction.backward (AOTAutograd's runtime wrapper), which keeps it
            # referenced until the whole compiled backward returns
            def keep_tangent(s: Sim, nd: Node, logits: T = logits) -> None:
                if logits.grad_buffer is not None:
                    self.compiled_tangent = s.ref(logits.grad_buffer)

            logits.producer.on_backward = _chain(keep_tangent, logits.producer.on_backward)
        o.category = "logits & loss"
        loss = o.lm_loss(logits, self.B, self.T, m.vocab_size)
        o.category = "saved activations"
        o.drop(logits)
        o.exit_autocast()
        sim.mark("loss")
        return loss

    def resid_drop_embd(self, x: T) -> T:
        y = self.ops.dropout(x, self.m.embd_dropout)
        self.ops.drop(x)
        return y

    def release_inputs(self) -> None:
        """The batch and the RoPE tables go away with the step."""
        for t in (*self.ids_labels, self.rope_tables):
            self.sim.unref(t)


def tr_autocast(exp: ExperimentSpec) -> Optional[DType]:
    tr = exp.training
    return tr.compute_dtype if tr.is_amp else None
