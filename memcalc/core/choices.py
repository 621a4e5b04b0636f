"""The spec's closed vocabularies (``Literal`` types and their values), without pydantic.

:mod:`memcalc.core.spec` imports every name here and builds its models from them; the command
line builds its option choices from the same tuples without importing the spec models (and
pydantic), so ``memcalc --help`` stays fast.
"""

from __future__ import annotations

import typing
from typing import Literal

#: ``--precision``: pure 16-bit (bf16, fp16), fp32, or autocast over fp32 weights (amp-*)
Precision = Literal["fp32", "bf16", "fp16", "amp-bf16", "amp-fp16"]
PRECISIONS: tuple[str, ...] = typing.get_args(Precision)

#: ``--lora-dtype``: the adapters' dtype (fp32, or the base model's weight dtype)
LoraDType = Literal["fp32", "model"]
LORA_DTYPES: tuple[str, ...] = typing.get_args(LoraDType)

#: ``--sharding``: whose code shards the ZeRO stage over the data-parallel GPUs
Sharding = Literal["fsdp2", "fsdp1", "deepspeed"]
#: --pp-schedule (memcalc.core.pipeline.TORCH_SCHEDULES: the torch class of each)
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zbv-zero-bubble"]
SHARDINGS: tuple[str, ...] = typing.get_args(Sharding)

#: ``--cp-method``: how context parallelism splits attention (memcalc.engine.context_parallel): ring (torch's
#: context_parallel, as torchtitan applies it) or ulysses (DeepSpeed's DistributedAttention all-to-all)
CpMethod = Literal["ring", "ulysses"]
CP_METHODS: tuple[str, ...] = typing.get_args(CpMethod)

#: ``--compile-scope``: what one torch.compile graph is (the whole forward, or each decoder layer apart)
CompileScope = Literal["model", "logits", "layer"]
COMPILE_SCOPES: tuple[str, ...] = typing.get_args(CompileScope)

#: ``cross_entropy`` of the kernel profile (``--loss``): on the full logits, or in chunks, or TRL's fused LM head,
#: or Unsloth's unsloth_fused_ce_loss (memcalc.core.unsloth)
LossKind = Literal["full", "chunked", "trl-fused", "unsloth-fused"]
LOSSES: tuple[str, ...] = typing.get_args(LossKind)

#: ``--kernels``: a kernel library that replaces the model's layers (liger: Liger-Kernel, memcalc.core.liger;
#: cce: Apple's Cut Cross-Entropy on the head and loss, memcalc.core.cce)
KernelLibrary = Literal["none", "liger", "cce"]
KERNEL_LIBRARIES: tuple[str, ...] = typing.get_args(KernelLibrary)

#: ``liger_ops`` of the kernel profile: which of Liger's kernels apply (memcalc.core.liger.LIGER_OPS)
LigerOp = Literal["rope", "rms_norm", "glu", "flce"]

#: ``--framework``: whose layer code runs the model (memcalc.inputs.profiles.FRAMEWORKS has each one's rules)
Framework = Literal["plain", "hf", "torchtune", "litgpt", "trl", "unsloth"]
FRAMEWORKS: tuple[str, ...] = typing.get_args(Framework)

#: ``validate --framework``: the frameworks whose own code the validator runs (plain: memcalc's replica;
#: hf: transformers + PEFT; the others: one module each in validate/trainers/, registered in its TRAINERS)
TRACED_FRAMEWORKS: tuple[str, ...] = ("plain", "hf", "torchtune", "trl", "litgpt")
