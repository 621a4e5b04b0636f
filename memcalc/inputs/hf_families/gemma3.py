"""Gemma 3 multimodal (``model_type`` gemma3): refused; its text decoder is ``gemma3_text``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcalc.core.errors import UserError
from memcalc.inputs.hf_families.base import Family, Fields

if TYPE_CHECKING:
    from memcalc.inputs.hf_families.reader import Reader

REFUSED = ("is multimodal Gemma 3 (a SigLIP vision tower memcalc does not model); for the text decoder give "
           "its text_config as a config of model_type gemma3_text")


def read(r: Reader) -> Fields:
    raise UserError(f"{r.where}: model_type gemma3 {REFUSED}")


FAMILY = Family("gemma3", read, refused=REFUSED)
