"""Issue 27's bar for LitGPT: ``memcalc estimate --framework litgpt`` within 2% of LitGPT 0.5.13's own
fine-tuning step traced on meta (``memcalc validate --framework litgpt``), over the grid of
:mod:`memcalc.validate.litgpt_grid`: Llama-like GQA, phi and StableLM shapes (2 layers, width 256,
vocabulary 4096); full fine-tuning and LoRA; bf16-true, bf16-mixed and 32-true; batch 1 to 4; the head
in one chunk (seq <= 128) or several (seq 320); LitGPT's activation checkpointing (checkpoint_wrapper
per Block) on some rows.

# source: each row is a trace of litgpt 0.5.13 (litgpt.model.GPT / litgpt.lora.GPT, the finetune scripts'
# fit loop and litgpt.utils.chunked_cross_entropy) under lightning 2.6's precision plugins, on meta,
# only kernel dispatch routed as CUDA's (validate/hf_kernels.py HFKernels); QLoRA rows with every linear
# replaced as BitsandbytesPrecision._convert_layers replaces it, by memcalc's 4-bit replica (0.50, or with
# bnb<0.43.2 the 0.41/0.42 MatMul4Bit LitGPT 0.4 pinned: validate/blocks/adapters.py Linear4bit)
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

pytestmark = pytest.mark.slow

pytest.importorskip("litgpt")
pytest.importorskip("lightning")

from memcalc.cli import app  # noqa: E402
from memcalc.validate.litgpt_grid import estimate_litgpt, grid  # noqa: E402
from memcalc.validate.trainers.litgpt import measure  # noqa: E402

#: issue 27: "agree with memcalc estimate within 2% on the CI grids"
TOLERANCE_PCT = 2.0

ITEMS = grid()
#: rows memcalc misses today, by mechanism (strict: they flip when it lands)
KNOWN_GAPS: dict[str, str] = {}
#: was -11.2% on "llama-gqa qlora bnb<0.43.2 q,v bf16 2x320 ck ga2" until the checkpointed forward kept each 4-bit
#: linear's input on MatMul4Bit's ctx as bitsandbytes < 0.43.2 does (engine/blocks/adapters.py _linear_4bit): -1.49%


def _params():
    return [pytest.param(n, e, id=n, marks=[pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[n])] if n in KNOWN_GAPS
                         else []) for n, e in ITEMS]


@pytest.mark.parametrize("name,exp", _params())
def test_litgpt_estimate_matches_the_litgpt_trace(name, exp):
    meas = measure(exp, "meta")
    assert meas.status == "ok", meas.reason
    predicted, _phase = estimate_litgpt(exp)
    gap_pct = (predicted - meas.measured_bytes) / meas.measured_bytes * 100
    assert abs(gap_pct) <= TOLERANCE_PCT, (
        f"{name}: predicted {predicted:,} B, traced {meas.measured_bytes:,} B ({gap_pct:+.2f}%)")


def test_grid_size():
    assert len(ITEMS) >= 30


_MODEL = "--params 20M --seq 160 --batch 2"
#: (args, exit code, a line the output must hold)
CLI_ROWS = [
    # source: validate/trainers/litgpt.py, the LitGPT step traced; the record names the framework
    (f"validate {_MODEL} --framework litgpt --device meta --precision bf16 --json", 0, '"framework": "litgpt"'),
    (f"validate {_MODEL} --framework litgpt --device meta --lora --precision amp-bf16 --json", 0, '"status": "ok"'),
    # source: validate/trainers/litgpt.py _why_not (LitGPT 0.5.13 has no DoRA; one line, exit 2)
    (f"validate {_MODEL} --framework litgpt --device meta --dora", 2, "LitGPT 0.5.13 has no DoRA"),
    (f"validate {_MODEL} --framework litgpt --device meta --checkpoint selective", 2, "checkpoint selective"),
    # source: litgpt/finetune/lora.py setup: "Quantization and mixed precision is not supported."
    (f"validate {_MODEL} --framework litgpt --device meta --qlora --precision amp-bf16", 2, "QLoRA is Bitsandbytes"),
]


@pytest.mark.parametrize("args,code,message", CLI_ROWS, ids=[r[0].split(" --framework")[1][:60] for r in CLI_ROWS])
def test_validate_framework_litgpt_cli(args, code, message):
    res = CliRunner().invoke(app, args.split())
    assert res.exit_code == code, res.output
    assert message in res.output


@pytest.mark.parametrize("targets", [("q", "v"), ("q", "v", "gate", "up", "down"), None])
def test_litgpt_moe_parameters_are_litgpt_own(targets):
    # source: litgpt 0.5.13 lora.py LLaMAMoE.__init__ (create_lora_linear for the gate and every expert's fc_1, fc_2,
    # proj under lora_mlp) and model.py LLaMAMoE: the estimator's inventory (engine/blocks/litgpt_moe.py) holds
    # the same tensors, shape for shape, trainable as mark_only_lora_as_trainable leaves them
    import torch
    from litgpt import lora as litgpt_lora
    from litgpt.model import GPT

    from memcalc.core.spec import ExperimentSpec, LoraSpec, TrainingSpec
    from memcalc.engine.params import param_inventory
    from memcalc.inputs.profiles import profile_for
    from memcalc.validate.litgpt_grid import MODELS
    from memcalc.validate.record import trainer_estimator_spec
    from memcalc.validate.trainers.litgpt import litgpt_config

    lora = LoraSpec(rank=8, targets=targets) if targets else None
    exp = trainer_estimator_spec(ExperimentSpec(model=MODELS["moe"], training=TrainingSpec(lora=lora),
                                                profile=profile_for("litgpt")), "litgpt")
    with torch.device("meta"):
        model = litgpt_lora.GPT(litgpt_config(exp.model, lora)) if lora else GPT(litgpt_config(exp.model))
    if lora:
        litgpt_lora.mark_only_lora_as_trainable(model)
    theirs = sorted((tuple(p.shape), p.requires_grad) for p in model.parameters())
    ours = sorted((p.shape, p.trainable) for p in param_inventory(exp.model, lora))
    assert ours == theirs


#: (MoESpec update, a line the refusal must hold)
MOE_REFUSALS = [
    # source: litgpt/lora.py LLaMAMoE.__init__ builds no shared_experts (its forward would read them)
    ({"n_shared_experts": 1}, "shared experts"),
    # source: litgpt/model.py Block.__init__: config.mlp_class everywhere but first_k_dense_replace (no sparse step)
    ({"every": 2}, "sparse step"),
    # source: litgpt/lora.py Block.__init__ sets self.mlp = config.mlp_class(config) after the base's dense choice
    ({"first_dense_layers": 1}, "dense first layers under LoRA"),
]


@pytest.mark.parametrize("update,message", MOE_REFUSALS, ids=[m for _u, m in MOE_REFUSALS])
def test_validate_framework_litgpt_refuses_what_llamamoe_cannot_build(update, message):
    from memcalc.core.errors import UserError
    from memcalc.core.spec import ExperimentSpec, LoraSpec, TrainingSpec
    from memcalc.inputs.profiles import profile_for
    from memcalc.validate.litgpt_grid import MODELS
    from memcalc.validate.trainers.litgpt import check

    m = MODELS["moe"]
    m = m.model_copy(update={"n_layers": 2, "moe": m.moe.model_copy(update=update)})
    exp = ExperimentSpec(model=m, training=TrainingSpec(lora=LoraSpec(targets=("q", "v"))),
                         profile=profile_for("litgpt"))
    with pytest.raises(UserError, match=message):
        check(exp)
