"""LitGPT fine-tuning YAML (``litgpt finetune lora --config FILE``; config_hub/finetune/...) -> Options.

Keys follow litgpt/finetune/lora.py ``setup`` and litgpt/args.py ``TrainArgs``: ``checkpoint_dir``
(checkpoints/ORG/NAME: the Hugging Face id), ``precision`` (Lightning Fabric: bf16-true, bf16-mixed,
16-true, 16-mixed, 32-true), ``quantize`` (bnb.nf4, bnb.nf4-dq: QLoRA; bnb.nf4 without double quantisation),
``devices`` and ``num_nodes``,
``lora_r``/``lora_alpha``/``lora_dropout``, ``lora_query``/``key``/``value``/``projection``/``mlp``/
``head``, ``train.micro_batch_size``, ``train.global_batch_size`` (accumulation = global batch /
(devices x nodes) / micro batch, litgpt/args.py ``gradient_accumulation_iters``),
``train.max_seq_length``, ``optimizer`` (a name or a ``class_path``). With more than one device LitGPT
shards with FSDP (``FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block})``):
ZeRO-3, fsdp1, every block checkpointed.
"""

from __future__ import annotations

from typing import Any

from memcalc.core.errors import UserError
from memcalc.inputs.data_files import clip
from memcalc.inputs.recipes.common import (Reader, Recipe, bool_value, choice, float_value, int_value, model_for_hub_id,
                                           optimizer_name)

PRECISIONS = {"bf16-true": "bf16", "bf16-mixed": "amp-bf16", "16-true": "fp16", "16-mixed": "amp-fp16",
              "32-true": "fp32", "32": "fp32", "bf16": "bf16"}
QUANTIZE = {"bnb.nf4": "nf4", "bnb.nf4-dq": "nf4-dq"}
#: lora_<part> -> memcalc targets (LitGPT's defaults: query and value on)
PARTS = {"lora_query": ("q",), "lora_key": ("k",), "lora_value": ("v",), "lora_projection": ("o",),
         "lora_mlp": ("gate", "up", "down"), "lora_head": ("head",)}
DEFAULT_PARTS = {"lora_query": True, "lora_value": True}

IGNORE = (
    "out_dir", "data.*", "train.save_interval", "train.log_interval", "train.lr_warmup_steps",
    "train.lr_warmup_fraction", "train.epochs", "train.max_tokens", "train.max_steps", "train.max_norm",
    "train.min_lr", "train.tie_embeddings", "eval.*", "logger_name", "seed", "optimizer.init_args.*",
    "access_token", "resume", "log.*",
)


def read(raw: dict[str, Any], rec: Recipe, src: str) -> None:
    r = Reader(raw, rec, src, IGNORE)
    r.set("framework", "litgpt", "(LitGPT config)", "litgpt")
    ckpt = r.get("checkpoint_dir")
    if ckpt is not None:
        parts = [p for p in str(ckpt).replace("\\", "/").split("/") if p]
        if len(parts) < 2:
            raise UserError(f"{src}:checkpoint_dir: expected checkpoints/ORG/NAME, got {clip(repr(ckpt))}")
        hub_id = "/".join(parts[-2:])
        r.set("model", model_for_hub_id(hub_id, f"{src}:checkpoint_dir", rec), "checkpoint_dir", ckpt)
    elif r.has("model_name"):  # older configs: a LitGPT model name (litgpt/config.py), e.g. Llama-3.2-1B
        name = str(r.get("model_name"))
        r.set("model", model_for_hub_id(name, f"{src}:model_name", rec), "model_name", name)
    if r.has("precision"):
        r.set("precision", choice(r.get("precision"), PRECISIONS, f"{src}:precision"), "precision", r.get("precision"))
    quant = r.get("quantize")
    lora = any(k in raw for k in ("lora_r", *PARTS))
    if quant is not None:
        q = choice(quant, QUANTIZE, f"{src}:quantize")
        if not lora:
            raise UserError(f"{src}:quantize: a quantized base is trained only with LoRA (litgpt finetune lora)")
        r.set("qlora", True, "quantize", quant)
        if q == "nf4":  # lightning/fabric/plugins/precision/bitsandbytes.py _NF4Linear: compress_statistics=False
            r.set("no_double_quant", True, "quantize", quant)
    devices = r.get("devices", 1)
    nodes = r.get("num_nodes", 1)
    if devices in ("auto", -1, "-1"):
        raise UserError(f"{src}:devices: {devices!r}: give the number of GPUs")
    gpus = int_value(devices, f"{src}:devices") * int_value(nodes, f"{src}:num_nodes")
    micro = int_value(r.get("train.micro_batch_size", 4), f"{src}:train.micro_batch_size")
    r.set("batch", micro, "train.micro_batch_size" if r.has("train.micro_batch_size") else
          "train.micro_batch_size (TrainArgs default)")
    glob = r.get("train.global_batch_size")
    if glob is not None:
        g = int_value(glob, f"{src}:train.global_batch_size")
        per_rank = g // gpus  # litgpt/args.py: batch_size(devices) = global_batch_size // devices
        if per_rank // micro < 1:  # gradient_accumulation_iters asserts > 0
            raise UserError(f"{src}:train.global_batch_size {g}: per device {g} // {gpus} = {per_rank}, less than "
                            f"train.micro_batch_size {micro}")
        r.set("grad_accum", per_rank // micro, "train.global_batch_size", g)
    if r.has("train.max_seq_length"):
        r.set("seq", int_value(r.get("train.max_seq_length"), f"{src}:train.max_seq_length"), "train.max_seq_length")
    else:
        rec.note("train.max_seq_length is not set: batches are as long as the longest sample; the estimate uses "
                 "--seq (default 2048)")
    _optimizer(r)
    if lora:
        _lora(r)
    if gpus > 1:
        r.set("gpus", gpus, "devices", devices)
        r.set("zero", 3, "devices", devices)
        r.set("sharding", "fsdp1", "devices", devices)
        r.set("checkpoint", "full", "devices", devices)
        rec.note(f"devices {gpus}: LitGPT's FSDPStrategy shards every Block and checkpoints it (ZeRO-3, fsdp1)")
    r.finish()


def _optimizer(r: Reader) -> None:
    key = "optimizer.class_path" if isinstance(r.raw.get("optimizer"), dict) else "optimizer"
    opt = r.get(key)
    if opt is None:
        return
    r.set("optimizer", optimizer_name(r, key, "litgpt", "class")[0], "optimizer", opt)


def _lora(r: Reader) -> None:
    src = r.src
    r.set("lora", True, "lora_r")
    r.set("lora_rank", int_value(r.get("lora_r", 8), f"{src}:lora_r"), "lora_r")
    r.set("lora_alpha", float_value(r.get("lora_alpha", 16), f"{src}:lora_alpha"), "lora_alpha")
    d = float_value(r.get("lora_dropout", 0.05), f"{src}:lora_dropout")
    if d:
        r.set("lora_dropout", d, "lora_dropout")
    targets: list[str] = []
    for part, ts in PARTS.items():
        if bool_value(r.get(part, DEFAULT_PARTS.get(part, False)), f"{src}:{part}"):
            targets += ts
    if not targets:
        raise UserError(f"{src}: every lora_* switch is false; LoRA needs at least one of {', '.join(PARTS)}")
    r.set("lora_targets", ",".join(targets), "lora_query/key/value/projection/mlp/head")
