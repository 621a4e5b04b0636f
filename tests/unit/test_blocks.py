"""The contract of each decoder block (``memcalc.engine.blocks``): every config field a block reads
moves that block's own numbers when perturbed -- its parameter bytes (the inventory entries the
block's parameter rule adds) or its saved bytes (what the nodes the block issues keep for
backward, in the simulation of one forward) -- so a rule that stops reading a field, or reads it
in the wrong block, fails here.

Setups and perturbed values are the field contract's (``tests/test_field_contract.py`` PERTURB),
on its tiny decoder. Torch-free: the twin check (the block's PyTorch module under ``validate/``,
traced on meta: the same parameter and saved bytes) is ``tests/test_moe_mla_trace.py``,
``tests/test_family_activations_trace.py`` and ``tests/test_estimator_vs_trace.py``, per family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from memcalc.core.spec import ExperimentSpec
from memcalc.engine.blocks.base import ParamTensor
from memcalc.engine.forward import Forward
from memcalc.engine.params import param_inventory
from memcalc.engine.sim import Sim
from memcalc.engine.strategy import LayerStrategy
from memcalc.engine.weights import make_params
from tests.test_field_contract import PERTURB, build, perturbed


@dataclass(frozen=True)
class Block:
    """A block: which inventory entries are its parameters, which simulator roles its nodes carry,
    and the fields it reads (keys of PERTURB)."""

    owns: Callable[[ParamTensor], bool]
    roles: tuple[str, ...]
    fields: tuple[str, ...]


def _layer_norm(p: ParamTensor) -> bool:
    return p.layer is not None and p.name.split(".")[2].startswith("norm")


#: Not listed, with the reason: ``positions`` and ``rotary_pct`` in attention (rotated or not, SDPA
#: saves q and k of the same size; they move the RoPE tables and the transients, which the field
#: contract checks).
BLOCKS: dict[str, Block] = {
    "embedding": Block(lambda p: p.name.startswith("embed_"), ("embedding",),
                       ("ModelSpec.vocab_size", "ModelSpec.d_model", "ModelSpec.positions", "ModelSpec.max_seq_len",
                        "ModelSpec.embd_dropout")),
    "norm": Block(_layer_norm, ("layer",), ("ModelSpec.norm", "ModelSpec.norm_bias", "ModelSpec.d_model")),
    "attention": Block(lambda p: ".attn." in p.name, ("attention",),
                       ("ModelSpec.n_heads", "ModelSpec.n_kv_heads", "ModelSpec.head_dim", "ModelSpec.qkv_bias",
                        "ModelSpec.o_bias", "ModelSpec.alibi_trainable",
                        "ModelSpec.attn_dropout", "ModelSpec.qk_norm", "ModelSpec.fused_qkv",
                        "ModelSpec.attn_sinks")),
    "mla": Block(lambda p: ".attn." in p.name, ("attention",),
                 ("MLASpec.q_lora_rank", "MLASpec.kv_lora_rank", "MLASpec.qk_nope_head_dim",
                  "MLASpec.qk_rope_head_dim", "MLASpec.v_head_dim")),
    "mlp": Block(lambda p: ".mlp." in p.name, ("mlp",),
                 ("ModelSpec.d_ff", "ModelSpec.mlp", "ModelSpec.activation", "ModelSpec.mlp_bias",
                  "ModelSpec.fused_gate_up")),
    "moe": Block(lambda p: ".moe." in p.name, ("mlp",),
                 ("MoESpec.n_experts", "MoESpec.top_k", "MoESpec.d_ff_expert", "MoESpec.n_shared_experts",
                  "MoESpec.router", "MoESpec.router_bias", "MoESpec.expert_bias", "MoESpec.shared_expert_gate")),
    "layer": Block(_layer_norm, ("layer",),
                   ("ModelSpec.block", "ModelSpec.norm_placement", "ModelSpec.parallel_norms",
                    "ModelSpec.resid_dropout")),
    "adapters": Block(lambda p: p.kind == "lora", ("attention", "mlp"),
                      ("LoraSpec.rank", "LoraSpec.targets", "LoraSpec.dropout", "LoraSpec.dora", "LoraSpec.dtype")),
    "head": Block(lambda p: p.name.startswith(("lm_head", "final_norm")), ("head", "loss"),
                  ("ModelSpec.vocab_size", "ModelSpec.tie_embeddings", "ModelSpec.lm_head_bias",
                   "ModelSpec.final_norm", "ModelSpec.logit_softcap")),
}


def param_bytes(exp: ExperimentSpec, block: Block) -> tuple:
    """The block's parameters: (name, shape) of each, and their elements."""
    mine = [p for p in param_inventory(exp.model, exp.training.lora) if block.owns(p)]
    return tuple((p.name, p.shape) for p in mine), sum(p.numel for p in mine)


def saved_bytes(exp: ExperimentSpec, roles: tuple[str, ...]) -> int:
    """Bytes the nodes of ``roles`` save for backward in one eager forward (each tensor once)."""
    sim = Sim()
    Forward(sim, exp, make_params(sim, exp), LayerStrategy()).run()
    seen: set[int] = set()
    total = 0
    for node in sim.nodes:
        if node.role in roles:
            for t in node.saved:
                if id(t) not in seen:
                    seen.add(id(t))
                    total += t.nbytes
    return total


#: a value of a block's own where the field contract's moves the estimate but not this block's bytes
#: (pre -> post norm keeps the layer's norms and the sizes they save: the order of the adds differs)
VALUES: dict[tuple[str, str], Any] = {("layer", "ModelSpec.norm_placement"): "sandwich"}

CASES = [(name, key) for name, block in BLOCKS.items() for key in block.fields]


def test_every_block_field_is_a_contract_field() -> None:
    assert not [key for _, key in CASES if key not in PERTURB]


@pytest.mark.parametrize(("name", "key"), CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_block_field_moves_its_bytes(name: str, key: str) -> None:
    block = BLOCKS[name]
    setup, value = PERTURB[key]
    value = VALUES.get((name, key), value)
    setup = _setup_for(name, setup)
    base = build(setup)
    changed = perturbed(base, key, value)
    before: Any = (param_bytes(base, block), saved_bytes(base, block.roles))
    after: Any = (param_bytes(changed, block), saved_bytes(changed, block.roles))
    assert before != after, f"{key} = {value!r} moves neither the parameters nor the saved bytes of block {name}"


def _setup_for(name: str, setup: dict) -> dict:
    """The field contract's setup, with the block present (MoE, MLA, LoRA)."""
    needs = {"moe": ("model", "moe", dict(n_experts=4, top_k=2, d_ff_expert=128)),
             "mla": ("model", "mla", dict(q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
                                          v_head_dim=32))}
    if name in needs:
        part, field, value = needs[name]
        inner = setup.get(part, {})
        if field not in inner:
            setup = {**setup, part: {**inner, field: value}}
    if name == "adapters" and "lora" not in setup:
        setup = {**setup, "lora": {}}
    return setup


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
    base = build(_setup_for(name, setup))
    for exp in (base, perturbed(base, key, VALUES.get((name, key), value))):
        if unbuilt_features(exp.model):
            pytest.skip(f"the replica does not build {unbuilt_features(exp.model)}")
        net = build_model(exp.model, exp.training, exp.profile, device="meta")
        twin = {n.replace("_proj_lora_", "_proj.lora_"): tuple(p.shape) for n, p in net.named_parameters()}
        mine = {p.name: p.shape for p in param_inventory(exp.model, exp.training.lora) if block.owns(p)}
        assert {n: s for n, s in twin.items() if n in mine or _owned_name(block, n)} == mine


def _owned_name(block: Block, name: str) -> bool:
    """Whether a parameter of the twin called ``name`` is the block's (its predicate on a stand-in)."""
    layer = int(name.split(".")[1]) if name.startswith("layers.") else None
    kind = "lora" if ".lora_" in name else ""
    return block.owns(ParamTensor(name, (), layer, False, kind))
