"""The rows whose validator peaks are recorded in ``recorded.json`` (``record.py`` writes it).

Each row is what ``memcalc validate`` would run (the DeepSpeed rows: what its tracer runs, see
:func:`cli_of`): its ``inputs`` are the command line's options
(:class:`memcalc.inputs.resolve.Options`, as ``memcalc.estimate(**inputs)`` takes them), its
``scale_layers`` is ``validate --scale-layers`` (the preset cut to that many layers: the layers
are alike, so a cut model shows the per-layer behaviour and traces in seconds), ``model`` holds
the few model fields no flag sets (the tensor-parallel rows' small widths, from tests/trace/test_tp.py),
and ``validator`` names the tracer the slow test of the same row calls:

- ``replica``: memcalc's PyTorch replica on meta (``memcalc.validate.runner.measure``)
- ``hf``: the real transformers + PEFT step on meta (``memcalc.validate.hf_runner.measure_hf``)
- ``fsdp``: rank 0 of FSDP2 / FSDP1 on the fake process group (``memcalc.validate.sharded.trace_rank``)
- ``tp``: rank 0 of torchtitan's tensor-parallel plan (``memcalc.validate.sharded.tp.measure_tp``)
- ``ep``: rank 0 of torchtitan's expert-parallel dispatcher (``memcalc.validate.sharded.expert_parallel.measure_ep``)
- ``deepspeed``: rank 0 of DeepSpeed's engine (``memcalc.validate.deepspeed_trace.trace_deepspeed``)
- ``torchtune``, ``litgpt``, ``trl``: the trainer's own step (``memcalc.validate.trainers.load(NAME).measure``,
  validate/trainers/NAME.py), estimated as ``--framework NAME`` resolves it (the trainer's profile rules and
  model, ``validate.record.trainer_estimator_spec``)

Every row is one of the slow tests' rows (scaled down where they run at more layers), and its
tolerance is that test's constant, named by :data:`TOLERANCES` (``tests/unit/test_recorded_traces.py``
checks the constant still has that value). torch.compile and memory budgets are not here: the
compiled step runs on CUDA only (on meta the validator checks the partition, not a peak).

Torch-free: the quick lane imports this.
"""

from __future__ import annotations

import ast
import os
from typing import Any

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)

#: tolerance key -> (percent, the slow test file, its constant); the percent must equal the constant
TOLERANCES: dict[str, tuple[float, str, str]] = {
    "replica": (3.0, "tests/trace/test_estimator_vs_trace.py", "TOLERANCE_PCT"),  # issue 3
    "family": (1.0, "tests/trace/test_family_activations_trace.py", "PRESET_TOLERANCE_PCT"),
    "moe_mla": (1.0, "tests/trace/test_moe_mla_trace.py", "TOLERANCE_PCT"),
    "technique": (3.0, "tests/trace/test_techniques_trace.py", "TOLERANCE_PCT"),
    "dora": (2.0, "tests/trace/test_techniques_trace.py", "DORA_TOLERANCE_PCT"),  # issue 14
    "hf_grid": (2.0, "tests/trace/test_hf_grid.py", "TOLERANCE_PCT"),  # issue 11
    "hf_family": (3.0, "tests/trace/test_hf_families_trace.py", "TOLERANCE_PCT"),  # issue 12
    "hf_qlora": (2.0, "tests/trace/test_qlora_grid.py", "TOLERANCE_PCT"),  # issue 28
    "fsdp": (2.0, "tests/trace/test_fsdp_grid.py", "TOLERANCE_PCT"),  # issue 13
    "tp": (3.0, "tests/trace/test_tp.py", "TOLERANCE_PCT"),  # issue 13
    "ep": (2.0, "tests/trace/test_expert_parallel.py", "TOLERANCE_PCT"),  # issue 31
    "deepspeed": (3.0, "tests/trace/test_deepspeed.py", "TOLERANCE_PCT"),  # issue 13
    "deepspeed_offload": (2.0, "tests/trace/test_deepspeed.py", "OFFLOAD_TOLERANCE_PCT"),  # issue 28
    "torchtune": (2.0, "tests/trace/test_torchtune_grid.py", "GRID_TOLERANCE_PCT"),  # issue 27
    "litgpt": (2.0, "tests/trace/test_litgpt_grid.py", "TOLERANCE_PCT"),  # issue 27
    "trl": (2.0, "tests/trace/test_trl_grid.py", "TOLERANCE_PCT"),  # issue 27
}

PLAIN = {"framework": "plain"}
#: the HF rows' profile: validate.hf_grid.HF_ESTIMATOR_PROFILE (hf_grid, hf_families_trace)
HF = {"framework": "hf", "profile": "hf-torch-2.8-cuda"}
BF16 = {"precision": "bf16"}
MIXED = {"precision": "bf16", "master_weights": True}
#: tests/trace/test_tp.py spec(): d_model 256, 8 heads, 4 kv heads, d_ff 704, vocabulary 1024
TP_MODEL = {"d_model": 256, "n_heads": 8, "n_kv_heads": 4, "d_ff": 704, "vocab_size": 1024, "max_seq_len": 4096}
#: validate/trainers/torchtune_grid.py MODELS: "gqa" (llama3_1's shape, untied head), "tied" (llama3_2's)
TT_GQA = {"d_model": 256, "n_heads": 8, "n_kv_heads": 2, "d_ff": 512, "vocab_size": 2048, "max_seq_len": 1024}
TT_TIED = {"d_model": 128, "n_heads": 4, "n_kv_heads": 4, "d_ff": 384, "vocab_size": 4096, "max_seq_len": 512}
#: validate/litgpt_grid.py MODELS: "llama" (GQA) and "phi" (parallel residual, 40% rotary, biases)
LIT_LLAMA = {"d_model": 256, "n_heads": 8, "n_kv_heads": 2, "d_ff": 704, "vocab_size": 4096, "max_seq_len": 1024}
LIT_PHI = {"d_model": 256, "n_heads": 8, "d_ff": 1024, "vocab_size": 4096, "max_seq_len": 1024,
           "activation": "gelu_tanh", "rotary_pct": 0.4}
#: tests/trace/test_trl_grid.py _model: width 128, 4 heads, vocabulary 2048
TRL_LLAMA = {"d_model": 128, "n_heads": 4, "n_kv_heads": 2, "d_ff": 256, "vocab_size": 2048, "max_seq_len": 1024}
TRL_QWEN = {"d_model": 128, "n_heads": 4, "n_kv_heads": 2, "d_ff": 384, "vocab_size": 2048, "max_seq_len": 1024}
TRL_GPT2 = {"d_model": 128, "n_heads": 4, "d_ff": 512, "vocab_size": 2048, "max_seq_len": 1024}


def _row(name: str, validator: str, tolerance: str, source: str, layers: int, fields: dict | None = None,
         **inputs: Any) -> dict[str, Any]:
    return {"name": name, "validator": validator, "inputs": inputs, "scale_layers": layers, "model": fields or {},
            "tolerance": tolerance, "source": source}


R, H, F, T, D, EP = "replica", "hf", "fsdp", "tp", "deepspeed", "ep"
TT, LIT, TRL = "torchtune", "litgpt", "trl"
DEEP = "tests/trace/test_validate_deep_one.py (config); tolerance: "
EVT, FAT, MMT, TET = ("tests/trace/test_estimator_vs_trace.py", "tests/trace/test_family_activations_trace.py",
                      "tests/trace/test_moe_mla_trace.py", "tests/trace/test_techniques_trace.py")
TTG, LTG, TRG = "tests/trace/test_torchtune_grid.py", "tests/trace/test_litgpt_grid.py", "tests/trace/test_trl_grid.py"
HFG, HFF, FSG, TPT, DST = ("tests/trace/test_hf_grid.py", "tests/trace/test_hf_families_trace.py",
                           "tests/trace/test_fsdp_grid.py", "tests/trace/test_tp.py", "tests/trace/test_deepspeed.py")
ALL7 = "q,k,v,o,gate,up,down"

ROWS: list[dict[str, Any]] = [
    # -- the reference configs (Forgather's Deep One, plain framework), cut to 2 layers
    _row("config-control", R, "replica", DEEP + EVT, 2, config="control"),
    _row("config-checkpoint", R, "replica", DEEP + EVT, 2, config="checkpoint"),
    _row("config-bfloat16", R, "replica", DEEP + EVT, 2, config="bfloat16"),
    _row("config-bf16-fused-chkpt", R, "replica", DEEP + EVT, 2, config="bf16_fused_chkpt"),
    # -- the replica: families, precisions, checkpointing policies, adapters, optimizers (test_estimator_vs_trace)
    _row("gpt2-fp32-dropout", R, "replica", EVT, 2, model="gpt2", batch=4, seq=512, **PLAIN),
    _row("gpt2-ckpt-full", R, "replica", EVT, 2, model="gpt2", batch=4, seq=1024, checkpoint="full", **PLAIN),
    _row("gpt2-xl-amp-fp16-lora-qkv", R, "replica", EVT, 2, model="gpt2-xl", batch=2, seq=256, precision="amp-fp16",
         lora=True, lora_rank=8, lora_targets="qkv", **PLAIN),
    _row("tinyllama-bf16", R, "replica", EVT, 2, model="tinyllama-1.1b", batch=4, seq=1024, **BF16, **PLAIN),
    _row("tinyllama-bf16-lora", R, "replica", EVT, 2, model="tinyllama-1.1b", batch=4, seq=1024, **BF16, lora=True,
         lora_rank=16, **PLAIN),
    _row("tinyllama-bf16-qlora", R, "replica", EVT, 2, model="tinyllama-1.1b", batch=4, seq=1024, **BF16, qlora=True,
         lora_rank=16, **PLAIN),
    _row("tinyllama-fp32-ckpt-sqrt", R, "replica", EVT, 4, model="tinyllama-1.1b", batch=2, seq=1024,
         checkpoint="sqrt", **PLAIN),
    _row("tinyllama-bf16-ckpt-selective", R, "replica", EVT, 2, model="tinyllama-1.1b", batch=4, seq=1024, **BF16,
         checkpoint="selective", **PLAIN),
    _row("tinyllama-bf16-ckpt-every-2", R, "replica", EVT, 4, model="tinyllama-1.1b", batch=2, seq=1024, **BF16,
         checkpoint="every-2", **PLAIN),
    _row("tinyllama-bf16-grad-accum-4", R, "replica", EVT, 2, model="tinyllama-1.1b", batch=4, seq=512, **BF16,
         grad_accum=4, **PLAIN),
    _row("llama-2-7b-qlora-r64-all-ckpt-full", R, "replica", EVT, 2, model="llama-2-7b", batch=2, seq=1024, **BF16,
         qlora=True, lora_rank=64, lora_targets=ALL7, checkpoint="full", **PLAIN),
    _row("llama-3.1-8b-bf16-master-weights", R, "replica", EVT, 2, model="llama-3.1-8b", batch=1, seq=256,
         **MIXED, **PLAIN),
    _row("llama-3.1-8b-adamw-8bit-ckpt-full", R, "replica", EVT, 2, model="llama-3.1-8b", batch=2, seq=512, **BF16,
         optimizer="adamw-8bit", checkpoint="full", **PLAIN),
    _row("mistral-7b-ckpt-full-fused-optimizer", R, "replica", EVT, 2, model="mistral-7b", batch=1, seq=512, **BF16,
         checkpoint="full", fused_optimizer=True, **PLAIN),
    _row("qwen2.5-7b-lora-ckpt-full", R, "replica", EVT, 2, model="qwen2.5-7b", batch=2, seq=512, **BF16, lora=True,
         lora_rank=16, checkpoint="full", **PLAIN),
    _row("phi-1.5-lion-ckpt-full", R, "replica", EVT, 2, model="phi-1.5", batch=4, seq=1024, **BF16,
         checkpoint="full", optimizer="lion", **PLAIN),
    _row("deep-one-amp-bf16-ckpt-full", R, "replica", EVT, 2, model="deep-one-1.6b", batch=4, seq=512,
         precision="amp-bf16", optimizer="adamw", checkpoint="full", **PLAIN),
    # -- the dense families beyond Llama (sliding windows, softcaps, q/k norms, fused projections), MoE and MLA
    _row("gemma-2-9b-bf16", R, "family", FAT, 2, model="gemma-2-9b", batch=1, seq=512, **BF16, **PLAIN),
    _row("gemma-3-1b-bf16-sliding", R, "family", FAT, 2, model="gemma-3-1b", batch=2, seq=1024, **BF16, **PLAIN),
    _row("qwen3-0.6b-ckpt-full", R, "family", FAT, 2, model="qwen3-0.6b", batch=2, seq=1024, **BF16,
         checkpoint="full", **PLAIN),
    _row("phi-4-lora-fused-qkv", R, "family", FAT, 2, model="phi-4", batch=1, seq=512, **BF16, lora=True,
         lora_rank=16, lora_targets="qkv,o", **PLAIN),
    _row("mixtral-8x7b-lora-experts", R, "moe_mla", MMT, 2, model="mixtral-8x7b", batch=1, seq=512, **BF16,
         lora=True, lora_rank=16, lora_targets=ALL7, **PLAIN),
    _row("deepseek-v3-mla-lora", R, "moe_mla", MMT, 4, model="deepseek-v3", batch=1, seq=512, **BF16, lora=True,
         lora_rank=16, lora_targets="q_a,q_b,kv_a,kv_b,o", **PLAIN),
    # -- techniques: activation offloading, paged optimizers, a LoRA head, DoRA (test_techniques_trace)
    _row("tinyllama-activation-offload", R, "technique", TET, 2, model="tinyllama-1.1b", batch=2, seq=512, **BF16,
         activation_offload=True, **PLAIN),
    _row("mistral-7b-qlora-amp-activation-offload", R, "technique", TET, 2, model="mistral-7b", batch=2, seq=512,
         precision="amp-bf16", qlora=True, lora_rank=16, activation_offload=True, **PLAIN),
    _row("tinyllama-paged-adamw-8bit", R, "technique", TET, 2, model="tinyllama-1.1b", batch=2, seq=512, **BF16,
         optimizer="paged-adamw-8bit", **PLAIN),
    _row("tinyllama-lora-head", R, "technique", TET, 2, model="tinyllama-1.1b", batch=2, seq=512, **BF16, lora=True,
         lora_rank=16, lora_targets="q,v,head", **PLAIN),
    _row("tinyllama-dora-dropout", R, "dora", TET, 2, model="tinyllama-1.1b", batch=2, seq=512, **BF16, dora=True,
         lora_rank=16, lora_targets=ALL7, lora_dropout=0.05, **PLAIN),
    _row("hf-tinyllama-dora", H, "dora", TET, 2, model="tinyllama-1.1b", batch=2, seq=512, **BF16, dora=True,
         lora_rank=16, lora_targets=ALL7, framework="hf"),
    # -- transformers + PEFT (test_hf_grid: 4 layers at full width; full, LoRA q,v and every projection)
    _row("hf-llama-3.1-8b-full-bf16", H, "hf_grid", HFG, 4, model="llama-3.1-8b", batch=4, seq=2048, **BF16, **HF),
    _row("hf-tinyllama-full-fp32", H, "hf_grid", HFG, 4, model="tinyllama-1.1b", batch=1, seq=2048, **HF),
    _row("hf-mistral-7b-lora-qv", H, "hf_grid", HFG, 4, model="mistral-7b", batch=2, seq=2048, **BF16, lora=True,
         lora_rank=16, lora_alpha=32, lora_targets="q,v", lora_dropout=0.0, **HF),
    _row("hf-qwen2.5-7b-lora-all-dropout-ckpt-full", H, "hf_grid", HFG, 4, model="qwen2.5-7b", batch=2, seq=1024,
         **BF16, checkpoint="full", lora=True, lora_rank=16, lora_alpha=32, lora_targets=ALL7, lora_dropout=0.05,
         **HF),
    _row("hf-gpt2-lora-qkv-fp32-ckpt-full", H, "hf_grid", HFG, 4, model="gpt2", batch=1, seq=512, checkpoint="full",
         lora=True, lora_rank=16, lora_alpha=32, lora_targets="qkv", lora_dropout=0.05, **HF),
    _row("hf-phi-1.5-lora-all-amp", H, "hf_grid", HFG, 4, model="phi-1.5", batch=1, seq=1024,
         precision="amp-bf16", lora=True, lora_rank=16, lora_alpha=32, lora_targets="q,k,v,o,up,down",
         lora_dropout=0.0, **HF),
    # -- QLoRA: bitsandbytes 4-bit base, prepare_model_for_kbit_training, PEFT LoRA (test_qlora_grid: 2 layers)
    _row("hf-llama-3.1-8b-qlora-all-amp-ckpt-full", H, "hf_qlora", "tests/trace/test_qlora_grid.py", 2,
         model="llama-3.1-8b", batch=2, seq=1024, precision="amp-bf16", checkpoint="full", qlora=True, lora_rank=64,
         lora_alpha=128, lora_targets=ALL7, lora_dropout=0.05, **HF),
    _row("hf-qwen2.5-7b-qlora-qv-bf16", H, "hf_qlora", "tests/trace/test_qlora_grid.py", 2, model="qwen2.5-7b",
         batch=1, seq=1024, **BF16, qlora=True, lora_rank=16, lora_alpha=32, lora_targets="q,v", lora_dropout=0.0,
         checkpoint="none", **HF),
    # -- transformers' own families from shipped config.json files (test_hf_families_trace)
    _row("hf-qwen3-0.6b-lora", H, "hf_family", HFF, 2, model="qwen3-0.6b", batch=1, seq=256, **BF16, lora=True,
         lora_rank=16, lora_alpha=32, lora_targets="all", **HF),
    _row("hf-gemma-3-1b-full", H, "hf_family", HFF, 2, model="gemma-3-1b", batch=1, seq=256, **BF16, **HF),
    _row("hf-mixtral-8x7b-lora", H, "hf_family", HFF, 2, model="mixtral-8x7b", batch=1, seq=256, **BF16, lora=True,
         lora_rank=16, lora_alpha=32, lora_targets="all", **HF),
    _row("hf-deepseek-v3-full", H, "hf_family", HFF, 4, model="deepseek-v3", batch=1, seq=256, **BF16, **HF),
    _row("hf-gpt-oss-20b-full", H, "hf_family", HFF, 2, model="gpt-oss-20b", batch=1, seq=256, **BF16, **HF),
    # -- FSDP2 and FSDP1, one rank (test_fsdp_grid: TinyLlama at 2 layers, batch 1 x 256)
    _row("fsdp2-fp32-zero3-2gpus", F, "fsdp", FSG, 2, model="tinyllama-1.1b", batch=1, seq=256, zero=3, gpus=2,
         **PLAIN),
    _row("fsdp2-bf16-zero2-4gpus", F, "fsdp", FSG, 2, model="tinyllama-1.1b", batch=1, seq=256, **BF16, zero=2,
         gpus=4, **PLAIN),
    _row("fsdp2-mixed-zero3-8gpus-ckpt-full", F, "fsdp", FSG, 2, model="tinyllama-1.1b", batch=1, seq=256, **MIXED,
         zero=3, gpus=8, checkpoint="full", **PLAIN),
    _row("fsdp2-mixed-zero3-4gpus-selective-op", F, "fsdp", FSG, 2, model="tinyllama-1.1b", batch=1, seq=256,
         **MIXED, zero=3, gpus=4, checkpoint="selective-op", **PLAIN),
    _row("fsdp2-bf16-zero3-4gpus-lora", F, "fsdp", FSG, 2, model="tinyllama-1.1b", batch=1, seq=256, **BF16, zero=3,
         gpus=4, lora=True, lora_rank=16, **PLAIN),
    _row("fsdp1-bf16-zero3-4gpus", F, "fsdp", FSG, 2, model="tinyllama-1.1b", batch=1, seq=256, **BF16, zero=3,
         gpus=4, sharding="fsdp1", **PLAIN),
    _row("fsdp1-fp32-zero2-3gpus", F, "fsdp", FSG, 2, model="tinyllama-1.1b", batch=1, seq=256, zero=2, gpus=3,
         sharding="fsdp1", **PLAIN),
    _row("fsdp1-gpt2-fp32-zero3-4gpus", F, "fsdp", FSG, 2, model="gpt2", batch=2, seq=256, zero=3, gpus=4,
         sharding="fsdp1", **PLAIN),
    # -- tensor parallelism, one rank (test_tp: small widths, batch 2 x 256)
    _row("tp2-fp32", T, "tp", TPT, 2, TP_MODEL, model="tinyllama-1.1b", batch=2, seq=256, tp=2, **PLAIN),
    _row("tp4-sp-bf16", T, "tp", TPT, 2, TP_MODEL, model="tinyllama-1.1b", batch=2, seq=256, tp=4,
         sequence_parallel=True, **BF16, **PLAIN),
    _row("tp2-sp-bf16-fsdp2-zero3-2d", T, "tp", TPT, 2, TP_MODEL, model="tinyllama-1.1b", batch=2, seq=256, tp=2,
         sequence_parallel=True, **BF16, gpus=2, zero=3, **PLAIN),
    # -- expert parallelism, one rank (test_expert_parallel: torchtitan's all-to-all dispatcher on the replica)
    _row("ep2-mixtral-bf16", EP, "ep", "tests/trace/test_expert_parallel.py", 2, model="mixtral-8x7b", batch=1,
         seq=1024, ep=2, gpus=2, **BF16, **PLAIN),
    _row("ep4-qwen3-moe-bf16-cf1.5", EP, "ep", "tests/trace/test_expert_parallel.py", 2, model="qwen3-30b-a3b",
         batch=1, seq=1024, ep=4, gpus=4, ep_capacity_factor=1.5, **BF16, **PLAIN),
    # -- DeepSpeed ZeRO-2/3, one rank (test_deepspeed); --deepspeed FILE as validate takes it (tests/traces/deepspeed/)
    _row("deepspeed-zero2-4gpus", D, "deepspeed", DST, 2, model="tinyllama-1.1b", seq=256, **MIXED, gpus=4, zero=2,
         deepspeed="tests/traces/deepspeed/zero2.json", **PLAIN),
    _row("deepspeed-zero2-bucket-2e7-8gpus", D, "deepspeed", DST, 2, model="tinyllama-1.1b", seq=256, **MIXED, gpus=8,
         zero=2, deepspeed="tests/traces/deepspeed/zero2_bucket_2e7.json", **PLAIN),
    _row("deepspeed-zero3-4gpus", D, "deepspeed", DST, 2, model="tinyllama-1.1b", seq=256, **MIXED, gpus=4, zero=3,
         deepspeed="tests/traces/deepspeed/zero3.json", **PLAIN),
    _row("deepspeed-zero3-reuse-0-2gpus-ckpt-full", D, "deepspeed", DST, 3, model="tinyllama-1.1b", seq=512, **MIXED,
         gpus=2, zero=3, checkpoint="full", deepspeed="tests/traces/deepspeed/zero3_reuse_0.json", **PLAIN),
    _row("deepspeed-zero2-gpt2-4gpus", D, "deepspeed", DST, 2, model="gpt2", seq=256, **MIXED, gpus=4, zero=2,
         deepspeed="tests/traces/deepspeed/zero2.json", **PLAIN),
    # one GPU is DeepSpeed's engine too (issue 28): the flat fp32 partition, the bucket and the gradient partition
    _row("deepspeed-zero2-gpt2-1gpu-bucket-1e7", D, "deepspeed", DST, 2, model="gpt2", seq=256, **MIXED, gpus=1,
         zero=2, deepspeed="tests/traces/deepspeed/zero2_bucket_1e7.json", **PLAIN),
    # offload_param on one GPU (issue 28): the 16-bit partitions pinned on the host, each gather a host-to-GPU copy
    _row("deepspeed-zero3-gpt2-1gpu-offload-param", D, "deepspeed_offload", DST, 2, model="gpt2", seq=256, **MIXED,
         gpus=1, zero=3, deepspeed="tests/traces/deepspeed/zero3_offload_param.json", **PLAIN),
    # -- torchtune 0.6.1's own step (test_torchtune_grid: its gqa and tied models, 2 and 1 layers)
    _row("torchtune-gqa-lora-qv-chunked-ckpt-full", TT, "torchtune", TTG, 2, TT_GQA, model="llama-3.1-8b", batch=2,
         seq=256, **BF16, lora=True, lora_rank=8, lora_alpha=16, lora_targets="q,v", checkpoint="full",
         loss="chunked", framework="torchtune"),
    _row("torchtune-gqa-qlora-all-chunked", TT, "torchtune", TTG, 2, TT_GQA, model="llama-3.1-8b", batch=2, seq=256,
         **BF16, qlora=True, lora_rank=8, lora_alpha=16, lora_targets=ALL7, loss="chunked", framework="torchtune"),
    _row("torchtune-tied-full-loss-full", TT, "torchtune", TTG, 1, TT_TIED, model="llama-3.2-1b", batch=2, seq=256,
         **BF16, loss="full", framework="torchtune"),
    # -- LitGPT 0.5.13's own step (test_litgpt_grid: its Llama-like and phi shapes, 2 layers)
    _row("litgpt-llama-lora-qv-bf16", LIT, "litgpt", LTG, 2, LIT_LLAMA, model="llama-3.1-8b", batch=1, seq=320,
         **BF16, lora=True, lora_rank=8, lora_alpha=16, lora_targets="q,v", framework="litgpt"),
    _row("litgpt-llama-full-bf16-ckpt-full", LIT, "litgpt", LTG, 2, LIT_LLAMA, model="llama-3.1-8b", batch=2,
         seq=100, **BF16, checkpoint="full", framework="litgpt"),
    _row("litgpt-phi-lora-o-up-down-amp", LIT, "litgpt", LTG, 2, LIT_PHI, model="phi-1.5", batch=2, seq=100,
         precision="amp-bf16", lora=True, lora_rank=8, lora_alpha=16, lora_targets="o,up,down", framework="litgpt"),
    # -- TRL 1.16's SFT step with its fused head (test_trl_grid: Llama-, Qwen2- and GPT-2-shaped, 2 layers)
    _row("trl-tinyllama-lora-qv-ckpt-full-tok-0.1", TRL, "trl", TRG, 2, TRL_LLAMA, model="tinyllama-1.1b", batch=2,
         seq=128, **BF16, lora=True, lora_rank=8, lora_alpha=16, lora_targets="q,v", lora_dropout=0.0,
         checkpoint="full", loss_tokens=0.1, framework="trl"),
    _row("trl-qwen2.5-lora-all-tok-0.5", TRL, "trl", TRG, 2, TRL_QWEN, model="qwen2.5-7b", batch=4, seq=64, **BF16,
         lora=True, lora_rank=8, lora_alpha=16, lora_targets=ALL7, lora_dropout=0.0, loss_tokens=0.5,
         checkpoint="none", framework="trl"),
    _row("trl-gpt2-full-tok-1", TRL, "trl", TRG, 2, TRL_GPT2, model="gpt2", batch=2, seq=256, **BF16, loss_tokens=1.0,
         checkpoint="none", framework="trl"),
    _row("trl-qwen2.5-qlora-all-ckpt-full-tok-0.5", TRL, "trl", TRG, 2, TRL_QWEN, model="qwen2.5-7b", batch=2,
         seq=128, **BF16, qlora=True, lora_rank=8, lora_alpha=16, lora_targets=ALL7, lora_dropout=0.0,
         checkpoint="full", loss_tokens=0.5, framework="trl"),
]


def spec_of(row: dict[str, Any]):
    """The ExperimentSpec of a row: its inputs resolved as the command line resolves its flags
    (``memcalc.options_from`` + ``resolve``), the model cut to ``scale_layers`` (as ``validate
    --scale-layers`` cuts it) with the row's ``model`` fields. A ``deepspeed`` config path is relative to the
    repository's root (the command line's working directory in ``cli``)."""
    from memcalc.api import options_from
    from memcalc.inputs.resolve import resolve

    inputs = dict(row["inputs"])
    if inputs.get("deepspeed"):  # a DeepSpeed config under tests/traces/deepspeed/, named from the repository's root
        inputs["deepspeed"] = os.path.join(REPO, inputs["deepspeed"])
    exp = resolve(options_from(**inputs)).exp
    model = exp.model.model_copy(update={**row["model"], "n_layers": row["scale_layers"]})
    return exp.model_copy(update={"model": model})


def cli_of(row: dict[str, Any]) -> str | None:
    """The ``memcalc validate`` command line of a row; None when a model field has no flag (the
    tensor-parallel rows) or validate's command line refuses the setup: it stops a DeepSpeed step at
    its sharded checks (``validate.sharded.check_sharded``), so the DeepSpeed rows are traced by
    ``trace_deepspeed`` directly, as tests/trace/test_deepspeed.py does (their options are ``memcalc
    estimate``'s all the same)."""
    if row["model"] or row["validator"] == "deepspeed":
        return None
    words = ["memcalc", "validate"]
    for k, v in row["inputs"].items():
        flag = "--" + k.replace("_", "-")
        words += [flag] if v is True else [flag, str(v)]
    return " ".join([*words, "--scale-layers", str(row["scale_layers"]), "--device", "meta"])


def tolerance_constant(key: str) -> float:
    """The value of the slow test's constant that ``TOLERANCES[key]`` names, read from its source."""
    _pct, path, name = TOLERANCES[key]
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        targets = ([node.target] if isinstance(node, ast.AnnAssign) else node.targets if isinstance(node, ast.Assign)
                   else [])
        if any(isinstance(t, ast.Name) and t.id == name for t in targets) and node.value is not None:
            return float(ast.literal_eval(node.value))
    raise LookupError(f"{path} has no {name}")
