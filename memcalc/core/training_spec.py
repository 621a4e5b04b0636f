"""The training step's spec (:class:`TrainingSpec`), with its LoRA adapters (:class:`LoraSpec`, and
the LoRA target names) and DeepSpeed's own settings (:class:`DeepSpeedSpec`). Every field's
description is its help text; imported through :mod:`memcalc.core.spec`."""

from __future__ import annotations

import typing
from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from memcalc.core.choices import CompileScope, CpMethod, LoraDType, PipelineSchedule, Precision, Sharding
from memcalc.core.dtypes import DType
from memcalc.core.optimizers import DEFAULT_IMPL, GALORE_RANK, IMPLS, OPTIMIZER_NAMES, impl_error
from memcalc.core.spec_base import MAX_COUNT, MAX_SEQ, Spec

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "qkv", "gate_up", "q_a", "q_b", "kv_a", "kv_b", "experts",
                "head")
#: LoRA on the output projection: PEFT ``target_modules=["lm_head"]``, torchtune ``apply_lora_to_output``,
#: LitGPT ``lora_head``. Every model has it (also with tied embeddings: PEFT 0.21 adapts the lm_head module
#: itself, A: r x d, B: vocab x r, unless ``ensure_weight_tying``), so it is no per-model target.
HEAD_TARGET = "head"
#: PEFT ``target_modules`` names of the same projections (Hugging Face module names of each family's
#: modeling file; source: peft TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING and the modeling_*.py
#: attention/MLP classes). A fused projection is one module: GPT-2 ``c_attn``, Phi-3 ``qkv_proj``,
#: GPT-NeoX/Falcon ``query_key_value`` are ``qkv`` (one adapter, A: r x d, B: (q+2kv) x r);
#: Phi-3/GLM-4 ``gate_up_proj`` is ``gate_up``. DeepSeek MLA: ``q_a_proj``, ``q_b_proj``,
#: ``kv_a_proj_with_mqa``, ``kv_b_proj``. ``experts``: the routed experts' 3-D parameters
#: (transformers 5 stores them as nn.Parameter, which ``target_modules`` never reaches; PEFT 0.21
#: adapts them only through ``target_parameters`` = experts.gate_up_proj, experts.down_proj,
#: peft/tuners/lora/layer.py ParamWrapper: A r*E x in, B out x r*E).
LORA_TARGET_ALIASES = {
    "q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
    "gate_proj": "gate", "up_proj": "up", "down_proj": "down",
    "c_attn": "qkv", "qkv_proj": "qkv", "query_key_value": "qkv", "gate_up_proj": "gate_up",
    "q_a_proj": "q_a", "q_b_proj": "q_b", "kv_a_proj_with_mqa": "kv_a", "kv_b_proj": "kv_b",
    "w1": "gate", "w3": "up", "w2": "down",  # Mixtral's v4 expert names, which PEFT maps onto the experts
    "lm_head": "head", "output": "head",  # PEFT / torchtune names of the output projection
}


#: PEFT ``modules_to_save`` memcalc models: the token embedding and the output head (peft/utils/other.py
#: ``ModulesToSaveWrapper``: the module stays as ``original_module``, frozen, beside a trainable
#: ``copy.deepcopy`` of it in the base's dtype). Other names of the same modules map onto these.
MODULES_TO_SAVE = ("embed_tokens", "lm_head")
MODULES_TO_SAVE_ALIASES = {"embed": "embed_tokens", "wte": "embed_tokens", "embed_in": "embed_tokens",
                           "tok_embeddings": "embed_tokens", "word_embeddings": "embed_tokens",
                           "head": "lm_head", "embed_out": "lm_head", "output": "lm_head"}


def _canonical(names: typing.Iterable[str], aliases: dict[str, str]) -> tuple[str, ...]:
    """``names`` lowercased and stripped, ``aliases`` mapped, duplicates dropped, in order."""
    out: list[str] = []
    for n in names:
        t = n.strip().lower() if isinstance(n, str) else n
        t = aliases.get(t, t)
        if t not in out:
            out.append(t)
    return tuple(out)


def canonical_modules_to_save(names: typing.Iterable[str]) -> tuple[str, ...]:
    """``modules_to_save`` names lowercased, aliases mapped (wte -> embed_tokens), duplicates dropped."""
    return _canonical(names, MODULES_TO_SAVE_ALIASES)


def canonical_targets(names: "typing.Iterable[str]") -> tuple[str, ...]:
    """LoRA target names lowercased, PEFT aliases mapped (q_proj -> q), duplicates dropped, in order."""
    return _canonical(names, LORA_TARGET_ALIASES)


#: the largest LoRA rank accepted (2**16; the widest layer among memcalc's presets is 28,672: Llama-2-70B's MLP)
MAX_LORA_RANK = 65_536


class LoraSpec(Spec):
    """Low-rank adapters on a frozen base (LoRA; QLoRA when the base is 4-bit)."""

    rank: int = Field(16, gt=0, le=MAX_LORA_RANK,
                      description=f"Adapter rank r (1 to {MAX_LORA_RANK:,}, beyond the widest layer of any preset).")
    alpha: float = Field(32.0, gt=0, description="Adapter scaling numerator (scale = alpha / rank).")
    targets: tuple[str, ...] = Field(
        ("q", "k", "v", "o"),
        description=f"Projections that get adapters, from {', '.join(LORA_TARGETS)} (those the model has: "
        "qkv / gate_up on fused projections, q_a, q_b, kv_a, kv_b on MLA, experts on MoE).",
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter input.")
    qlora: bool = Field(False, description="Quantise the frozen base to 4-bit NF4 (QLoRA).")
    quant: Optional[Literal["gptq", "awq"]] = Field(
        None, description="A GPTQ or AWQ 4-bit base under LoRA (transformers + gptqmodel, PEFT's GPTQLoraLinear / "
        "AwqLoraLinear): packed int32 weights, per-group scales and zeros (group 128), and the torch training "
        "kernel's dequantized 16-bit weight saved per linear for backward; read from source (needs CUDA to trace).")
    quant_block: int = Field(64, gt=0, description="NF4 block size (elements per absmax constant).")
    double_quant: bool = Field(True, description="Quantise the absmax constants too (QLoRA double quantisation).")
    bnb_saves_input: bool = Field(
        False,
        description="QLoRA with bitsandbytes before 0.43.2 (LitGPT 0.4's pins, 0.41/0.42): MatMul4Bit.forward keeps "
        "each 4-bit linear's input for backward (autograd/_functions.py ``ctx.tensors = (A, B)``; bitsandbytes PR "
        "1270, 0.43.2, keeps only the packed weight).")
    dora: bool = Field(
        False, description="DoRA (weight-decomposed LoRA, PEFT use_dora=True): a trainable magnitude vector per "
        "target and the column norm of W + scale * B @ A in every forward.")
    dtype: Optional[LoraDType] = Field(
        None,
        description="Adapter weights (and so their gradients and optimizer state): fp32, or model = the base's "
        "weight dtype; None = the framework's (the kernel profile's lora_dtype: hf -> fp32, PEFT "
        "autocast_adapter_dtype=True; plain, torchtune, litgpt -> model).",
    )

    modules_to_save: tuple[str, ...] = Field(
        (), description="PEFT modules_to_save: modules trained whole beside the adapters, from "
        f"{', '.join(MODULES_TO_SAVE)} (ModulesToSaveWrapper keeps the original frozen and a trainable copy in the "
        "base's dtype: the weights twice, plus the copy's gradient and optimizer state).")

    @field_validator("targets", mode="before")
    @classmethod
    def _aliases(cls, v: Any) -> Any:
        return canonical_targets(v) if isinstance(v, (list, tuple)) else v

    @field_validator("modules_to_save", mode="before")
    @classmethod
    def _save_aliases(cls, v: Any) -> Any:
        return canonical_modules_to_save(v) if isinstance(v, (list, tuple)) else v

    @model_validator(mode="after")
    def _check_targets(self) -> "LoraSpec":
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if bad:
            raise ValueError(f"unknown LoRA target(s) {', '.join(bad)}; valid: {', '.join(LORA_TARGETS)}")
        if not self.targets:
            raise ValueError("LoRA needs at least one target")
        bad = [t for t in self.modules_to_save if t not in MODULES_TO_SAVE]
        if bad:
            raise ValueError(f"unknown modules_to_save {', '.join(bad)}; valid: {', '.join(MODULES_TO_SAVE)}")
        if "lm_head" in self.modules_to_save and HEAD_TARGET in self.targets:
            # memcalc models a module either adapted or wrapped whole (ModulesToSaveWrapper), not both
            raise ValueError("lm_head is both a LoRA target (head) and in modules_to_save; PEFT trains it one way: "
                             "drop head from the targets or lm_head from modules_to_save")
        if self.dora and "experts" in self.targets:
            # peft/tuners/lora/layer.py ParamWrapper.update_layer: "lora.ParamWrapper does not work with use_dora=True."
            raise ValueError("DoRA cannot adapt the MoE experts: PEFT's ParamWrapper (target_parameters) refuses "
                             "use_dora=True; drop the experts target or --dora")
        if self.quant is not None and (self.qlora or self.dora):
            # peft/tuners/lora/gptq.py GPTQLoraLinear.__init__: "does not support DoRA yet"
            raise ValueError(f"quant {self.quant} is the base's own 4-bit format: not with "
                             f"{'qlora (bitsandbytes NF4)' if self.qlora else 'DoRA (PEFT GPTQLoraLinear refuses it)'}")
        return self


#: the names of memcalc.core.optimizers.OPTIMIZERS (the registry)
Optimizer = Literal[OPTIMIZER_NAMES]  # type: ignore[valid-type]
OptimizerImpl = Literal[IMPLS]  # type: ignore[valid-type]


class DeepSpeedSpec(Spec):
    """DeepSpeed ZeRO's own settings (a ``ds_config.json``'s ``zero_optimization``), with the
    defaults of deepspeed/runtime/zero/config.py ``DeepSpeedZeroConfig`` (0.19). Sizes are in
    elements, as DeepSpeed counts them. Read by :mod:`memcalc.inputs.deepspeed_config`; modelled
    by :mod:`memcalc.engine.deepspeed`."""

    stage: Literal[2, 3] = Field(2, description="zero_optimization.stage: 2 shards fp32 master weights, optimizer "
                                 "state and gradients; 3 also the 16-bit weights.")
    reduce_bucket_size: int = Field(500_000_000, gt=0, le=10**12, description="zero_optimization.reduce_bucket_size: "
                                    "elements reduced at once (the gradient bucket; DeepSpeed default 5e8).")
    allgather_bucket_size: int = Field(500_000_000, ge=0, le=10**12, description="zero_optimization."
                                       "allgather_bucket_size: elements all-gathered at once after a ZeRO-2 step "
                                       "(default 5e8).")
    overlap_comm: Optional[bool] = Field(None, description="zero_optimization.overlap_comm: reduce on a side stream "
                                         "(ZeRO-3 keeps two reduce buckets, ZeRO-2 keeps the ipg buckets until the "
                                         "step); None = DeepSpeed's default (true under stage 3, false under 2).")
    contiguous_gradients: bool = Field(True, description="zero_optimization.contiguous_gradients: ZeRO-2 copies each "
                                       "reduced gradient partition into one preallocated flat buffer.")
    prefetch_bucket_size: int = Field(50_000_000, ge=0, le=10**12, description="zero_optimization."
                                      "stage3_prefetch_bucket_size: elements ZeRO-3 prefetches ahead (default 5e7).")
    max_live_parameters: int = Field(1_000_000_000, ge=0, le=10**13, description="zero_optimization."
                                     "stage3_max_live_parameters: gathered elements ZeRO-3 keeps alive (default 1e9).")
    max_reuse_distance: int = Field(1_000_000_000, ge=0, le=10**13, description="zero_optimization."
                                    "stage3_max_reuse_distance: a parameter reused within this many elements stays "
                                    "gathered (default 1e9).")
    param_persistence_threshold: int = Field(100_000, ge=0, le=10**13, description="zero_optimization."
                                             "stage3_param_persistence_threshold: ZeRO-3 keeps parameters of at most "
                                             "this many elements whole on every rank (default 1e5).")
    offload_param: bool = Field(False, description="zero_optimization.offload_param.device cpu/nvme: ZeRO-3 keeps the "
                                "16-bit weight partitions in host memory.")

    @property
    def overlap(self) -> bool:
        """overlap_comm as DeepSpeed resolves it (config.py ``overlap_comm_valid``)."""
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm


class TrainingSpec(Spec):
    """One training step: batch, precision, optimizer and memory techniques."""

    batch: int = Field(1, gt=0, le=MAX_COUNT, description=f"Micro-batch size (sequences per forward pass; at most {MAX_COUNT:,}).")
    seq: int = Field(2048, gt=0, le=MAX_SEQ, description=f"Sequence length in tokens (at most {MAX_SEQ:,}).")
    grad_accum: int = Field(1, gt=0, le=MAX_COUNT, description=f"Gradient-accumulation micro-steps per optimizer step (at most {MAX_COUNT:,}).")
    first_seq: Optional[int] = Field(
        None, gt=0, le=MAX_SEQ,
        description="Tokens per sequence of the run's first micro-batch, where a trainer runs it apart from the "
        "others (lit-gpt's finetune/lora.py before LitGPT 0.4 puts the longest training sample first, get_batch("
        "..., longest_seq_ix if iter_num == 0), and pads each micro-batch to its longest sample): the first step's "
        "first micro-step runs first_seq tokens with nothing of an earlier micro-step alive (no previous output or "
        "graph held, no gradients, no optimizer state), its later micro-steps and every later step seq tokens; the "
        "peak is the higher of that first step and the steady step. None: the first micro-batch is seq tokens, "
        "like the rest (memcalc.engine.timeline).")
    precision: Precision = Field(
        "fp32",
        description="fp32; bf16/fp16 = pure 16-bit (weights, grads, state); amp-* = autocast over fp32 weights.",
    )
    master_weights: bool = Field(
        False,
        description="ZeRO-paper layout: 16-bit weights and grads plus fp32 master weights and fp32 moments.",
    )
    optimizer: Optimizer = Field("adamw", description="Optimizer whose state and step temporaries are counted.")
    galore_rank: int = Field(
        GALORE_RANK, gt=0, le=MAX_COUNT, description="GaLore's projection rank r (optimizer galore-adamw; transformers "
        "optim_args rank, default 128): each decoder linear's moments are max(m, n) x r instead of m x n, beside an "
        "r x min(m, n) projector.")
    optimizer_impl: OptimizerImpl = Field(
        DEFAULT_IMPL, description="Optimizer implementation (CUDA default for AdamW is foreach; for an optimizer without one, its own step)."
    )
    checkpoint: Literal["none", "full", "every-k", "sqrt", "selective", "selective-op"] = Field(
        "none",
        description="Activation checkpointing: full = every layer, every-k = every K-th layer, sqrt = segments of ~sqrt(n) layers, selective = attention internals only, selective-op = torchtitan's op-level policy (every layer, keeping every other matmul output and the attention outputs).",
    )
    checkpoint_every: int = Field(2, gt=0, description="K for --checkpoint every-K.")
    checkpoint_reentrant: bool = Field(
        False, description="torch.utils.checkpoint(use_reentrant=True), the kind PEFT's "
        "prepare_model_for_kbit_training turns on: each region is recomputed whole and its backward runs nested, "
        "holding the recomputed output and its gradient until it ends (needs --checkpoint full, every-K or sqrt).")
    fused_optimizer: bool = Field(
        False, description="Run the optimizer step per parameter in post-accumulate-grad hooks (frees grads early)."
    )
    compile: bool = Field(False, description="torch.compile the model (inductor).")
    memory_budget: Optional[float] = Field(
        None, ge=0, le=1, description="torch.compile activation_memory_budget (0 = recompute all, 1 = default)."
    )
    compile_scope: CompileScope = Field(
        "model",
        description="What one torch.compile graph is: model = the whole forward, embedding to the loss "
        "(model.compile() on a module whose forward computes its loss: Hugging Face's CausalLM with labels, "
        "Forgather's models, memcalc's validator); logits = embedding to logits (model.compile() on a module "
        "returning logits), the loss eager after it; layer = each decoder layer apart (torchtune's "
        "training.compile_model: m.compile() per TransformerSelfAttentionLayer), embedding, final norm and head "
        "eager, the loss compiled apart (training.compile_loss).",
    )
    lora: Optional[LoraSpec] = Field(None, description="LoRA/QLoRA adapters; None = full fine-tuning.")
    zero: Literal[0, 1, 2, 3] = Field(0, description="ZeRO stage (1: optimizer state, 2: +grads, 3: +weights sharded).")
    gpus: int = Field(1, gt=0, le=MAX_COUNT, description=f"Data-parallel GPUs that shard under ZeRO (at most {MAX_COUNT:,}).")
    offload_optimizer: bool = Field(False, description="Keep optimizer state (and its step) on the CPU.")
    sharding: Sharding = Field(
        "fsdp2",
        description="How the ZeRO stage runs over the data-parallel GPUs: fsdp2 (torch.distributed fully_shard per "
        "layer and root; zero 3 = reshard_after_forward=True, zero 2 = False), fsdp1 (FullyShardedDataParallel "
        "FULL_SHARD / SHARD_GRAD_OP), or deepspeed (ZeRO-2/3 with its reduce and prefetch buckets).",
    )
    tp: int = Field(1, gt=0, le=MAX_COUNT, description="Tensor-parallel degree: Megatron-style column/row parallel "
                    "linears (DTensor parallelize_module); the GPUs of one replica. Total GPUs = gpus x tp.")
    sequence_parallel: bool = Field(
        False, description="With tp > 1: norms and dropout run on sequence shards (Megatron sequence parallelism).")
    ep: int = Field(1, gt=0, le=MAX_COUNT, description="Expert-parallel degree: the routed experts of a MoE model "
                    "split over ep of the data-parallel GPUs (n_experts / ep each), tokens exchanged by all-to-all "
                    "(torchtitan's AllToAllTokenDispatcher; memcalc.engine.expert_parallel).")
    ep_capacity_factor: float = Field(
        1.0, ge=1.0, le=MAX_COUNT, allow_inf_nan=False,
        description="With ep > 1: the rows a rank receives for its experts over the rows it sends (tokens x top_k); "
                    "1.0 = the even split, larger = the busiest rank of an imbalanced routing (a stated input).")
    cp: int = Field(1, gt=0, le=MAX_COUNT, description="Context-parallel degree: the sequence split over cp ranks "
                    "(memcalc.engine.context_parallel). Total GPUs = gpus x tp x cp.")
    cp_method: CpMethod = Field("ring", description="With cp > 1: ring (torch's context_parallel as torchtitan "
                                "applies it: load-balanced sequence shards, K/V all-gathered per attention) or "
                                "ulysses (DeepSpeed's DistributedAttention: all-to-all from sequence to heads).")
    pp: int = Field(1, gt=0, le=MAX_COUNT, description="Pipeline-parallel degree: the layers split into pp stages "
                    "on pp ranks (torchtitan's split, pp_first_stage_less_layers / pp_last_stage_less_layers; "
                    "torch.distributed.pipelining; memcalc.core.pipeline). "
                    "Total GPUs = gpus x tp x pp.")
    pp_schedule: PipelineSchedule = Field(
        "1f1b", description="With pp > 1: the pipeline schedule (gpipe = ScheduleGPipe, 1f1b = Schedule1F1B, "
        "interleaved-1f1b = ScheduleInterleaved1F1B, zero-bubble = ScheduleInterleavedZeroBubble, "
        "zbv-zero-bubble = ScheduleZBVZeroBubble: torchtitan's ZBVZeroBubble, 2 stages per rank in a V).")
    pp_stages_per_rank: Optional[int] = Field(
        None, gt=0, le=MAX_COUNT, description="With pp > 1: pipeline stages each rank holds, looped over the ranks "
        "(torchtitan's stages_per_rank, which it derives from pipeline_parallel_layers_per_stage); None: 1 for "
        "gpipe and 1f1b, 2 for the multi-stage schedules (torchtitan's default).")
    pp_first_stage_less_layers: int = Field(
        1, ge=0, le=MAX_COUNT, description="With pp > 1: decoder layers fewer on the first stage, which holds the "
        "embedding (torchtitan's pipeline_parallel_first_stage_less_layers, default 1: the embedding counts as that "
        "many layers in _generate_llm_fqn_per_model_part's split). 0 with pp_last_stage_less_layers 0: the even "
        "split where the stages divide the layers (Megatron-LM's).")
    pp_last_stage_less_layers: int = Field(
        1, ge=0, le=MAX_COUNT, description="With pp > 1: decoder layers fewer on the last stage, which holds the "
        "final norm and the head (torchtitan's pipeline_parallel_last_stage_less_layers, default 1).")
    microbatches: Optional[int] = Field(
        None, gt=0, le=MAX_COUNT, description="With pp > 1: micro-batches the batch is split into per step "
        "(None: pp).")
    activation_offload: bool = Field(
        False, description="Move saved activations to host memory during forward and back for backward "
        "(torchtune OffloadActivations); the host memory it needs is reported.")
    deepspeed: Optional[DeepSpeedSpec] = Field(
        None, description="DeepSpeed ZeRO settings (from --deepspeed ds_config.json); used with sharding deepspeed. "
        "None = DeepSpeed's defaults for the --zero stage.")

    @model_validator(mode="after")
    def _check(self) -> "TrainingSpec":
        if self.master_weights and self.precision not in ("bf16", "fp16"):
            raise ValueError(
                f"--master-weights keeps 16-bit weights beside fp32 masters; it needs precision bf16 or fp16, not {self.precision}"
            )
        if self.memory_budget is not None and not self.compile:
            raise ValueError("memory_budget applies to torch.compile; set compile too")
        if self.checkpoint_reentrant and self.checkpoint not in ("full", "every-k", "sqrt"):
            raise ValueError(f"reentrant checkpointing applies to checkpointed layers (checkpoint full, every-k or "
                             f"sqrt), not checkpoint {self.checkpoint}")
        if self.compile_scope != "model" and not self.compile:
            raise ValueError(f"compile_scope {self.compile_scope} applies to torch.compile; set compile too")
        bad_impl = impl_error(self.optimizer, self.optimizer_impl)
        if bad_impl:
            raise ValueError(bad_impl)
        if self.optimizer == "galore-adamw":
            self._check_galore()
        if self.lora is not None and self.lora.quant is not None and self.precision not in ("bf16", "fp16"):
            raise ValueError(f"quant {self.lora.quant}: gptqmodel's kernels run in fp16/bf16 (SUPPORTS_DTYPES); "
                             f"use precision bf16 or fp16, not {self.precision}")
        if self.first_seq is not None and self.pp > 1:
            raise ValueError("first_seq (a longer first micro-batch) is not modelled under pipeline parallelism "
                             "(pp > 1): leave it out and give --seq the longest micro-batch")
        if self.deepspeed is not None and (self.sharding != "deepspeed" or self.zero != self.deepspeed.stage):
            raise ValueError(f"a DeepSpeed config (ZeRO stage {self.deepspeed.stage}) needs sharding deepspeed and "
                             f"zero {self.deepspeed.stage}, not sharding {self.sharding} and zero {self.zero}")
        return self

    def _check_galore(self) -> None:
        """GaLore (galore_torch's own optimizer over full, unsharded weights): what it does not combine with here."""
        clash = [name for name, on in (
            ("LoRA (GaLore trains the full weights)", self.lora is not None),
            ("master weights", self.master_weights), ("ZeRO or FSDP sharding", self.zero > 0),
            ("tensor parallelism", self.tp > 1), ("an offloaded optimizer", self.offload_optimizer)) if on]
        if clash:
            raise ValueError(f"optimizer galore-adamw is modelled for full, unsharded training on the GPU; not with "
                             f"{', '.join(clash)}")

    @property
    def weight_dtype(self) -> DType:
        return {"fp32": DType.fp32, "amp-bf16": DType.fp32, "amp-fp16": DType.fp32, "bf16": DType.bf16, "fp16": DType.fp16}[
            self.precision
        ]

    @property
    def compute_dtype(self) -> DType:
        return {"fp32": DType.fp32, "amp-bf16": DType.bf16, "amp-fp16": DType.fp16, "bf16": DType.bf16, "fp16": DType.fp16}[
            self.precision
        ]

    @property
    def is_amp(self) -> bool:
        return self.precision.startswith("amp-")

    @property
    def compile_partitions(self) -> bool:
        """torch.compile with no checkpointing: the partitioner chooses what backward receives
        (memcalc.compile.compiled). With checkpointing, the tagged regions are recomputed whole."""
        return self.compile and self.checkpoint == "none"
