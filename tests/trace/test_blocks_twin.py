"""The twin check of each decoder block (``memcalc.engine.blocks``; the torch-free contract is
``tests/unit/test_blocks.py``): the block's PyTorch module under ``validate/`` (memcalc's replica,
built on meta) holds the parameters the block's rule adds. The blocks' table and the field contract's
setups are ``tests/contract_tables.py``'s.
"""

from __future__ import annotations

import pytest
from contract_tables import BLOCKS, CASES, PERTURB, VALUES, build, owned_name, perturbed, setup_for

from memcalc.engine.params import param_inventory


@pytest.mark.slow
@pytest.mark.parametrize(("name", "key"), CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_block_twin_has_its_parameters(name: str, key: str) -> None:
    """The block's PyTorch twin (``validate/``'s replica, built on meta) holds the parameters the
    block's rule adds, name for name and shape for shape, before and after the perturbation (an
    expert tensor's adapter is ``<tensor>_lora_A`` there: a parameter has no children). The saved
    bytes are the families' trace tests' (see the module docstring)."""
    pytest.importorskip("torch")
    from memcalc.validate.model import build_model, unbuilt_features

    block = BLOCKS[name]
    setup, value = PERTURB[key]
    base = build(setup_for(name, setup))
    for exp in (base, perturbed(base, key, VALUES.get((name, key), value))):
        if unbuilt_features(exp.model):
            pytest.skip(f"the replica does not build {unbuilt_features(exp.model)}")
        net = build_model(exp.model, exp.training, exp.profile, device="meta")
        twin = {n.replace("_proj_lora_", "_proj.lora_"): tuple(p.shape) for n, p in net.named_parameters()}
        mine = {p.name: p.shape for p in param_inventory(exp.model, exp.training.lora) if block.owns(p)}
        assert {n: s for n, s in twin.items() if n in mine or owned_name(block, n)} == mine
