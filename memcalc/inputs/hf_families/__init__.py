"""The Hugging Face config readers, one module per kind of family (see
:mod:`memcalc.inputs.hf_config`, which owns the typed key reader and the entry point)."""

from __future__ import annotations

from memcalc.inputs.hf_families import classic, dense, moe
from memcalc.inputs.hf_families.ignored import ignored

READERS = {**dense.READERS, **classic.READERS, **moe.READERS}
#: model_types recognised but refused with a reason (the reader raises)
REFUSED = {"gemma3": dense.gemma3}

__all__ = ["READERS", "REFUSED", "ignored"]
