"""The optimizer registry (memcalc.core.optimizers): every record is accepted by each consumer
(spec, CLI, engine, bytes-per-parameter table, plan, validate), and an implementation an
optimizer does not have is a one-line error naming the valid ones."""

from __future__ import annotations

import typing

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from memcalc.cli import app
from memcalc.core.optimizers import (DEFAULT_IMPL, IMPLS, OPTIMIZER_NAMES, OPTIMIZERS, PLANNED_OPTIMIZERS, get_optimizer)
from memcalc.core.errors import UserError
from memcalc.core.optimizers import TORCHAO
from memcalc.core.spec import ExperimentSpec, ModelSpec, TrainingSpec
from memcalc.engine.optimizers import STATE_LAYOUTS, STEP_KINDS
from memcalc.estimate.peak import bytes_per_param, estimate

TINY = ModelSpec(name="tiny", n_layers=2, d_model=64, n_heads=4, d_ff=128, vocab_size=128, max_seq_len=64)

#: every (optimizer, implementation) the spec accepts
VALID = [(n, i) for n in OPTIMIZER_NAMES for i in sorted({DEFAULT_IMPL, *OPTIMIZERS[n].impls})]
INVALID = [(n, i) for n in OPTIMIZER_NAMES for i in IMPLS if i != DEFAULT_IMPL and i not in OPTIMIZERS[n].impls]


def test_records_are_well_formed() -> None:
    for name, rec in OPTIMIZERS.items():
        assert rec.name == name and rec.display and rec.help and rec.source
        assert rec.impls and set(rec.impls) <= set(IMPLS), name
        assert rec.state in STATE_LAYOUTS and rec.step in STEP_KINDS, name
        assert (rec.moments > 0) == (rec.state in ("like_param", "blockwise_8bit", "fp32", *TORCHAO)), name


def _choices(tp: object) -> tuple:
    """The values of the Literal inside an option's annotation (Annotated[Optional[Literal[...]], ...])."""
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp)
    return next((c for a in typing.get_args(tp) if (c := _choices(a))), ())


def test_spec_and_cli_accept_every_name() -> None:
    from memcalc.cli import estimate as estimate_cmd

    hints = typing.get_type_hints(estimate_cmd, include_extras=True)
    choices = {name: _choices(tp) for name, tp in hints.items() if _choices(tp)}
    # --optimizer takes the registry's names and their aliases (memcalc.core.aliases): its metavar lists the names
    opt = next(a for a in typing.get_args(hints["optimizer"]) if hasattr(a, "metavar"))
    assert opt.metavar == "<" + "|".join(OPTIMIZER_NAMES) + ">"
    assert list(choices["optimizer_impl"]) == list(IMPLS)
    for name in OPTIMIZER_NAMES:
        assert TrainingSpec(optimizer=name).optimizer == name


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(UserError, match="valid: .*adamw-8bit"):
        get_optimizer("adamx")


@pytest.mark.parametrize("name,impl", VALID)
def test_engine_simulates_every_valid_combination(name: str, impl: str) -> None:
    for fused in (False, True):
        tr = TrainingSpec(batch=1, seq=32, optimizer=name, optimizer_impl=impl, fused_optimizer=fused)
        exp = ExperimentSpec(model=TINY, training=tr)
        est = estimate(exp, timeline=False, replay=False)
        assert est.peak_bytes > 0 and est.first_step_peak_bytes > 0
        state_bytes = sum(b for k, b in est.components.items() if k == "optimizer state")
        has_state = OPTIMIZERS[name].state != "none"
        assert (state_bytes > 0) == has_state or est.peak_phase != "optimizer step", (name, impl, est.components)
        bpp = bytes_per_param(exp)["optimizer_state"]
        assert (bpp > 0) == (OPTIMIZERS[name].state in ("like_param", "blockwise_8bit", "fp32", *TORCHAO))


@pytest.mark.parametrize("name,impl", INVALID)
def test_missing_implementation_is_a_one_line_error(name: str, impl: str) -> None:
    with pytest.raises(ValidationError, match=f"no {impl} implementation; valid optimizer_impl for it: "
                                              f"{', '.join(OPTIMIZERS[name].impls)}"):
        TrainingSpec(optimizer=name, optimizer_impl=impl)
    r = CliRunner().invoke(app, ["estimate", "--params", "1e7", "--seq", "64", "--optimizer", name,
                                 "--optimizer-impl", impl])
    assert r.exit_code == 2
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "valid optimizer_impl" in lines[0] and "Traceback" not in r.output


def test_plan_reads_the_registry() -> None:
    from memcalc.plan.options import OPTIMIZERS as PLANNED, Technique

    assert PLANNED == PLANNED_OPTIMIZERS == ("adamw", "adamw-8bit", "adafactor")
    for name in PLANNED:
        assert OPTIMIZERS[name].display in Technique("none", "16", name, "none", False).label()
