"""The twin check of each decoder block (``memcalc.engine.blocks``; the torch-free contract is
``tests/unit/test_blocks.py``): the block's PyTorch module under ``validate/`` (memcalc's replica,
built on meta) holds the parameters the block's rule adds, and saves for backward what the block's
nodes save in the simulation (``validate/saved_probe.py`` attributes each saved storage to the part
running the op): the perturbation moves both by the same bytes, and both sides are equal outright
but for the estimator's named omissions (``OMITTED``). The blocks' table and the field contract's
setups are ``tests/contract_tables.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from contract_tables import (BLOCKS, CASES, PERTURB, VALUES, block_nodes, build, owned_name, perturbed, saved_by,
                             setup_for)

from memcalc.core.spec import ExperimentSpec
from memcalc.core.units import round_up
from memcalc.engine.params import param_inventory
from memcalc.engine.records import Node


@pytest.mark.slow
@pytest.mark.parametrize(("name", "key"), CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_block_twin_has_its_parameters(name: str, key: str) -> None:
    """The block's PyTorch twin (``validate/``'s replica, built on meta) holds the parameters the
    block's rule adds, name for name and shape for shape, before and after the perturbation (an
    expert tensor's adapter is ``<tensor>_lora_A`` there: a parameter has no children). The saved
    bytes: :func:`test_block_twin_saves_its_bytes`."""
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


def _loss_targets(exp: ExperimentSpec, node: Node) -> int:
    rows = node.inputs[0].numel // exp.model.vocab_size  # the (shifted) rows of log_softmax's output
    return round_up(8 * rows, 512) + 512 + (512 if exp.profile.shift_copy else 0)


#: What the replica saves (and CUDA allocates) that the simulation's nodes do not list, per node
#: (name, the bytes it leaves out, why); measured on meta with torch 2.13. Small, step-constant
#: omissions of the estimator: adding them changes printed numbers (not in this restructuring).
OMITTED: list[tuple[Callable[[Node], bool], Callable[[ExperimentSpec, Node], int], str]] = [
    (lambda n: n.name == "sdpa_flash", lambda exp, n: 2 * 512,
     "FA2 saves its rng_state (2 uint64) and _unused (a uint64 scalar), CUDA tensors since the 'BC breaking "
     "change to flash seed/offset' (flash_api.cpp mha_fwd): 512 B each; Ops.sdpa lists q, k, v, out, lse"),
    (lambda n: n.name == "nll_loss", _loss_targets,
     "nll_loss saves its int64 targets (the shifted labels' contiguous copy, one per row) and total_weight "
     "(an fp32 scalar), and the shift-copy loss's nan_to_num saves the loss: head.lm_loss allocates no "
     "target copy and its nll_loss node saves nothing"),
    (lambda n: n.name == "embedding" and n.params[0].name == "embed_positions.weight",
     lambda exp, n: round_up(8 * exp.training.seq, 512),
     "the learned positions' embedding saves its (1, T) int64 position ids (an arange); "
     "embedding.embed looks the positions up with the token ids, which the token embedding already saves"),
]


#: (block, field) -> the measured disagreement and its mechanism (strict xfail: a fix on either side
#: makes the row pass and fail here)
SAVED_GAPS: dict[tuple[str, str], str] = {
    ("embedding", "ModelSpec.positions"): "rope -> learned: estimate +0 B, trace +2,048 B: the position ids "
                                          "(OMITTED's third row) appear with the learned positions",
    ("attention", "ModelSpec.alibi_trainable"): "estimate +5,505,024 B, trace +1,310,720 B (base: estimate "
                                                "10,551,296 B, trace 14,745,600 B): with fixed slopes the "
                                                "estimator models no ALiBi mask, the replica's efficient kernel "
                                                "saves the (H, T, T) mask per layer (4 x 1 MiB); the field "
                                                "contract's KNOWN_GAPS row",
}


def traced_and_simulated(exp: ExperimentSpec, roles: tuple[str, ...]) -> tuple[int, int, int]:
    """(traced, simulated, omitted): the bytes the block's roles save on both sides, and the
    simulation's OMITTED bytes for them."""
    from memcalc.validate.saved_probe import role_bytes, saved_by_role

    nodes = block_nodes(exp, roles)
    omitted = sum(size(exp, n) for n in nodes for match, size, _ in OMITTED if match(n))
    return role_bytes(saved_by_role(exp), roles), saved_by(nodes), omitted


@pytest.mark.slow
@pytest.mark.parametrize(("name", "key"), [
    pytest.param(n, k, marks=pytest.mark.xfail(strict=True, reason=SAVED_GAPS[(n, k)])) if (n, k) in SAVED_GAPS
    else (n, k) for n, k in CASES], ids=[f"{n}-{k}" for n, k in CASES])
def test_block_twin_saves_its_bytes(name: str, key: str) -> None:
    """The perturbation moves the bytes the block's twin saves for backward (traced on meta) as it
    moves the block's simulated saved bytes (tests/unit/test_blocks.py's ``saved_bytes``), and both
    setups trace exactly the simulated bytes plus the estimator's named omissions (OMITTED)."""
    pytest.importorskip("torch")
    from memcalc.validate.model import unbuilt_features

    block = BLOCKS[name]
    setup, value = PERTURB[key]
    base = build(setup_for(name, setup))
    changed = perturbed(base, key, VALUES.get((name, key), value))
    if unbuilt_features(base.model) or unbuilt_features(changed.model):
        pytest.skip(f"the replica does not build {unbuilt_features(changed.model) or unbuilt_features(base.model)}")
    (tb, sb, ob), (tp, sp, op) = (traced_and_simulated(exp, block.roles) for exp in (base, changed))
    where = f"{name} {key}: simulated {sb:,} -> {sp:,} B ({sp - sb:+,}), traced {tb:,} -> {tp:,} B ({tp - tb:+,})"
    assert tp - tb == sp - sb, where
    assert (tb, tp) == (sb + ob, sp + op), f"{where}; omitted {ob:,} / {op:,} B"
