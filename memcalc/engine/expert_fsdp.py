"""FSDP2 x expert parallelism (``--ep`` with ``--zero 2/3``): how FSDP2 shards and gathers the routed
experts on one rank, as torchtitan 0.3.0's ``apply_fsdp_to_decoder`` lays them out
(``torchtitan/distributed/fsdp.py``) over torch 2.13's ``fully_shard`` with a per-parameter mesh.
The dispatch and the experts' step are :mod:`memcalc.engine.expert_parallel`'s."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from memcalc.core.spec import ExperimentSpec, ModelSpec
from memcalc.engine.fsdp import FSDP2, Unit, padded_shard_numel


def expert_fsdp_world(exp: ExperimentSpec) -> int:
    """The ranks FSDP2 shards the routed experts over: torchtitan's ``efsdp`` mesh, ``gpus / ep``
    (parallel_dims.py ``efsdp = fsdp * tp // ep``); the rest of the model is sharded over ``gpus``."""
    return exp.training.gpus // exp.training.ep


def routed_experts(m: ModelSpec) -> int:
    """The routed experts of each MoE layer of ``m`` (0 for a dense model)."""
    return m.moe.n_experts if m.moe is not None else 0


def shard_world(kind: str, n: int, ep: int) -> int:
    """The ranks a parameter of ``kind`` is FSDP-sharded over: ``n / ep`` (``efsdp``) for the routed
    experts under expert parallelism, ``n`` otherwise."""
    return n // ep if kind == "experts" else n


def fsdp_shard_numel(shape: tuple[int, ...], kind: str, n: int, ep: int, n_experts: int, titan: bool = False) -> int:
    """Elements of one rank's padded FSDP2 shard of a parameter of ``kind`` with local ``shape``:
    over ``n`` ranks on dim 0, except, with ``ep`` > 1 or ``titan`` (torchtitan's layout without
    expert parallelism: under ``--pp``), the routed experts (torchtitan 0.3.0
    distributed/fsdp.py ``apply_fsdp_to_decoder``): over ``n / ep`` ranks (the ``efsdp`` mesh), on
    dim 0 (``Shard(0)``), or on dim 1 (``Shard(1)``) when ``efsdp x ep`` exceeds the experts
    ("to avoid padding"). FSDP2 pads every rank's chunk to the first's (``torch.chunk``)."""
    if (ep == 1 and not titan) or kind != "experts":
        return padded_shard_numel(shape, n)
    world = n // ep
    if world * ep <= n_experts or len(shape) < 2:
        return padded_shard_numel(shape, world)
    rest = 1
    for d in shape[2:]:
        rest *= d
    return shape[0] * -(-shape[1] // world) * rest


def shard1_cat(sim, with_grad: list, dim1: Callable[[Any], bool]) -> list:
    """torch 2.13 ``_fsdp_collectives.py`` ``foreach_reduce``'s loop over the group's gradients before the
    reduce-scatter input: a ``Shard(1)`` parameter's gradient is replaced in the list by ``torch.cat(chunks, dim=0)``
    of ``chunks = torch.chunk(grad, world_size, dim=1)`` (a copy of its size). Its original lives on in ``chunks``
    (views of it) until the next ``Shard(1)`` parameter's ``torch.chunk`` rebinds it (the loop variable
    ``unsharded_grad`` has moved on by then), the last one's until the function returns, as the loop variable's
    last gradient does. Returns those two (what the caller frees after the reduce)."""
    held = None  # the last Shard(1) original, referenced by ``chunks`` only
    for p, _ in with_grad:
        if dim1(p):
            if held is not None:
                sim.unref(held)  # ``chunks`` rebinds
            held = p.unsharded_grad
            p.unsharded_grad = sim.alloc(held.nbytes, "temporaries", "reduce-scatter buffers (FSDP2)")
    last = with_grad[-1][0].unsharded_grad  # the loop variable (a Shard(1) one's: the original, ``held``)
    if held is None or dim1(with_grad[-1][0]):
        return [held if held is not None else last]
    return [last, held]


class EPFSDP2(FSDP2):
    """torchtitan 0.3.0's ``apply_fsdp_to_decoder`` with ``ep_degree > 1``, over torch 2.13's FSDP2:

    - each MoE layer is one ``fully_shard`` with a ``shard_placement_fn`` that puts the routed
      experts on the ``efsdp`` mesh: FSDP2 makes one parameter group per process group
      (``_fsdp_init.py``, "per-param mesh"): the layer's other parameters (over ``gpus``), then
      its experts (over ``gpus / ep``), each with its own all-gather, copy-out, reshard and
      reduce-scatter, in that order (``FSDPState._pre_forward`` / ``_pre_backward`` loop over
      ``_fsdp_param_groups``);
    - torchtitan's explicit prefetching for EP (``set_modules_to_forward_prefetch`` the next
      layer, ``set_modules_to_backward_prefetch`` the one before): after a layer's groups are
      unsharded in forward, the next layer's groups are all-gathered; in backward, after a
      layer's, the previous layer's (experts first: ``reversed(_fsdp_param_groups)``); the
      root's default backward prefetch all-gathers the last layer's last group alone."""

    def __init__(self, sim, exp: ExperimentSpec, params: list, shapes: dict) -> None:
        super().__init__(sim, exp, params, shapes)
        tr = exp.training
        self.dp = tr.gpus
        world = expert_fsdp_world(exp)
        assert exp.model.moe is not None
        n_experts = exp.model.moe.n_experts
        groups: dict[Optional[int], list[Unit]] = {}
        for i, u in self.layers.items():
            dense = [(p, s) for p, s in zip(u.params, u.shard_numels, strict=True) if ".moe.experts." not in p.name]
            experts = [p for p in u.params if ".moe.experts." in p.name]
            units = [u] if not experts else [Unit(i, [p for p, _ in dense], [s for _, s in dense])]
            if experts:
                ex = Unit(i, experts, [fsdp_shard_numel(shapes[p.name], "experts", tr.gpus, tr.ep,
                                                        n_experts) for p in experts])
                ex.world = world  # type: ignore[attr-defined]
                ex.dim1 = world > 1 and world * tr.ep > n_experts  # type: ignore[attr-defined]  # Shard(1)
                units.append(ex)
            groups[i] = units
        self.groups = groups
        self.current_groups: Optional[list] = None

    def _world(self, u) -> None:
        self.n = getattr(u, "world", self.dp)

    def unshard(self, u) -> None:
        self._world(u)
        if self.n == 1:  # FSDPParamGroup.unshard, world size 1: no all-gather (the persistent empty output)
            return
        super().unshard(u)

    def wait_for_unshard(self, u, forward: bool) -> None:
        self._world(u)
        if self.n > 1:
            # Shard(1) (torch 2.13 _fsdp_collectives.py foreach_all_gather_copy_out): each parameter's all-gather
            # output gets a temporary ``empty_like`` to copy into, chunk-cat into the output on dim 1; the list
            # holding them goes as the function returns
            temps = [self.sim.alloc(self.n * self._param_dtype_bytes(p, s), "temporaries", "all-gather buffers "
                                    "(FSDP2)") for p, s in zip(u.params, u.shard_numels, strict=True)] \
                if getattr(u, "dim1", False) and u.ag_out is not None else []
            super().wait_for_unshard(u, forward)
            for t in temps:
                self.sim.unref(t)
            return
        # world size 1 (gpus == ep): the previous all-gather state freed in forward, then each
        # parameter's unsharded copy allocated and copied from its shard; nothing kept
        if forward and self.ag_state is not None:
            self.sim.unref(self.ag_state)
            self.ag_state = None
        if u.resharded:
            u.unsharded = [self.sim.alloc(self._param_dtype_bytes(p, s), "weights", "unsharded parameters (FSDP2)")
                           for p, s in zip(u.params, u.shard_numels, strict=True)]
            u.resharded = False

    def post_backward(self, u) -> None:
        self._world(u)
        self._dim1 = self.n > 1 and getattr(u, "dim1", False)
        super().post_backward(u)

    def _reduce_loop(self, with_grad: list):
        if not getattr(self, "_dim1", False):
            return super()._reduce_loop(with_grad)
        return shard1_cat(self.sim, with_grad, lambda p: True)  # (the experts' group: every parameter Shard(1))

    def layer_enter(self, i: int) -> None:
        if self.in_backward:
            return
        for u in self.groups[i]:
            self.unshard(u)
            self.wait_for_unshard(u, forward=True)
        for u in self.groups.get(i + 1, []):  # explicit forward prefetch (torchtitan, EP)
            self.unshard(u)

    def layer_exit(self, i: int) -> None:
        if self.in_backward:
            return
        for u in self.groups[i]:
            if self.pol.reshard_after_forward:
                self.reshard(u)
            self.order.append(u)

    def backward_enter(self, layer: Optional[int]) -> None:
        cur = self.current_groups
        if layer is not None and cur is not None and cur[0].layer == layer:
            return
        if layer is None and cur is None:
            return
        self.finish_current_groups()
        if layer is not None:
            units = self.groups[layer]
            for u in units:
                self.unshard(u)
                self.wait_for_unshard(u, forward=False)
            # explicit backward prefetch (layer 0 has none: its default one finds only the root, unsharded)
            for u in reversed(self.groups.get(layer - 1, [])):
                self.unshard(u)
            self.current_groups = units

    def finish_current_groups(self) -> None:
        """The post-backward of the layer whose groups' backward has run (its gradients reduced), if any."""
        if self.current_groups is not None:
            for u in self.current_groups:
                self.post_backward(u)
            self.current_groups = None

    def end_backward(self) -> None:
        self.finish_current_groups()
        self.post_backward(self.root)
        if self.rs_state is not None:
            self.sim.unref(self.rs_state)
            self.rs_state = None
        for units in self.groups.values():
            for u in units:
                if not u.resharded:
                    self.reshard(u)
        self.in_backward = False


def ep_fsdp2(sim, exp: ExperimentSpec, params: list, shapes: dict) -> EPFSDP2:
    """FSDP2 with expert parallelism on one rank (:class:`EPFSDP2`)."""
    return EPFSDP2(sim, exp, params, shapes)
