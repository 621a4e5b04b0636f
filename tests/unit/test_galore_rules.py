"""GaLore AdamW (--optimizer galore-adamw --galore-rank R): the projected state and the refusals (torch-free;
the trace is tests/trace/test_galore_trace.py)."""

from __future__ import annotations

import pytest

from conftest import cli_run, one_line_error
from pydantic import ValidationError

from memcalc.core.optimizers import galore_shapes, galore_target
from memcalc.core.spec import ExperimentSpec, ModelSpec, TrainingSpec
from memcalc.estimate.peak import no_effect_notes

TINY = ModelSpec(name="tiny", n_layers=2, d_model=64, n_heads=4, d_ff=128, vocab_size=128, max_seq_len=64)

SHAPES = [
    # source: galore_projector.py project, m >= n ("right"): grad @ B.t() is m x r; B = Vh[:r] bf16 is r x n
    (4096, 1024, 128, 2, (2 * 128 * 4096, 2 * 128 * 1024)),
    # source: m < n ("left"): A.t() @ grad is r x n; A = U[:, :r] bf16 is m x r
    (1024, 4096, 128, 2, (2 * 128 * 4096, 2 * 1024 * 128)),
    # source: fp32 weight: B = Vh[:r] is a view, the whole fp32 Vh (min(m, n) squared) stays as the projector
    (4096, 1024, 128, 4, (4 * 128 * 4096, 4 * 1024 * 1024)),
    # source: rank above min(m, n): U[:, :rank] / Vh[:rank] stop at min(m, n)
    (256, 512, 1000, 2, (2 * 256 * 512, 2 * 256 * 256)),
]


@pytest.mark.parametrize("m,n,rank,itemsize,expected", SHAPES)
def test_projected_state(m: int, n: int, rank: int, itemsize: int, expected: tuple[int, int]) -> None:
    assert galore_shapes(m, n, rank, itemsize) == expected


TARGETS = [
    # source: transformers _setup_low_rank_optimizer: the nn.Linear modules optim_target_modules ["attn", "mlp"] name
    ("layers.0.attn.q_proj.weight", (256, 256), True),
    ("model.layers.3.mlp.down_proj.weight", (256, 1024), True),
    # source: the embedding, head and norms stay in the plain AdamW group
    ("embed_tokens.weight", (4096, 256), False),
    ("lm_head.weight", (4096, 256), False),
    ("layers.0.norm1.weight", (256,), False),
]


@pytest.mark.parametrize("name,shape,expected", TARGETS)
def test_targets(name: str, shape: tuple[int, ...], expected: bool) -> None:
    assert galore_target(name, shape) is expected


def test_galore_with_lora_is_one_line() -> None:
    one_line_error(cli_run(["estimate", "--params", "1e7", "--seq", "64", "--optimizer", "galore-adamw", "--lora"]),
                   2, "not with LoRA (GaLore trains the full weights)")


BAD = [
    (dict(zero=3, gpus=2), "not with ZeRO or FSDP sharding"),
    (dict(precision="bf16", master_weights=True), "not with master weights"),
    (dict(offload_optimizer=True), "not with an offloaded optimizer"),
    (dict(galore_rank=0), "greater than 0"),
]


@pytest.mark.parametrize("kw,message", BAD)
def test_galore_refusals(kw: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TrainingSpec(optimizer="galore-adamw", **kw)


def test_rank_without_galore_is_noted() -> None:
    exp = ExperimentSpec(model=TINY, training=TrainingSpec(galore_rank=16))
    assert "galore_rank 16 has no effect with adamw: it is GaLore's projection rank (optimizer galore-adamw)" in (
        no_effect_notes(exp))
