"""What each part of the replica saves for backward in one forward: the twin of the simulator's node
roles (:mod:`memcalc.engine.forward`: ``embedding``, ``layer``, ``attention``, ``mlp``, ``head``), for
``tests/trace/test_blocks_twin.py``.

The replica's forward runs under ``torch.autograd.graph.saved_tensors_hooks``; each saved tensor is
attributed to the part running the op that saves it (module forward pre/post hooks on the
attention, feed-forward and layer modules; the ``Decoder``'s labels for the embedding and the head),
as the simulator attributes a node's saved tensors to the role current when the node is recorded.
A storage counts once per role however many views of it are saved, at ``nbytes`` rounded to 512
(the tracer's rounding, :mod:`.tracer`). Left out, as the simulation lists them under no node:

- parameters (a node saves a weight only as its autocast copy, an allocation: ``Ops.linear``);
- storages off the traced device (the CUDA kernels' philox seed and offset live on the host;
  :mod:`.blocks.sdpa` makes them host tensors on meta), as :class:`.tracer.StorageTracer`;
- the RoPE cos/sin tables (the simulation holds them for the step, ``Forward.run``'s "rope
  tables", and no node lists them: ``Ops.rope``);
- what a graph that dies inside the forward saved (DoRA's ``get_lora_weight`` product): only what
  is still held for backward when the forward returns counts.

Checkpointing is off (the simulation's per-role saved bytes are those of one eager forward).
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import torch

from memcalc.core.spec import ExperimentSpec
from memcalc.core.units import round_up

from .blocks.attention import Attention
from .blocks.layer import DecoderLayer
from .blocks.mla import MLAttention
from .blocks.mlp import MLP
from .blocks.moe import MoEBlock
from .model import build_model
from .tracer import CUDA_ROUND_BYTES

#: the replica's modules and the simulator role of the ops they run (ops outside them: the role of
#: the Decoder's last label, "embedding" or "head": the head and the loss are one part here)
ROLES: dict[type, str] = {Attention: "attention", MLAttention: "attention", MLP: "mlp", MoEBlock: "mlp",
                          DecoderLayer: "layer"}


class _Held:
    """What the pack hook hands autograd: it dies with the graph that saved it."""

    __slots__ = ("__weakref__", "t")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def saved_by_role(exp: ExperimentSpec) -> dict[str, dict[int, int]]:
    """role -> {storage: rounded bytes} of what the replica of ``exp`` (built on meta, eager) keeps
    for backward after one forward (see the module docstring)."""
    tr = exp.training.model_copy(update={"checkpoint": "none"})
    net = build_model(exp.model, tr, exp.profile, device="meta")
    params = {p.untyped_storage()._cdata for p in net.parameters()}
    rope: set[int] = set()
    stack = ["embedding"]
    held: list[tuple[str, weakref.ref]] = []

    def label(text: str) -> None:
        stack[:] = ["embedding"] if text == "embedding" else ["head"] if text.startswith("head") else stack

    def enter(mod: Any, args: tuple, role: str) -> None:
        stack.append(role)

    def leave(mod: Any, args: tuple, out: Any) -> None:
        stack.pop()

    def tables(mod: Any, args: tuple) -> None:
        rope.update(t.untyped_storage()._cdata for t in args[1:3] if isinstance(t, torch.Tensor))

    def pack(t: torch.Tensor) -> Any:
        key = t.untyped_storage()._cdata
        if t.device.type != "meta" or key in params or key in rope:
            return t
        h = _Held(t)
        held.append((stack[-1], weakref.ref(h)))
        return h

    def unpack(h: Any) -> torch.Tensor:
        return h.t if isinstance(h, _Held) else h

    net.on_label = label
    hooks = [net.layers[0].register_forward_pre_hook(tables)]
    for mod in net.modules():
        role = ROLES.get(type(mod))
        if role is not None:
            hooks.append(mod.register_forward_pre_hook(lambda m, a, r=role: enter(m, a, r)))
            hooks.append(mod.register_forward_hook(leave))
    B, T = exp.training.batch, exp.training.seq
    ids = torch.randint(0, exp.model.vocab_size, (B, T), device="meta")
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = net(ids, ids.clone())
    for hook in hooks:
        hook.remove()
    gc.collect()
    out: dict[str, dict[int, int]] = {}
    for role, ref in held:  # all alive at once: distinct storages, distinct keys
        h = ref()
        if h is not None:
            st = h.t.untyped_storage()
            out.setdefault(role, {})[st._cdata] = round_up(st.nbytes(), CUDA_ROUND_BYTES)
    del loss
    return out


def role_bytes(saved: dict[str, dict[int, int]], roles: tuple[str, ...]) -> int:
    """The bytes ``roles`` save together (a storage saved by two of them once)."""
    union: dict[int, int] = {}
    for role in roles:
        union.update(saved.get(role, {}))
    return sum(union.values())
