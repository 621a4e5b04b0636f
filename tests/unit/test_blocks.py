"""The contract of each decoder block (``memcalc.engine.blocks``): every config field a block reads
moves that block's own numbers when perturbed -- its parameter bytes (the inventory entries the
block's parameter rule adds) or its saved bytes (what the nodes the block issues keep for
backward, in the simulation of one forward) -- so a rule that stops reading a field, or reads it
in the wrong block, fails here.

Setups and perturbed values are the field contract's (``tests/contract_tables.py`` PERTURB), on its
tiny decoder; the blocks' table (``BLOCKS``) is there too. Torch-free: the twin check (the block's
PyTorch module under ``validate/``, built on meta: the same parameters, and the same saved bytes
per block, ``validate/saved_probe.py``) is ``tests/trace/test_blocks_twin.py``; the whole step's saved
bytes, traced, are ``tests/trace/test_moe_mla_trace.py``, ``tests/trace/test_family_activations_trace.py``
and ``tests/trace/test_estimator_vs_trace.py``, per family.
"""

from __future__ import annotations

from typing import Any

import pytest
from contract_tables import BLOCKS, CASES, PERTURB, VALUES, Block, build, perturbed, saved_bytes, setup_for

from memcalc.core.spec import ExperimentSpec
from memcalc.engine.params import param_inventory


def param_bytes(exp: ExperimentSpec, block: Block) -> tuple:
    """The block's parameters: (name, shape) of each, and their elements."""
    mine = [p for p in param_inventory(exp.model, exp.training.lora) if block.owns(p)]
    return tuple((p.name, p.shape) for p in mine), sum(p.numel for p in mine)


def test_every_block_field_is_a_contract_field() -> None:
    assert not [key for _, key in CASES if key not in PERTURB]


@pytest.mark.parametrize(("name", "key"), CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_block_field_moves_its_bytes(name: str, key: str) -> None:
    block = BLOCKS[name]
    setup, value = PERTURB[key]
    value = VALUES.get((name, key), value)
    setup = setup_for(name, setup)
    base = build(setup)
    changed = perturbed(base, key, value)
    before: Any = (param_bytes(base, block), saved_bytes(base, block.roles))
    after: Any = (param_bytes(changed, block), saved_bytes(changed, block.roles))
    assert before != after, f"{key} = {value!r} moves neither the parameters nor the saved bytes of block {name}"
