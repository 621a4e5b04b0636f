"""What the commands share: the options several commands take, each once, as a reusable
``Annotated`` type (``model: Model = None``), with the choices from the registries and the spec's
vocabularies, and the check of an output path.

Pydantic-free: the choices come from :mod:`memcalc.core.choices` and
:mod:`memcalc.core.optimizers`, not from the spec models.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

import typer

from memcalc.core.choices import FRAMEWORKS, KERNEL_LIBRARIES, LORA_DTYPES, LOSSES, PRECISIONS
from memcalc.core.optimizers import IMPLS, OPTIMIZER_NAMES, OPTIMIZERS
from memcalc.core.aliases import alias_help

# -- shared options (a flag is declared by its one name: --lora, not typer's --lora/--no-lora) -----
# (a choice is a Literal of the registry's tuple: built at run time, which mypy does not accept)
Model = Annotated[Optional[str], typer.Option(
    "--model", "-m", help="Preset name (see `memcalc models`), a Hugging Face id ORG/NAME (a preset with that id, "
                          "else config.json from the local Hugging Face cache, else fetched from the Hub unless "
                          "HF_HUB_OFFLINE=1), or a path to a Hugging Face config.json or a model spec YAML/JSON.")]
Params = Annotated[Optional[str], typer.Option(
    "--params", help="Infer a Llama-style decoder with about this many parameters (7e9, 7B, 350M), or a mixture of "
                     "experts as TOTAL-A<ACTIVE> (30B-A3B: top-8 routing, balanced).")]
Config = Annotated[Optional[str], typer.Option(
    "--config", "-c", help="A reference config name (see `memcalc configs`) or an experiment YAML/JSON; flags "
                           "override it.")]
Batch = Annotated[Optional[int], typer.Option("--batch", "-b", help="Micro-batch size (default 1).")]
Seq = Annotated[Optional[str], typer.Option(
    "--seq", "-s", metavar="<int>", help="Sequence length in tokens (default 2048, or the model's maximum if "
                                           "smaller); 4k = 4,096, 32k = 32,768, 128k = 131,072, 1M = 1,048,576 "
                                           "(k = 1024 tokens, as model cards and trainer configs mean it).")]
GradAccum = Annotated[Optional[int], typer.Option(
    "--grad-accum", help="Gradient-accumulation micro-steps (default 1).")]
Precision = Annotated[Optional[str], typer.Option(
    "--precision", metavar="<" + "|".join(PRECISIONS) + ">",
    help="fp32 | bf16 | fp16 (pure 16-bit) | amp-bf16 | amp-fp16 (autocast over fp32 weights). "
                        "Default: bf16 with --lora/--qlora (a bf16 base; QLoRA computes in bf16), else fp32 (what "
                        "Hugging Face Trainer runs without --bf16), or the --config's. " + alias_help("precision"))]
Bf16 = Annotated[bool, typer.Option(
    "--bf16", help="Short for --precision bf16: weights, grads and optimizer state all bf16.")]
MasterWeights = Annotated[bool, typer.Option(
    "--master-weights", help="16-bit weights and grads + fp32 master weights and moments (16 bytes/param with "
                             "Adam).")]
Optimizer = Annotated[Optional[str], typer.Option(
    "--optimizer", metavar="<" + "|".join(OPTIMIZER_NAMES) + ">", help="Optimizer (default adamw): " + "; ".join(
    f"{r.name} = {r.help}" for r in OPTIMIZERS.values()) + ". " + alias_help("optimizer"))]
OptimizerImpl = Annotated[Optional[Literal[IMPLS]], typer.Option(  # type: ignore[valid-type]
    "--optimizer-impl", help="Optimizer implementation (default foreach, CUDA's default): " + "; ".join(
    f"{r.name}: {', '.join(r.impls)}" for r in OPTIMIZERS.values() if r.impls != IMPLS) + "; the others: all.")]
GaloreRank = Annotated[Optional[int], typer.Option(
    "--galore-rank", help="With --optimizer galore-adamw: the projection rank r (default 128, transformers' "
                          "optim_args rank).")]
Checkpoint = Annotated[Optional[str], typer.Option(
    "--checkpoint", help="none | full | every-K (e.g. every-2) | sqrt | selective | selective-op (torchtitan).")]
Reentrant = Annotated[bool, typer.Option(
    "--reentrant", help="With --checkpoint: torch's reentrant checkpoint (use_reentrant=True), as PEFT's "
                        "prepare_model_for_kbit_training turns it on (the default for --qlora on hf without "
                        "--checkpoint).")]
FusedOptimizer = Annotated[bool, typer.Option(
    "--fused-optimizer", help="Step the optimizer in post-accumulate-grad hooks during backward.")]
Compile = Annotated[bool, typer.Option("--compile", help="torch.compile the model.")]
MemoryBudget = Annotated[Optional[float], typer.Option(
    "--memory-budget", help="torch.compile activation_memory_budget in [0, 1] (implies --compile).")]
CompileScope = Annotated[Optional[str], typer.Option(
    "--compile-scope",
    help="What one torch.compile graph is: model (the whole forward with its loss; model.compile(), the default), "
         "logits (the forward up to the logits, the loss eager after it) or layer (each "
         "decoder layer apart, the head eager, the loss compiled apart: torchtune's compile_model + compile_loss; the "
         "default with --framework torchtune). Implies --compile.")]
Lora = Annotated[bool, typer.Option(
    "--lora", help="LoRA adapters on a frozen base (default rank 16, alpha 32, targets q,k,v,o).")]
LoraRank = Annotated[Optional[int], typer.Option("--lora-rank", help="LoRA rank, 1 to 65,536.")]
LoraAlpha = Annotated[Optional[float], typer.Option("--lora-alpha", help="LoRA alpha.")]
LoraTargets = Annotated[Optional[str], typer.Option(
    "--lora-targets", help="Comma-separated from q,k,v,o,gate,up,down (or PEFT's q_proj, ..., down_proj); qkv / "
                           "gate_up on fused projections (c_attn, qkv_proj, query_key_value, gate_up_proj), "
                           "q_a,q_b,kv_a,kv_b on MLA, experts on MoE; or all (every projection the model has). "
                           "Default: the attention projections.")]
LoraDropout = Annotated[Optional[float], typer.Option("--lora-dropout", help="Dropout on the adapter input.")]
Qlora = Annotated[bool, typer.Option("--qlora", help="QLoRA: LoRA over a 4-bit NF4 frozen base.")]
Quant = Annotated[Optional[str], typer.Option(
    "--quant", help="gptq | awq: LoRA over a GPTQ / AWQ 4-bit base (group 128, gptqmodel's torch training kernel; "
                    "read from source, validate cannot trace it without CUDA; implies --lora).")]
ModulesToSave = Annotated[Optional[str], typer.Option(
    "--modules-to-save", help="PEFT modules_to_save beside LoRA: embed_tokens, lm_head (comma-separated; each trained "
    "whole as a copy, the frozen original kept; implies --lora).")]
LoraDtype = Annotated[Optional[Literal[LORA_DTYPES]], typer.Option(  # type: ignore[valid-type]
    "--lora-dtype", help="LoRA adapter dtype (weights, grads, optimizer state): fp32, or model (the base's). "
                         "Default: the framework's (hf: fp32, PEFT's autocast_adapter_dtype=True; plain, "
                         "torchtune, litgpt: model).")]
Profile = Annotated[Optional[str], typer.Option(
    "--profile", help="Kernel profile by name (see `memcalc profiles`): a (framework, PyTorch version) pair; "
                      "--framework/--torch replace that part of it. Default: the --config's profile "
                      "(torch-2.8-cuda, plain, for the reference configs), else hf-torch-2.8-cuda.")]
Framework = Annotated[Optional[str], typer.Option(
    "--framework", metavar="<" + "|".join(FRAMEWORKS) + ">",
    help="Whose layer code runs the model: hf (transformers 5.x + PEFT), torchtune, litgpt, or plain (memcalc's own "
         "PyTorch replica). Default: plain for a --config (the reference configs), hf for --model and --params (most "
         "users run transformers + PEFT). Replaces the framework of --profile/--config's profile. "
         + alias_help("framework"))]
Torch = Annotated[Optional[str], typer.Option(
    "--torch", help="PyTorch version whose kernels run (major.minor, 2.1 to 2.13; default 2.8, or the profile's). "
                    "Replaces the version of --profile/--config's profile.")]
Loss = Annotated[Optional[Literal[LOSSES]], typer.Option(  # type: ignore[valid-type]
    "--loss", help="Cross-entropy: full, or chunked (the logits rows in --loss-chunks pieces, each upcast to fp32 "
                   "on its own, as torchtune's CEWithChunkedOutputLoss), or trl-fused (TRL's fused LM head on the "
                   "--loss-tokens only, no logits); overrides the profile.")]
Kernels = Annotated[Optional[Literal[KERNEL_LIBRARIES]], typer.Option(  # type: ignore[valid-type]
    "--kernels", help="A kernel library that replaces the model's layers, as transformers' Trainer applies it "
                      "(use_liger_kernel): none (default) or liger (Liger-Kernel's fused linear cross-entropy, "
                      "RMSNorm, SwiGLU/GeGLU and RoPE for Llama, Mistral, Qwen2 and Gemma; --framework hf or trl) "
                      "or cce (Apple's Cut Cross-Entropy on the head and loss, as its cce_patch applies it: Llama, "
                      "Mistral, Phi-3; --framework hf; axolotl's cut_cross_entropy).")]
LossChunks = Annotated[Optional[int], typer.Option(
    "--loss-chunks", help="Chunks of --loss chunked (default 8, at most 1,048,576); overrides the profile.")]
LossTokens = Annotated[Optional[float], typer.Option(
    "--loss-tokens", help="With --framework trl (--loss trl-fused): the fraction (0 to 1] of next-token positions "
                          "whose label is not -100 (completion-only / assistant-only masks, padding); only those "
                          "reach TRL's fused head (default 1).")]
Json = Annotated[bool, typer.Option("--json", help="Print only JSON (integer bytes).")]
Zero = Annotated[Optional[int], typer.Option(
    "--zero", help="ZeRO stage 0-3 (1: optimizer state, 2: + gradients, 3: + weights sharded over --gpus).")]
Gpus = Annotated[Optional[int], typer.Option(
    "--gpus", help="Data-parallel replicas (default 1), which ZeRO shards over; with --tp/--cp/--pp each replica "
                   "is a tp x cp x pp group: GPUs in all = --gpus x --tp x --cp x --pp (32 GPUs of context "
                   "parallelism: --cp 32 --gpus 1, not --gpus 32 --cp 32, which is 1,024).")]
OffloadOptimizer = Annotated[bool, typer.Option(
    "--offload-optimizer", help="Keep optimizer state and its step on the CPU.")]
Sharding = Annotated[Optional[str], typer.Option(
    "--sharding", help="How --zero runs over --gpus: fsdp2 (default; fully_shard per layer and root, --zero 3 "
                       "reshards after forward, --zero 2 does not), fsdp1, or deepspeed.")]
Deepspeed = Annotated[Optional[str], typer.Option(
    "--deepspeed", help="A DeepSpeed config (ds_config.json): sharding deepspeed with its ZeRO stage (2 or 3), "
                        "buckets, prefetch limits, bf16/fp16, micro-batch and accumulation; \"auto\" values as "
                        "Hugging Face fills them.")]
Tp = Annotated[Optional[int], typer.Option(
    "--tp", help="Tensor-parallel degree (Megatron-style column/row parallel linears); GPUs in all = --gpus x "
                 "--tp.")]
Ep = Annotated[Optional[int], typer.Option(
    "--ep", help="Expert-parallel degree (MoE models): the routed experts split over --ep of the --gpus "
                 "data-parallel GPUs, tokens exchanged by all-to-all (torchtitan's dispatcher).")]
EpCapacityFactor = Annotated[Optional[float], typer.Option(
    "--ep-capacity-factor", help="With --ep: rows a rank receives for its experts over the rows it sends; 1.0 "
                                 "(default) = the even split, larger = the busiest rank of an imbalanced routing.")]
Cp = Annotated[Optional[int], typer.Option(
    "--cp", help="Context-parallel degree: the sequence split over --cp ranks (ring attention or Ulysses, "
                 "--cp-method); GPUs in all = --gpus x --tp x --cp.")]
CpMethod = Annotated[Optional[str], typer.Option(
    "--cp-method", help="With --cp: ring (torch's context_parallel as torchtitan applies it; default) or ulysses "
                        "(DeepSpeed's DistributedAttention all-to-all).")]
Pp = Annotated[Optional[int], typer.Option(
    "--pp", help="Pipeline-parallel degree: the layers split into --pp stages (torch.distributed.pipelining; "
                 "torchtitan's split: --pp-first-stage-less-layers); the worst rank is reported; --gpus N with "
                 "--zero 2/3 shards each stage by FSDP2. GPUs in all = --gpus x --tp x --pp.")]
PpSchedule = Annotated[Optional[str], typer.Option(
    "--pp-schedule", help="With --pp: gpipe (ScheduleGPipe), 1f1b (Schedule1F1B, the default), interleaved-1f1b "
                          "(ScheduleInterleaved1F1B), zero-bubble (ScheduleInterleavedZeroBubble) or zbv-zero-bubble "
                          "(ScheduleZBVZeroBubble, torchtitan's ZBVZeroBubble: 2 stages per rank in a V).")]
PpStagesPerRank = Annotated[Optional[int], typer.Option(
    "--pp-stages-per-rank", help="With --pp: stages each rank holds, looped over the ranks (torchtitan's "
                                 "stages_per_rank; default 1, 2 for the multi-stage schedules, which zbv-zero-bubble "
                                 "places in a V).")]
PpFirstLess = Annotated[Optional[int], typer.Option(
    "--pp-first-stage-less-layers", help="With --pp: decoder layers fewer on the first stage for its embedding "
    "(torchtitan's pipeline_parallel_first_stage_less_layers; default 1, as torchtitan: 32 layers over 4 stages "
    "split 8, 9, 8, 7). 0 with --pp-last-stage-less-layers 0: the even split where --pp divides the layers, "
    "as Megatron-LM splits them.")]
PpLastLess = Annotated[Optional[int], typer.Option(
    "--pp-last-stage-less-layers", help="With --pp: decoder layers fewer on the last stage for its final norm "
    "and head (torchtitan's pipeline_parallel_last_stage_less_layers; default 1).")]
FirstSeq = Annotated[Optional[int], typer.Option(
    "--first-seq", metavar="<int>", help="Tokens per sequence of the run's first micro-batch, where the trainer runs "
    "it apart (lit-gpt's finetune/lora.py before LitGPT 0.4 runs the longest sample first): that micro-step runs "
    "with nothing of an earlier one alive; --seq is then the longest later micro-batch. Default: --seq.")]
Microbatches = Annotated[Optional[int], typer.Option(
    "--microbatches", help="With --pp: micro-batches per step; --batch is split into them (default: --pp).")]
SequenceParallel = Annotated[bool, typer.Option(
    "--sequence-parallel", help="With --tp: norms and dropout on sequence shards.")]
ActivationOffload = Annotated[bool, typer.Option(
    "--activation-offload", help="Saved activations go to host memory in forward and come back for backward "
                                 "(torchtune's OffloadActivations); the host memory is reported.")]
Recipe = Annotated[Optional[list[str]], typer.Option(
    "--recipe", metavar="<str>", help="A training setup file: a torchtune recipe YAML, Hugging Face "
                                      "TrainingArguments / TRL SFTConfig (JSON or YAML), an axolotl YAML or a "
                                      "LitGPT config; repeat it to add a PEFT adapter_config.json. Its "
                                      "memory-relevant keys set the inputs (origin: recipe FILE:KEY); flags "
                                      "override them; keys that do not affect memory are listed as ignored.")]
AdapterConfig = Annotated[Optional[str], typer.Option(
    "--adapter-config", help="A PEFT adapter_config.json (LoraConfig) for a Hugging Face / TRL or axolotl "
                             "--recipe, or on its own with --model.")]
NoDoubleQuant = Annotated[bool, typer.Option(
    "--no-double-quant", help="QLoRA without double quantisation: bitsandbytes keeps each 64-weight block's "
                              "absmax in fp32 (compress_statistics=False: bnb_4bit_use_double_quant=False, LitGPT's "
                              "--quantize bnb.nf4 rather than bnb.nf4-dq), 0.5 bit per weight beside the 4 where "
                              "double quantisation keeps about 0.13.")]
BnbSavesInput = Annotated[bool, typer.Option(
    "--bnb-saves-input", help="QLoRA on bitsandbytes before 0.43.2 (LitGPT 0.4's 0.41/0.42): each 4-bit linear "
                              "keeps its input on its ctx (MatMul4Bit ctx.tensors = (A, B)), alive as long as the "
                              "graph (LitGPT's fit: until the next forward returns), and dequantizes to fp16 "
                              "before the cast to the compute dtype.")]
Dora = Annotated[bool, typer.Option(
    "--dora", help="DoRA (PEFT use_dora=True): LoRA plus a trainable magnitude vector per target (implies --lora).")]


Force = Annotated[bool, typer.Option(
    "--force", help="Replace an existing --html / --output / --snapshot file that memcalc did not write.")]

def _check_output(path: Optional[str], flag: str, force: bool = False) -> None:
    """An output file that cannot or should not be written is a one-line error before any work starts
    (:func:`memcalc.core.files.check_output_path`, the API's ``measure(output=)`` check too)."""
    from memcalc.core.files import check_output_path

    check_output_path(path, flag, force)


def inputs_of(values: dict[str, Any], own: tuple[str, ...]) -> dict[str, Any]:
    """A command's parsed options less its own (``own``): the experiment's inputs, named as the API
    takes them; a repeatable option given no times is None, "not given", as every other option."""
    return {k: (list(v) or None) if isinstance(v, (list, tuple)) else v for k, v in values.items() if k not in own}
