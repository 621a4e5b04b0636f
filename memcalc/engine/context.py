"""What the block code reads and calls of the decoder walk: :class:`ForwardContext`.

The decoder's blocks (:mod:`memcalc.engine.blocks`: embedding, norm, attention and its variants,
MLA, MLP, MoE, layer, adapters, head) are free functions over the walk that calls them,
:class:`memcalc.engine.forward.Forward`. They are written against this protocol instead of
importing ``Forward`` (which imports them): the engine's modules form no import cycle, type-only
imports included (``tests/unit/test_shape.py``). A new block reads what is here; a walk
attribute it needs is added here first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol

from memcalc.engine.strategy import Walk

if TYPE_CHECKING:
    from memcalc.core.liger import LigerPlan
    from memcalc.core.spec import ExperimentSpec, LoraSpec, ModelSpec, TrainingSpec
    from memcalc.engine.records import Param
    from memcalc.engine.records import T as Tensor
    from memcalc.engine.ops import Ops
    from memcalc.engine.sim import Sim
    from memcalc.engine.strategy import LayerStrategy
    from memcalc.core.dtypes import DType
    from memcalc.engine.context_parallel import ContextParallel
    from memcalc.engine.tensor_parallel import TensorParallel


class Weights(Protocol):
    """What the blocks read of the model's parameters (:class:`memcalc.engine.weights.Model`, which
    this module does not import: it builds the inventory from the blocks' rules)."""

    params: dict[str, Param]
    compute: DType  # the compute dtype (a QLoRA base is dequantised to it)
    buffers: dict[str, list]  # a framework's persistent GPU buffers (blocks/unsloth_lora.py), made once a step


class ForwardContext(Walk, Protocol):
    """The decoder walk as the block code sees it (one rank's decoder under tensor parallelism); a
    :class:`memcalc.engine.strategy.Walk` (what the layer strategies use of it)."""

    sim: Sim
    ops: Ops
    strategy: LayerStrategy  # how the layers run (the attention core goes through it)
    exp: ExperimentSpec  # the experiment (one rank's share of the model under tensor parallelism)
    m: ModelSpec  # the model (one rank's share of it under tensor parallelism)
    tr: TrainingSpec
    lora: Optional[LoraSpec]
    run_start: bool  # the run's first micro-step (TrainingSpec.first_seq): nothing of an earlier one alive
    tp: Optional[TensorParallel]  # the tensor-parallel collectives (None without tensor parallelism)
    cp: Optional[ContextParallel]  # the context-parallel attention (None without context parallelism)
    B: int  # batch
    T: int  # sequence length
    rows: int  # B * T
    seq_rows: int  # rows of the residual stream on this rank (rows / tp with sequence parallelism)
    # what the walk asks of the (frozen) model spec for every layer, read once
    variant_layer: bool  # the layer is not plain pre-norm / parallel / post-norm (blocks/layer.py)
    variant_attention: bool  # the attention is MLA or a variant (blocks/attention.py)
    q_dim: int
    kv_dim: int
    dim_head: int
    kv_heads: int
    projs: dict[tuple, tuple]  # proj's parameters by (layer, name, base, weight), looked up once a step
    masks: dict[str, Tensor]  # the step's attention masks by kind (attention_variants.build_masks)
    held_masks: list[Tensor]  # masks a checkpointed region holds until its backward
    input_leaf: Optional[Tensor]  # the embedding output as enable_input_require_grads leaves it (rules)
    kv_cache: list[Tensor]  # transformers' DynamicCache: K, V copies held until the loss (rules.kv_cache)
    liger: Optional[LigerPlan]  # --kernels liger: the Liger kernels that replace the model's code (blocks/liger.py)
    unsloth_lora: frozenset[str]  # --framework unsloth: its fused LoRA Functions that run (blocks/unsloth_lora.py)

    @property
    def model(self) -> Weights:
        """The parameters as allocations (:class:`memcalc.engine.weights.Model`)."""

    def p(self, name: str) -> Param:
        """The parameter called ``name``."""

    def maybe(self, name: str) -> Optional[Param]:
        """The parameter called ``name``, if the model has one."""

    def proj(self, x: Tensor, layer: Optional[int], name: str, short: str, d_out: int,
             base: Optional[str] = None, weight: Optional[str] = None) -> Tensor:
        """A projection with its LoRA adapter when targeted (and its tensor-parallel collective)."""

    def norm(self, x: Tensor, name: str) -> Tensor:
        """The model's norm with the weights called ``name``."""

    def attention(self, h: Tensor, i: int) -> Tensor:
        """Layer ``i``'s attention block."""

    def core_attention(self, q: Tensor, k: Tensor, v: Tensor, i: int) -> Tensor:
        """The plain attention core (RoPE, GQA expansion, SDPA) of layer ``i``."""

    def mlp(self, h: Tensor, i: int) -> Tensor:
        """Layer ``i``'s feed-forward block."""

    def resid_drop(self, x: Tensor) -> Tensor:
        """Residual dropout on ``x`` (a reference the call takes over)."""
