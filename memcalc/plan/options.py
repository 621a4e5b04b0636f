"""The options ``memcalc plan`` searches: technique combinations (:class:`Technique`,
:func:`techniques`, :func:`compile_techniques`), the sequence it plans at and the model it is about."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from memcalc.core.errors import UserError
from memcalc.core.optimizers import OPTIMIZERS as OPTIMIZER_RECORDS, PLANNED_OPTIMIZERS
from memcalc.core.spec import LoraSpec, ModelSpec, TrainingSpec

#: Default sequence length (or the model's maximum when smaller).
DEFAULT_SEQ = 2048

OPTIMIZERS = PLANNED_OPTIMIZERS  # the registry's searched optimizers (memcalc.core.optimizers)
CHECKPOINTS = ("none", "full", "sqrt", "selective")
LORA_RANK = 16


@dataclass(frozen=True)
class Technique:
    """One combination of memory techniques for a single-GPU run."""

    adapters: str  # "none" | "lora" | "qlora"
    precision: str  # "16" (pure 16-bit) | "16+master" (16-bit + fp32 master/moments) | "amp" | "fp32"
    optimizer: str
    checkpoint: str
    fused: bool
    budget: Optional[float] = None  # torch.compile's activation memory budget; None = eager

    def precision_name(self, half: str = "bf16") -> str:
        return {"16": half, "16+master": half, "amp": f"amp-{half}", "fp32": "fp32"}[self.precision]

    def label(self, half: str = "bf16") -> str:
        """Human-readable name, e.g. ``QLoRA · bf16 · AdamW · ckpt full · fused``."""
        ad = {"none": "full FT", "lora": "LoRA", "qlora": "QLoRA"}[self.adapters]
        pr = self.precision_name(half) + ("+fp32 master" if self.precision == "16+master" else "")
        op = OPTIMIZER_RECORDS[self.optimizer].display
        ck = "no ckpt" if self.checkpoint == "none" else f"ckpt {self.checkpoint}"
        comp = [] if self.budget is None else [f"compile budget {self.budget:g}"]
        return " · ".join([ad, pr, op, ck] + (["fused"] if self.fused else []) + comp)

    def key(self, half: str = "bf16") -> str:
        """Compact id, e.g. ``qlora/bf16/adamw/full/fused``."""
        pr = self.precision_name(half) + ("+master" if self.precision == "16+master" else "")
        comp = [] if self.budget is None else [f"compile{self.budget:g}"]
        return "/".join([self.adapters, pr, self.optimizer, self.checkpoint] + (["fused"] if self.fused else []) + comp)

    def training(self, batch: int, seq: int, half: str = "bf16",
                 targets: tuple[str, ...] = ("q", "k", "v", "o")) -> TrainingSpec:
        """The training setup of this option; ``targets``: the model's attention projections as LoRA
        targets (``ModelSpec.attention_lora_targets``: qkv, o on a fused projection)."""
        lora = None
        if self.adapters != "none":
            lora = LoraSpec(rank=LORA_RANK, qlora=self.adapters == "qlora", targets=targets)
        return TrainingSpec(
            batch=batch, seq=seq, precision=self.precision_name(half), master_weights=self.precision == "16+master",
            optimizer=self.optimizer, checkpoint=self.checkpoint, fused_optimizer=self.fused, lora=lora,
            compile=self.budget is not None, memory_budget=None if self.budget in (None, 1.0) else self.budget,
        )

    def as_dict(self, half: str = "bf16") -> dict[str, Any]:
        return {
            "option": self.label(half),
            "key": self.key(half),
            "adapters": self.adapters,
            "precision": self.precision_name(half),
            "master_weights": self.precision == "16+master",
            "optimizer": self.optimizer,
            "checkpoint": self.checkpoint,
            "fused_optimizer": self.fused,
            "compile": self.budget is not None,
            "memory_budget": self.budget,
        }


def techniques() -> list[Technique]:
    """The option grid: full fine-tuning in 4 precisions (pure 16-bit; 16-bit with fp32 master
    weights and moments; AMP over fp32 weights; fp32) x AdamW / 8-bit AdamW / Adafactor x
    checkpointing none/full/sqrt/selective x plain or fused (in-backward) optimizer step (96),
    plus LoRA and QLoRA (rank 16 on q,k,v,o, 16-bit base, AdamW) x the 4 checkpointing modes x
    plain/fused step (16). Gradient accumulation is 1 (a fused step cannot accumulate)."""
    out = []
    for prec in ("16", "16+master", "amp", "fp32"):
        for opt in OPTIMIZERS:
            for ck in CHECKPOINTS:
                for fused in (False, True):
                    out.append(Technique("none", prec, opt, ck, fused))
    for ad in ("lora", "qlora"):
        for ck in CHECKPOINTS:
            for fused in (False, True):
                out.append(Technique(ad, "16", "adamw", ck, fused))
    return out


#: the activation memory budgets ``plan --compile`` tries
COMPILE_BUDGETS = (1.0, 0.5, 0.1)


def compile_techniques(budgets: Sequence[float] = COMPILE_BUDGETS) -> list[Technique]:
    """``plan --compile``: torch.compile at each budget for a bf16 full fine-tune, LoRA and QLoRA
    (AdamW, no checkpointing: the budget is the recomputation). They are searched with direct
    estimates, not fits: the partitioner's choice can change with batch and sequence length."""
    return [Technique(ad, "16", "adamw", "none", False, b) for ad in ("none", "lora", "qlora") for b in budgets]


def default_seq(model: ModelSpec, seq: Optional[int]) -> int:
    """The sequence the plan uses: ``seq`` if given (checked), else 2048 or the model's maximum."""
    if seq is None:
        return min(DEFAULT_SEQ, model.max_seq_len)
    if seq < 2:
        raise UserError(f"--seq must be at least 2, got {seq}")
    if seq > model.max_seq_len:
        raise UserError(f"--seq {seq} exceeds {model.name}'s maximum sequence length ({model.max_seq_len})")
    return seq


def check_one_gpu_flags(gpu: Optional[object], show_all: bool, compile_: bool, kernels: str = "none") -> None:
    """``--all`` and ``--compile`` are about the options on one GPU: an error without ``--gpu``
    (the CLI and the Python API both call this); so is ``--kernels`` (the multi-GPU search runs ZeRO-3 and
    tensor parallelism, which Liger is not modelled with: memcalc.core.liger)."""
    if gpu is None:
        if kernels != "none":
            raise UserError(f"plan --kernels {kernels} needs --gpu: the multi-GPU search uses ZeRO-3 and tensor "
                            "parallelism, which are not modelled with Liger")
        if show_all:
            raise UserError("--all lists the combinations that do not fit one GPU; give --gpu too")
        if compile_:
            raise UserError("--compile adds torch.compile options to the plan for one GPU; give --gpu too")


def plan_model(model: Optional[str], params: Optional[str]) -> tuple[ModelSpec, list[str]]:
    """The model ``plan`` is about: ``--model`` (preset, Hugging Face id or file) or ``--params`` (inferred);
    a note says where a model given by Hugging Face id came from."""
    from memcalc.inputs.infer import infer_params
    from memcalc.inputs.presets import resolve_model_source

    if model is not None and params is not None:  # ("" and 0 are given: refused below, not taken as absent)
        raise UserError("give one of --model or --params, not both")
    if model is not None:
        m, src = resolve_model_source(model)
        return m, ([f"model from {src.describe()}"] if src.kind not in ("preset", "file") else [])
    if params is not None:
        return infer_params(params)
    raise UserError("plan needs a model: give --model NAME|config.json or --params N (see `memcalc models`)")
