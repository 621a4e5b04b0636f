"""torchtune recipe YAML (``tune run <recipe> --config FILE``) -> Options.

The keys follow torchtune's recipes (recipes/full_finetune_single_device.py,
lora_finetune_single_device.py, full_finetune_distributed.py, lora_finetune_distributed.py):
``model._component_`` is a model builder (``torchtune.models.llama3_1.lora_llama3_1_8b``:
torchtune/models/llama3_1/_model_builders.py), the LoRA builders take ``lora_attn_modules``
(q_proj, k_proj, v_proj, output_proj), ``apply_lora_to_mlp`` (w1, w2, w3 = gate, down, up),
``apply_lora_to_output`` (the output head), ``lora_rank``, ``lora_alpha``, ``lora_dropout``,
``use_dora``, ``quantize_base`` (the ``qlora_`` builders set it: an NF4 base).
"""

from __future__ import annotations

from typing import Any

from memcalc.core.errors import UserError
from memcalc.inputs.data_files import clip
from memcalc.inputs.recipes.common import Reader, Recipe, bool_value, choice, float_value, int_value, optimizer_name

#: torchtune model builder (without its lora_/qlora_ prefix) -> memcalc preset (the same architecture:
#: torchtune/models/<family>/_model_builders.py against the preset's Hugging Face config.json).
TORCHTUNE_MODELS = {
    "llama2_7b": "llama-2-7b", "llama2_13b": "llama-2-13b", "llama2_70b": "llama-2-70b",
    "llama3_1_8b": "llama-3.1-8b", "llama3_1_70b": "llama-3.1-70b",
    "llama3_2_1b": "llama-3.2-1b", "llama3_2_3b": "llama-3.2-3b", "llama3_3_70b": "llama-3.3-70b",
    "mistral_7b": "mistral-7b",
    "qwen2_5_7b_base": "qwen2.5-7b", "qwen2_5_7b_instruct": "qwen2.5-7b",
    "qwen3_0_6b_base": "qwen3-0.6b", "qwen3_0_6b_instruct": "qwen3-0.6b",
    "qwen3_4b_base": "qwen3-4b", "qwen3_4b_instruct": "qwen3-4b",
    "qwen3_8b_base": "qwen3-8b", "qwen3_8b_instruct": "qwen3-8b",
    "qwen3_14b_base": "qwen3-14b", "qwen3_14b_instruct": "qwen3-14b", "qwen3_32b": "qwen3-32b",
    "gemma2_9b": "gemma-2-9b", "phi4_14b": "phi-4",
}

#: ``loss._component_`` -> (--loss, note)
TORCHTUNE_LOSSES = {
    "torchtune.modules.loss.CEWithChunkedOutputLoss": ("chunked", None),
    "torchtune.modules.loss.LinearCrossEntropyLoss": (
        "chunked", "loss LinearCrossEntropyLoss computes the output head chunk by chunk; memcalc models it as "
        "CEWithChunkedOutputLoss on a whole logits tensor (an over-estimate by about the logits: the head "
        "computed per chunk is not modelled yet)"),
    "torch.nn.CrossEntropyLoss": ("full", None),
}

LORA_ATTN = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "output_proj": "o"}
DTYPES = {"bf16": "bf16", "fp32": "fp32"}

#: keys that cannot change the memory of one training step
IGNORE = (
    "output_dir", "tokenizer.*", "checkpointer.*", "resume_from_checkpoint", "save_adapter_weights_only",
    "save_last_epoch_only", "epochs_to_save", "dataset._component_", "dataset.source", "dataset.split",
    "dataset.data_files", "dataset.column_map", "dataset.train_on_input", "dataset.new_system_prompt",
    "dataset.name", "dataset.conversation_*", "dataset.template", "dataset.filter_fn",
    "seed", "shuffle", "optimizer.lr", "optimizer.weight_decay", "optimizer.betas", "optimizer.eps",
    "optimizer.amsgrad", "lr_scheduler.*", "epochs", "max_steps_per_epoch", "clip_grad_norm", "metric_logger.*",
    "log_every_n_steps", "log_peak_memory_stats", "log_level", "device", "profiler.*", "low_cpu_ram",
    "model.lora_dropout", "run_val_every_n_steps", "dataset_val.*", "tokenizer", "save_every_n_steps",
)


def read(raw: dict[str, Any], rec: Recipe, src: str) -> None:
    r = Reader(raw, rec, src, IGNORE)
    r.set("framework", "torchtune", "(torchtune recipe)", "torchtune")
    comp = r.get("model._component_")
    if not isinstance(comp, str) or not comp.startswith("torchtune.models."):
        raise UserError(f"{src}:model._component_: expected a torchtune model builder "
                        f"(torchtune.models.llama3_1.lora_llama3_1_8b), got {clip(repr(comp))}")
    builder = comp.rsplit(".", 1)[-1]
    qlora = builder.startswith("qlora_")
    lora = qlora or builder.startswith("lora_")
    base = builder.removeprefix("qlora_").removeprefix("lora_")
    if base not in TORCHTUNE_MODELS:
        raise UserError(f"{src}:model._component_: no memcalc preset for torchtune's {clip(base, 60)}; known: "
                        f"{', '.join(TORCHTUNE_MODELS)} (or pass --model with a Hugging Face config.json)")
    r.set("model", TORCHTUNE_MODELS[base], "model._component_", comp)
    if lora:
        r.set("lora", True, "model._component_", comp)
        _lora(r, qlora)
    else:
        for k in ("lora_attn_modules", "lora_rank", "apply_lora_to_mlp"):
            if r.has(f"model.{k}"):
                raise UserError(f"{src}:model.{k}: a LoRA argument, but {builder} is a full model builder "
                                f"(use lora_{base})")
    if r.has("batch_size"):
        r.set("batch", int_value(r.get("batch_size"), f"{src}:batch_size"), "batch_size")
    _seq(r)
    if r.has("gradient_accumulation_steps"):
        r.set("grad_accum", int_value(r.get("gradient_accumulation_steps"), f"{src}:gradient_accumulation_steps"),
              "gradient_accumulation_steps")
    if r.has("enable_activation_checkpointing"):
        on = bool_value(r.get("enable_activation_checkpointing"), f"{src}:enable_activation_checkpointing")
        r.set("checkpoint", "full" if on else "none", "enable_activation_checkpointing", on)
    if r.has("enable_activation_offloading") and bool_value(r.get("enable_activation_offloading"),
                                                           f"{src}:enable_activation_offloading"):
        r.set("activation_offload", True, "enable_activation_offloading")
    if r.has("optimizer_in_bwd") and bool_value(r.get("optimizer_in_bwd"), f"{src}:optimizer_in_bwd"):
        accum = rec.values.get("grad_accum", 1)
        if accum > 1:  # torchtune full_finetune_*: "Gradient accumulation is not supported with optimizer in bwd"
            raise UserError(f"{src}: optimizer_in_bwd with gradient_accumulation_steps {accum}: torchtune refuses "
                            "it (the optimizer steps in backward, so gradients cannot accumulate); set one to 1")
        r.set("fused_optimizer", True, "optimizer_in_bwd")
    _optimizer(r)
    if r.has("dtype"):
        r.set("precision", choice(r.get("dtype"), DTYPES, f"{src}:dtype"), "dtype")
    if r.has("compile"):
        c = r.get("compile")
        if isinstance(c, dict):
            raise UserError(f"{src}:compile: expected true or false (per-module compile settings are not read)")
        if bool_value(c, f"{src}:compile"):
            r.set("compile", True, "compile")
    comp = r.get("loss._component_")
    if comp is not None:
        loss, note = choice(comp, TORCHTUNE_LOSSES, f"{src}:loss._component_")
        r.set("loss", loss, "loss._component_", comp)
        if note:
            rec.note(note)
        if r.has("loss.num_output_chunks"):
            r.set("loss_chunks", int_value(r.get("loss.num_output_chunks"), f"{src}:loss.num_output_chunks"),
                  "loss.num_output_chunks")
    _distributed(r)
    r.finish()


def _lora(r: Reader, qlora: bool) -> None:
    src = r.src
    mods = r.get("model.lora_attn_modules")
    targets: list[str] = []
    if mods is not None:
        if not isinstance(mods, list):
            raise UserError(f"{src}:model.lora_attn_modules: expected a list such as ['q_proj', 'v_proj']")
        targets = [choice(m, LORA_ATTN, f"{src}:model.lora_attn_modules") for m in mods]
    if r.has("model.apply_lora_to_mlp") and bool_value(r.get("model.apply_lora_to_mlp"), f"{src}:model.apply_lora_to_mlp"):
        targets += ["gate", "up", "down"]
    if r.has("model.apply_lora_to_output") and bool_value(r.get("model.apply_lora_to_output"),
                                                         f"{src}:model.apply_lora_to_output"):
        targets.append("head")
    if targets:
        r.set("lora_targets", ",".join(targets), "model.lora_attn_modules", mods)
    if r.has("model.lora_rank"):
        r.set("lora_rank", int_value(r.get("model.lora_rank"), f"{src}:model.lora_rank"), "model.lora_rank")
    if r.has("model.lora_alpha"):
        r.set("lora_alpha", float_value(r.get("model.lora_alpha"), f"{src}:model.lora_alpha"), "model.lora_alpha")
    if r.has("model.lora_dropout"):
        d = float_value(r.get("model.lora_dropout"), f"{src}:model.lora_dropout")
        if d:
            r.set("lora_dropout", d, "model.lora_dropout")
    if r.has("model.use_dora") and bool_value(r.get("model.use_dora"), f"{src}:model.use_dora"):
        r.set("dora", True, "model.use_dora")
    if qlora or (r.has("model.quantize_base") and bool_value(r.get("model.quantize_base"), f"{src}:model.quantize_base")):
        r.set("qlora", True, "model._component_" if qlora else "model.quantize_base")


def _seq(r: Reader) -> None:
    """``dataset.max_seq_len`` (a packed dataset's pack length), else ``tokenizer.max_seq_len``
    (torchtune truncates to it); ``null``: as long as the data's longest sample."""
    src = r.src
    ds = r.raw.get("dataset")
    packed = False
    for i, d in enumerate(ds if isinstance(ds, list) else [ds] if isinstance(ds, dict) else []):
        key = f"dataset[{i}]" if isinstance(ds, list) else "dataset"
        if isinstance(d, dict) and d.get("packed") is not None:
            packed = packed or bool_value(d.get("packed"), f"{src}:{key}.packed")
        if isinstance(d, dict) and d.get("max_seq_len") is not None:
            r.set("seq", int_value(d["max_seq_len"], f"{src}:{key}.max_seq_len"), f"{key}.max_seq_len")
    if isinstance(ds, list):
        r.read.add("dataset")  # each entry's other keys choose data, not memory
    else:
        r.get("dataset.packed")
        r.get("dataset.max_seq_len")
    tok = r.get("tokenizer.max_seq_len")
    if "seq" not in r.rec.values and tok is not None:
        r.set("seq", int_value(tok, f"{src}:tokenizer.max_seq_len"), "tokenizer.max_seq_len")
    if "seq" not in r.rec.values:
        r.rec.note("the recipe sets no max_seq_len (tokenizer.max_seq_len: null): batches are as long as the "
                   "longest sample; the estimate uses --seq (default 2048)")
    if packed:
        r.rec.note("packed: every sequence is filled to max_seq_len, so the estimate at that length is the "
                   "step's memory (without packing it is the worst case)")


def _optimizer(r: Reader) -> None:
    src = r.src
    comp = r.get("optimizer._component_")
    if comp is None:
        return
    name, _ = optimizer_name(r, "optimizer._component_", "class")
    if name == "sgd" and r.has("optimizer.momentum") and float_value(r.get("optimizer.momentum"), f"{src}:optimizer.momentum"):
        name = "sgd-momentum"
    r.get("optimizer.momentum")
    r.set("optimizer", name, "optimizer._component_", comp)
    if comp.startswith("torch.optim."):
        if r.has("optimizer.fused") and bool_value(r.get("optimizer.fused"), f"{src}:optimizer.fused"):
            r.set("optimizer_impl", "fused", "optimizer.fused", True)
        elif r.has("optimizer.foreach") and not bool_value(r.get("optimizer.foreach"), f"{src}:optimizer.foreach"):
            r.set("optimizer_impl", "for-loop", "optimizer.foreach", False)


def _distributed(r: Reader) -> None:
    """The distributed recipes shard with FSDP2 (``fully_shard`` per layer: ZeRO-3;
    ``fsdp_reshard_after_forward: False``: ZeRO-2); CPU offload of parameters is not modelled."""
    src = r.src
    keys = ("fsdp_cpu_offload", "fsdp_reshard_after_forward", "custom_sharded_layers", "data_parallel_shard_dim",
            "data_parallel_replicate_dim", "tensor_parallel_dim")
    if not any(k in r.raw for k in keys):
        return
    if r.has("fsdp_cpu_offload") and bool_value(r.get("fsdp_cpu_offload"), f"{src}:fsdp_cpu_offload"):
        raise UserError(f"{src}:fsdp_cpu_offload: FSDP parameter offload is not modelled; set it to False")
    reshard = bool_value(r.get("fsdp_reshard_after_forward", True), f"{src}:fsdp_reshard_after_forward")
    r.get("custom_sharded_layers")
    for k in ("data_parallel_replicate_dim", "tensor_parallel_dim"):
        if r.has(k) and r.get(k) not in (1, "1"):
            raise UserError(f"{src}:{k}: {r.get(k)}: only data-parallel sharding (FSDP2) is read from torchtune "
                            "recipes; give --tp for tensor parallelism")
    r.get("data_parallel_shard_dim")
    r.set("zero", 3 if reshard else 2, "fsdp_reshard_after_forward", reshard)
    r.set("sharding", "fsdp2", "(distributed recipe)", "fsdp2")
    r.rec.note("a distributed recipe: FSDP2 shards over the GPUs `tune run --nproc_per_node N` starts; give --gpus N")
