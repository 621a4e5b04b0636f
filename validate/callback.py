"""``MemcalcCallback``: memcalc's estimate beside a Hugging Face ``Trainer`` run (see
:mod:`memcalc.integrations.transformers`, the torch-free entry point that imports this module).

- ``on_train_begin``: the setup is read from the run itself: the model's config
  (``model.config`` as config.json, read by :func:`memcalc.inputs.hf_config.from_hf_config` through
  ``memcalc.estimate(model=<dict>)``), the ``TrainingArguments`` and, for a ``PeftModel``, the active
  adapter's ``LoraConfig`` (:func:`memcalc.inputs.recipes.hf.options_from_hf`, the ``--recipe`` reader); the weights'
  dtype and a bitsandbytes 4-bit base come from the model. memcalc estimates that setup, and CUDA's
  peak statistics are reset (:class:`.measure.Recorder`).
- A forward pre-hook notes the largest training batch and sequence the model is given: TrainingArguments
  do not hold the sequence length, so unless ``seq=`` is given (or TRL's ``max_length``), the estimate
  is rebuilt at the end for the longest batch seen.
- ``on_step_end``: that step's ``max_memory_allocated`` / ``max_memory_reserved``; the peak is reset.
- ``on_train_end``: predicted vs measured and the gap, printed; the record written
  (``memcalc validate``'s format).

The callback never stops training: a setup memcalc cannot estimate is one warning line and a record
with ``predicted_bytes`` null.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Optional

import torch
from transformers import TrainerCallback

from memcalc.core.errors import UserError
from memcalc.inputs.recipes.hf import options_from_hf

from .measure import Recorder


def _peft_config(model: Any) -> Optional[dict[str, Any]]:
    """The active adapter's PEFT config as a dict (None for a plain model)."""
    cfgs = getattr(model, "peft_config", None)
    if not isinstance(cfgs, dict) or not cfgs:
        return None
    name = getattr(model, "active_adapter", None)
    name = name if isinstance(name, str) and name in cfgs else next(iter(cfgs))
    cfg = cfgs[name]
    return cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))


def _weights_dtype(model: Any) -> Optional[str]:
    """The dtype of the (frozen, for PEFT) base weights: the most common floating dtype among them."""
    counts: dict[torch.dtype, int] = {}
    peft = _peft_config(model) is not None
    for p in model.parameters():
        if p.is_floating_point() and not (peft and p.requires_grad):
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    if not counts:
        return None
    return str(max(counts, key=counts.__getitem__)).replace("torch.", "")


def _load_in_4bit(model: Any, cfg: dict[str, Any]) -> bool:
    if getattr(model, "is_loaded_in_4bit", False):
        return True
    q = cfg.get("quantization_config")
    return bool(q.get("load_in_4bit")) if isinstance(q, dict) else False


def _double_quant(model: Any, cfg: dict[str, Any]) -> Optional[bool]:
    """The live 4-bit base's ``bnb_4bit_use_double_quant`` (transformers' ``BitsAndBytesConfig`` on
    ``model.config.quantization_config``, or its dict in config.json); None when it does not say."""
    q = getattr(model.config, "quantization_config", None) or cfg.get("quantization_config")
    v = q.get("bnb_4bit_use_double_quant") if isinstance(q, dict) else getattr(q, "bnb_4bit_use_double_quant", None)
    return None if v is None else bool(v)


class MemcalcCallback(TrainerCallback):
    """Compare memcalc's estimate with the real run (see the module docstring).

    ``output``: write the record there (a JSON list, as ``memcalc validate --output``); ``name``:
    the record's ``config`` (default: the model's name); ``seq`` / ``batch``: the sequence length
    and micro-batch the estimate is for (default: TRL's ``max_length``, else the longest batch the
    model was given); ``options``: any other ``memcalc.estimate`` keyword, overriding what was read
    from the run (``checkpoint="full"``, ``framework="hf"``, ``loss="chunked"``, ...).
    """

    def __init__(self, output: Optional[str] = None, name: Optional[str] = None, seq: Optional[int] = None,
                 batch: Optional[int] = None, quiet: bool = False, **options: Any) -> None:
        from memcalc.validate.measure import check_output

        check_output(output)
        self.output, self.name, self.quiet = output, name, quiet
        self.fixed = {k: v for k, v in (("seq", seq), ("batch", batch)) if v is not None}
        self.overrides = options
        self.recorder: Optional[Recorder] = None
        self.options: dict[str, Any] = {}
        self.notes: list[str] = []
        self.seen_batch = 0
        self.seen_seq = 0
        self._hook = None
        self._cfg: dict[str, Any] = {}

    # -- reading the run ---------------------------------------------------------------------------
    def setup(self, args: Any, model: Any) -> tuple[dict[str, Any], list[str]]:
        """memcalc.estimate keywords for this run, and notes on how they were read."""
        # what save_pretrained writes as config.json: the keys that differ from the class's defaults
        # (memcalc's readers take transformers' defaults for the others)
        cfg = json.loads(model.config.to_json_string(use_diff=True))
        a = args.to_dict() if hasattr(args, "to_dict") else dict(vars(args))
        opts, notes = options_from_hf(a, _weights_dtype(model), _peft_config(model), _load_in_4bit(model, cfg),
                                     _double_quant(model, cfg))
        opts.update(self.fixed)
        opts.update(self.overrides)
        self._cfg = cfg
        return {"model": cfg, **opts}, notes

    def _estimate(self, opts: dict[str, Any]):
        from memcalc.api import estimate

        try:
            return estimate(**opts), ""
        except (UserError, ValueError, TypeError) as e:
            return None, str(e)

    def _observe(self, module: Any, args: tuple, kwargs: dict) -> None:
        if not module.training:
            return
        x = kwargs.get("input_ids")
        if x is None:
            x = kwargs.get("inputs_embeds")
        if x is None and args:
            x = args[0]
        if isinstance(x, torch.Tensor) and x.dim() >= 2:
            self.seen_batch = max(self.seen_batch, int(x.shape[0]))
            self.seen_seq = max(self.seen_seq, int(x.shape[1]))

    # -- events ------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            return
        try:
            self.options, self.notes = self.setup(args, model)
            est, why = self._estimate(self.options)
        except Exception as e:  # noqa: BLE001 - a model memcalc cannot read must not stop training
            est, why = None, f"{type(e).__name__}: {e}"
        if est is None and not self.quiet:
            print(f"memcalc: warning: no estimate for this run: {why}", file=sys.stderr, flush=True)
        name = self.name or (est.spec.name if est is not None else str(self._cfg.get("model_type") or "model"))
        if getattr(args, "world_size", 1) > 1:  # one record per process, each its own GPU's
            name += f" (rank {args.process_index} of {args.world_size})"
        from memcalc.api import estimate

        self.recorder = Recorder(est, name, self.output, "callback", self.notes, self.quiet, why, predict=estimate)
        self._hook = model.register_forward_pre_hook(self._observe, with_kwargs=True)
        self.recorder.start()

    def on_step_end(self, args, state, control, **kwargs):
        if self.recorder is not None:
            self.recorder.step()

    def on_train_end(self, args, state, control, **kwargs):
        if self.recorder is None:
            return
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        try:
            self._rebuild_for_seen_shape()
            self.recorder.finish()
        except Exception as e:  # noqa: BLE001 - the run has finished; report, do not fail it
            print(f"memcalc: warning: no record: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    def _rebuild_for_seen_shape(self) -> None:
        """The estimate for the batch and sequence the model was actually given (when not fixed)."""
        est = self.recorder.estimate
        if est is None or not self.seen_seq:
            return
        tr = est.spec.training
        shape = {}
        if "seq" not in self.fixed and "seq" not in self.overrides and self.seen_seq != tr.seq:
            shape["seq"] = self.seen_seq
        if "batch" not in self.fixed and "batch" not in self.overrides and self.seen_batch != tr.batch:
            shape["batch"] = self.seen_batch
        if not shape:
            return
        new, why = self._estimate({**self.options, **shape})
        if new is None:
            self.recorder.notes.append(f"the batch x seq seen, {self.seen_batch} x {self.seen_seq}, could not be "
                                       f"estimated ({why}); the estimate is for {tr.batch} x {tr.seq}")
            return
        self.recorder.estimate = new
        self.recorder.notes.append(f"estimated for the largest training batch seen, {self.seen_batch} x "
                                   f"{self.seen_seq} (batch x seq; pass seq=/batch= to fix them)")
