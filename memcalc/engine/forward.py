"""The decoder's forward pass, op by op, as the model code runs it.

Mirrors the module code of the families we model: Hugging Face Llama/Mistral/
Qwen2 (pre-norm, SwiGLU, RoPE, ``repeat_kv`` for GQA), GPT-2 (learned
positions, LayerNorm, GELU), phi (parallel block, partial rotary) and
Forgather's Deep One (DeepNet post-norm, per-layer ALiBi mask, ReLU-gated FFN,
shifted-copy loss). Python references are dropped where the Python variable
dies, so the simulator frees what real code frees.

This module walks the decoder only: it composes the blocks of :mod:`memcalc.engine.blocks` (each
part's forward rule is there). How layers run (eagerly, checkpointed, inside a
compiled graph) is the strategy's (:mod:`memcalc.engine.strategy`); ZeRO-3's all-gathers
are :class:`memcalc.engine.sharding.LayerGather`'s. Every op records the layer it belongs to
and its role (``Sim.layer``, ``Sim.role``).
"""

from __future__ import annotations

from typing import Optional

from memcalc.core.dtypes import DType
from memcalc.core.rules import is_attention_variant, is_variant_layer, rope_tables_bytes, rope_width
from memcalc.core.spec import ExperimentSpec
from memcalc.core.liger import liger_plan
from memcalc.core.cce import check_cce
from memcalc.engine.blocks import (adapters, cce, chunked_output, compiled_loss, embedding, head, liger, litgpt_head,
                                   trl_head, unsloth_head, unsloth_lora)
from memcalc.engine.blocks import attention as attention_block
from memcalc.engine.blocks import layer as layer_block
from memcalc.engine.blocks import mlp as mlp_block
from memcalc.engine.blocks import norm as norm_block
from memcalc.engine.blocks import attention_variants as av
from memcalc.engine.blocks.moe import moe_block
from memcalc.engine.ops import Ops
from memcalc.engine.sharding import GatherHooks
from memcalc.engine.sim import Param, Sim, T
from memcalc.engine.strategy import LayerStrategy
from memcalc.engine import context_parallel
from memcalc.engine.tensor_parallel import TensorParallel, local_experiment
from memcalc.engine.weights import Model


class Forward:
    """Runs one forward pass on the simulator; returns the loss tensor. The blocks
    (:mod:`memcalc.engine.blocks`) see it through :class:`memcalc.engine.context.ForwardContext`."""

    # the blocks' forward rules the walk offers them (bound as methods: no call in between)
    proj = adapters.proj
    norm = norm_block.norm
    core_attention = attention_block.core_attention
    resid_drop = layer_block.resid_drop
    _attention = attention_block.attention
    _layer = layer_block.layer

    def __init__(self, sim: Sim, exp: ExperimentSpec, model: Model, strategy: LayerStrategy,
                 gather: Optional[GatherHooks] = None) -> None:
        full, exp = exp, local_experiment(exp)  # tensor parallelism: the decoder one rank runs (engine.tensor_parallel)
        self.cp = context_parallel.ContextParallel.of(exp, full)  # its attention (None without context parallelism)
        exp = context_parallel.local_experiment(exp)  # context parallelism: seq / cp tokens (engine.context_parallel)
        self.sim = sim
        self.strategy = strategy
        self.gather = gather
        self.exp = exp
        self.m = exp.model
        self.tr = exp.training
        self.model = model
        self.ops = Ops(sim, exp.profile, tr_autocast(exp))
        self.B = self.tr.batch
        self.T = self.tr.seq
        self.rows = self.B * self.T
        self.tp = TensorParallel.of(exp, self.rows)  # its collectives (None without tensor parallelism)
        self.seq_rows = self.tp.seq_rows if self.tp else self.rows  # rows of the residual stream on this rank
        self.lora = self.tr.lora
        self.rope_tables: Optional[T] = None
        #: the run's first micro-step (TrainingSpec.first_seq): nothing of an earlier micro-step alive
        self.run_start = False
        self.input_leaf: Optional[T] = None  # the embedding output as enable_input_require_grads leaves it
        self.masks: dict[str, T] = {}
        self.held_masks: list[T] = []  # masks a checkpointed region holds until its backward
        self.masks_released = False
        self.kv_cache: list[T] = []  # transformers' DynamicCache: each layer's K, V copies (rules.kv_cache)
        self.projs: dict[tuple, tuple] = {}  # proj's parameters by (layer, name, base, weight)
        # what the layer walk asks of the (frozen) model spec for every layer, read once
        m = self.m
        self.variant_layer = is_variant_layer(m)
        self.variant_attention = m.mla is not None or is_attention_variant(m)
        self.q_dim, self.kv_dim, self.dim_head, self.kv_heads = m.q_dim, m.kv_dim, m.dim_head, m.kv_heads
        self.liger = liger_plan(m, exp.profile, self.tr) if exp.profile.kernels == "liger" else None
        self.unsloth_lora = unsloth_lora.fused_groups(self)
        if exp.profile.kernels == "cce":
            check_cce(m, self.tr)  # memcalc.core.cce: what Cut Cross-Entropy is modelled with

    # -- helpers ----------------------------------------------------------------------
    def p(self, name: str) -> Param:
        return self.model.params[name]

    def maybe(self, name: str) -> Optional[Param]:
        return self.model.params.get(name)

    # -- blocks -----------------------------------------------------------------------
    def attention(self, h: T, i: int) -> T:
        role = self.sim.set_role("attention")
        y = self._attention(h, i)
        self.sim.set_role(role)
        return y

    def mlp(self, h: T, i: int) -> T:
        role = self.sim.set_role("mlp")
        y = self.strategy.mlp(self, h, i, lambda: self._mlp(h, i))
        self.sim.set_role(role)
        return y

    def _mlp(self, h: T, i: int) -> T:
        m = self.m
        if m.moe is not None and m.moe.is_moe_layer(i):  # the sparse block (blocks/moe.py)
            return moe_block(self, h, i)
        return mlp_block.mlp(self, h, i)

    def layer(self, x: T, i: int) -> T:
        """One decoder layer; takes a reference to x and returns a new output reference."""
        sim = self.sim
        where = sim.where(i, "layer")
        gather = self.gather
        if gather is not None:  # FSDP2's per-layer pre- and post-forward (engine.fsdp)
            sim.layer_hook(gather.layer_enter, i)  # (a checkpointed region's recompute skips them)
        y = self._layer(x, i)
        if gather is not None:
            sim.layer_hook(gather.layer_exit, i)
        sim.where(*where)
        return y

    # -- the layers -------------------------------------------------------------------
    def layers(self, x: T) -> T:
        """All decoder layers, region by region as the strategy runs them."""
        n = self.m.n_layers
        for lo, hi in self.strategy.regions(n):
            self.sim.mark(f"fwd layer {lo}")
            if self.gather is not None:
                self.gather.forward_enter(lo)
            y = self.strategy.run(self, x, lo, hi)
            self.ops.drop(x)
            x = y
        if self.gather is not None:
            self.gather.release()
        self.strategy.after_layers(self)
        return x

    def run(self) -> T:
        """The whole forward: inputs, embedding, layers, final norm, head, loss."""
        sim, o, m = self.sim, self.ops, self.m
        sim.mark("inputs", "forward")
        sim.where(None, "embedding")
        if sim.offload is not None:  # torchtune wraps the model's forward in OffloadActivations
            sim.offload.active = True
        ids = sim.alloc(self.rows * 8, "activations", "inputs")
        labels = sim.alloc(self.rows * 8, "activations", "inputs")
        self.ids_labels: tuple = (ids, labels)
        if self.exp.profile.cross_entropy == "trl-fused":  # TRL's collator also sends the attention mask
            self.ids_labels += (sim.alloc(self.rows * 8, "activations", "inputs"),)
        x = embedding.embed(self, ids)
        if sim.offload is not None and self.input_leaf is not None and not self.run_start:
            sim.offload.carry_prior(sim, self.input_leaf)  # the last step's leaf is still held (engine/offload.py)
        if m.positions == "rope" and self.liger is not None and self.liger.rope:  # what LigerRopeFunction saves
            self.rope_tables = liger.rope_tables(self, x)
        elif m.positions == "rope" and self.exp.profile.framework != "torchtune":  # torchtune: a cache view
            self.rope_tables = sim.alloc(rope_tables_bytes(self.exp.profile.framework, self.B, self.T, rope_width(m),
                                                           o.dtype_of(x).nbytes(1)), "activations", "rope tables")
        x = embedding.embed_dropout(self, x)
        self.masks = av.build_masks(self)
        x = self.layers(x)
        sim.mark("final norm & head")
        sim.set_role("head")
        x = head.final_norm(self, x)
        self.release_masks()
        if sim.offload is not None and self.exp.profile.cross_entropy != "trl-fused":
            # ... with a NoOpManager around the output head; the loss is outside. TRL's context spans the whole
            # training_step and its NoOp hooks sit on lm_head, which the fused head never calls (profiles "trl")
            sim.offload.active = False
        if self.exp.profile.framework == "torchtune":  # TransformerDecoder.unembed + the recipes' loss
            loss = chunked_output.head_and_loss(self, x)
        elif self.liger is not None and self.liger.flce:  # Liger's fused linear cross-entropy (blocks/liger.py)
            loss = liger.flce_loss(self, x)
        elif self.exp.profile.kernels == "cce":  # Cut Cross-Entropy (blocks/cce.py): no logits tensor
            loss = cce.cce_loss(self, x)
        elif self.exp.profile.cross_entropy == "trl-fused":  # no logits tensor (blocks/trl_head.py)
            loss = trl_head.fused_loss(self, x)
            if sim.offload is not None:  # TRL's context stays open in backward, where checkpoint recomputation
                sim.offload.active = False  # saves through its own innermost hooks (torch/utils/checkpoint.py)
        elif self.exp.profile.cross_entropy == "unsloth-fused":  # unsloth_fused_ce_loss (blocks/unsloth_head.py)
            loss = unsloth_head.fused_loss(self, x)
        elif self.exp.profile.fabric_head:  # LitGPT's fit() under Fabric (blocks/litgpt_head.py)
            loss = litgpt_head.head_and_loss(self, x)
        else:
            logits = head.logits(self, x)
            self.strategy.logits(self, logits)
            loss = (compiled_loss.graph_loss if compiled_loss.loss_in_model_graph(self) else head.loss)(self, logits)
        self.release_cache()
        o.exit_autocast()
        sim.mark("loss")
        return loss

    def release_masks(self) -> None:
        """The attention masks go when the model's forward returns (before the head); with
        checkpointing, a checkpointed region's recompute holds its masks until its backward
        (:func:`memcalc.engine.blocks.attention_variants.hold_masks`)."""
        if self.masks_released:
            return
        if self.tr.checkpoint != "none":
            av.hold_masks(self)
        for t in self.masks.values():
            self.sim.unref(t)
        self.masks_released = True  # the mapping stays for the recomputed layers to look up

    def release_cache(self) -> None:
        """The KV cache goes with the model's output object, once the loss is taken from it
        (HF Trainer ``compute_loss``: ``outputs.loss``; the output, its ``cache`` included, is dropped
        before backward)."""
        for t in self.kv_cache:
            self.sim.unref(t)
        self.kv_cache = []

    def release_inputs(self) -> None:
        """The batch and the RoPE tables go away with the step (and any mask still held)."""
        self.release_masks()
        self.masks = {}
        for t in self.held_masks:
            self.sim.unref(t)
        self.held_masks = []
        for t in (*self.ids_labels, self.rope_tables):
            self.sim.unref(t)
        if self.input_leaf is not None:  # freed with the graph; its .grad with it
            if self.sim.offload is not None:  # (offloading keeps that graph: engine/offload.py keep_graph)
                self.sim.offload.keep_graph(self.sim, (self.input_leaf, self.input_leaf.grad_buffer))
            self.sim.unref(self.input_leaf.grad_buffer)
            self.input_leaf.grad_buffer = None
            self.sim.unref(self.input_leaf)
            self.input_leaf = None


def tr_autocast(exp: ExperimentSpec) -> Optional[DType]:
    tr = exp.training
    return tr.compute_dtype if tr.is_amp else None
