"""``MemcalcCallback`` for the Hugging Face ``Trainer``: memcalc's estimate beside the real run.

>>> from memcalc.integrations.transformers import MemcalcCallback        # doctest: +SKIP
>>> trainer = Trainer(model=model, args=args, train_dataset=ds,
...                   callbacks=[MemcalcCallback(output="run.json")])   # doctest: +SKIP
>>> trainer.train()                                                     # doctest: +SKIP
memcalc: predicted 30.571 GiB (peak in backward), measured 29.904 GiB (max_memory_allocated over 10 steps), gap +2.23%

At ``on_train_begin`` the callback reads the model's config (``model.config`` as its config.json, read by
memcalc's Hugging Face config reader), the ``TrainingArguments`` (:func:`options_from_hf`: the ``--recipe``
reader, :mod:`memcalc.inputs.recipes.hf`, given ``args.to_dict()``) and the
PEFT config of a ``PeftModel``, and estimates that setup; at every ``on_step_end`` it records
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` and resets the peak; at
``on_train_end`` it prints predicted vs measured and writes a record in ``memcalc validate``'s
format (``memcalc.validate.measure``). Without CUDA nothing is measured (one warning line) and the
record holds the estimate with ``measured_bytes`` null.

The arguments are read as ``--recipe`` reads the same keys from a file, so both give one number:

>>> opts, notes = options_from_hf({"per_device_train_batch_size": 1, "bf16": True, "optim": "paged_adamw_32bit"},
...                               model_dtype="bfloat16")
>>> opts["optimizer"], opts["precision"]
('paged-adamw', 'bf16')

This module is torch-free: ``MemcalcCallback`` (a ``transformers.TrainerCallback``) is imported
from ``memcalc.validate.callback`` on first access.
"""

from __future__ import annotations

from typing import Any

from memcalc.inputs.recipes.hf import options_from_hf

__all__ = ["MemcalcCallback", "options_from_hf"]


def __getattr__(name: str) -> Any:
    if name == "MemcalcCallback":
        try:
            from memcalc.validate.callback import MemcalcCallback
        except ImportError as e:
            from memcalc.core.errors import UserError

            raise UserError(f"MemcalcCallback needs torch and transformers ({e})") from None
        return MemcalcCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
