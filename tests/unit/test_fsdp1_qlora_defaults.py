"""QLoRA under FSDP1 resolves without PEFT's k-bit fp32 cast (issue 28): FSDP1 refuses a decoder layer's flat
parameter of fp32 norms beside bf16 4-bit storage (torch 2.13 distributed/fsdp/_flat_param.py
``_validate_tensors_to_flatten``), so TRL and axolotl skip ``prepare_model_for_kbit_training`` there
(memcalc.inputs.trainer_defaults.fsdp1_qlora_profile). The validator builds the same base
(tests/trace/test_fsdp1_peft.py traces it, and checks that an explicit cast is refused)."""

from __future__ import annotations

import pytest

from memcalc.api import options_from
from memcalc.inputs.resolve import resolve
from memcalc.inputs.trainer_defaults import FSDP1_QLORA_NO_CAST

SHARDED = dict(model="llama-2-7b", zero=3, gpus=2)
ROWS = [
    # (inputs, the resolved qlora_fp32_cast, the checkpointing, whether the note is given)
    # source: FSDP1 QLoRA: no cast, and so no checkpointing from prepare_model_for_kbit_training
    (dict(**SHARDED, qlora=True, sharding="fsdp1"), False, "none", True),
    # source: FSDP1 ZeRO-2 (SHARD_GRAD_OP) flattens the same units
    (dict(**{**SHARDED, "zero": 2}, qlora=True, sharding="fsdp1"), False, "none", True),
    # source: FSDP2 (fully_shard) is not FSDP1's flat parameter: the hf profile's cast stays, with its checkpointing
    (dict(**SHARDED, qlora=True, sharding="fsdp2"), True, "full", False),
    # source: one GPU: FSDP1 does not run (fsdp1_active), PEFT's recipe as without --sharding
    (dict(model="llama-2-7b", qlora=True, sharding="fsdp1"), True, "full", False),
    # source: LoRA over a bf16 base has no k-bit cast to skip
    (dict(**SHARDED, lora=True, sharding="fsdp1"), True, "none", False),
    # source: TRL's profile never casts (SFTTrainer skips prepare_model_for_kbit_training); its own checkpointing
    (dict(**SHARDED, qlora=True, sharding="fsdp1", framework="trl"), False, "full", False),
]


@pytest.mark.parametrize("inputs,cast,checkpoint,noted", ROWS)
def test_fsdp1_qlora_runs_without_the_kbit_cast(inputs, cast, checkpoint, noted):
    res = resolve(options_from(**inputs))
    assert res.exp.profile.qlora_fp32_cast is cast
    assert res.exp.training.checkpoint == checkpoint
    assert (FSDP1_QLORA_NO_CAST in res.notes) is noted
    assert (res.reasons.get("qlora_fp32_cast") == FSDP1_QLORA_NO_CAST) is noted
