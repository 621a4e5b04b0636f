"""What other modules switch on a simulator: the one place where code outside :mod:`memcalc.engine.sim`
changes how a :class:`memcalc.engine.sim.Sim` behaves (a base class of it; ``Sim.__init__`` sets the
fields). Nothing else assigns a Sim's attributes (``tests/unit/test_sim_hooks.py`` checks):

- observers of the allocations and marks (:meth:`SimHooks.watch`, :mod:`memcalc.engine.observers`);
- the op recorder (:meth:`SimHooks.recording`: the compiled graph, a selective checkpoint's policy);
- what runs as a gradient becomes ready (:meth:`SimHooks.set_grad_ready`: a fused optimizer step,
  DeepSpeed's reduction), when backward enters another layer (:meth:`SimHooks.set_on_layer`: ZeRO-3's
  regather, FSDP2's hooks), activation offloading (:meth:`SimHooks.set_offload`);
- where the forward code is (:meth:`SimHooks.where`, :meth:`SimHooks.set_role`) and the allocations of
  a sharded runtime's layer hooks (:meth:`SimHooks.layer_hook`);
- a checkpointed region's first forward without grad (:meth:`SimHooks.no_grad`) and its recompute
  (:meth:`SimHooks.recomputing`, its nodes and ghost allocations :meth:`SimHooks.apart`).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from memcalc.engine.records import Node


class SimHooks:
    """The switches of :class:`memcalc.engine.sim.Sim` (see the module docstring); each restores or
    replaces what was there, so that no caller assigns a field of the simulator."""

    # (set by Sim.__init__)
    _on_row: list[Callable[[tuple[int, str, str, int]], None]]
    _on_event: list[Callable[[tuple[int, int]], None]]
    _on_peak: list[Callable[[int], None]]
    _on_phase: list[Callable[[str], None]]
    _on_mark: list[Callable[[], None]]
    recorder: Optional[Callable[..., None]]
    count_saves: Optional[Callable[..., None]]
    grad_enabled: bool
    grad_ready: Optional[Callable[..., None]]
    on_layer: Optional[Callable[..., None]]
    offload: Any
    ghosts: Optional[Container[int]]
    nodes: list[Node]
    alloc_count: int
    last_save_count: int
    last_save_hooks: int
    hook_allocs: int
    layer: Optional[int]
    role: str
    phase: str
    label: str
    trace_label: Optional[str]

    def watch(self, observer: object) -> None:
        """Register an observer (:mod:`memcalc.engine.observers`): each of its ``on_row``,
        ``on_event``, ``on_peak``, ``on_phase`` and ``on_mark`` methods is called from now on (and
        its ``bind(sim)`` now, for one that reads the simulator)."""
        bind = getattr(observer, "bind", None)
        if bind is not None:
            bind(self)
        for name in ("on_row", "on_event", "on_peak", "on_phase", "on_mark"):
            hook = getattr(observer, name, None)
            if hook is not None:
                getattr(self, "_" + name).append(hook)

    @contextmanager
    def recording(self, recorder: Callable[..., None]) -> Iterator[Optional[Callable[..., None]]]:
        """Within: ``recorder`` hears every op as the forward code issues it, before autograd
        filtering (:meth:`Sim.node`, :meth:`Sim.note_op`); yields the recorder it replaces (for it
        to chain), which comes back afterwards."""
        prev, self.recorder = self.recorder, recorder
        try:
            yield prev
        finally:
            self.recorder = prev

    @contextmanager
    def no_grad(self, count_saves: Optional[Callable[..., None]] = None) -> Iterator[None]:
        """Within: grad is disabled (a checkpointed region's first forward); :meth:`Sim.node` makes no
        node but calls ``count_saves(sim, saved, inputs, params, outputs, temps, grad_input_bytes, name, kw)``
        when given (:class:`memcalc.engine.checkpoint.FirstForward`)."""
        prev = self.count_saves
        self.count_saves, self.grad_enabled = count_saves, False
        try:
            yield
        finally:
            self.count_saves, self.grad_enabled = prev, True

    def saves_here(self) -> None:
        """The last node that saves something is here (:func:`memcalc.engine.checkpoint.count_save`)."""
        self.last_save_count = self.alloc_count
        self.last_save_hooks = self.hook_allocs

    def set_grad_ready(self, hook: Optional[Callable[..., None]]) -> None:
        """``hook(sim, param)`` runs as each parameter's gradient becomes ready (AccumulateGrad's
        post-accumulate-grad hook) until :meth:`Sim.release_graph`."""
        self.grad_ready = hook

    def set_on_layer(self, hook: Optional[Callable[..., None]]) -> None:
        """``hook(sim, layer)`` runs when backward moves on to a node of another decoder layer, or
        from a layer to a node outside the layers (``None``), until :meth:`Sim.release_graph`."""
        self.on_layer = hook

    def set_offload(self, offload: Any) -> None:
        """Activation offloading (:class:`memcalc.engine.offload.ActivationOffload`): while its
        ``active`` is set, saved tensors are packed to host memory and come back in backward."""
        self.offload = offload

    def where(self, layer: Optional[int], role: str) -> tuple[Optional[int], str]:
        """The forward code is in decoder layer ``layer`` (None: outside the layers), part ``role``
        of the model (every node records both); returns the previous pair (``where(*prev)``)."""
        prev = self.layer, self.role
        self.layer, self.role = layer, role
        return prev

    def set_role(self, role: str) -> str:
        """The forward code is in part ``role`` of the model; returns the previous one."""
        prev, self.role = self.role, role
        return prev

    def layer_hook(self, hook: Callable[[int], None], layer: int) -> None:
        """``hook(layer)``: a sharded runtime's per-layer forward hook (FSDP2's unshard), whose
        allocations are counted apart (``hook_allocs``: a checkpointed region's recompute does not
        repeat them)."""
        c = self.alloc_count
        hook(layer)
        self.hook_allocs += self.alloc_count - c

    @contextmanager
    def traced_as(self, label: str) -> Iterator[None]:
        """Within: allocations are traced (``on_row``) and exported under ``label`` instead of the
        current one, which no observer hears change (the optimizer's per-tensor temporaries apart
        from its new state: :mod:`memcalc.plan.depth` splits one per-layer run per block)."""
        prev, self.trace_label = self.trace_label, label
        try:
            yield
        finally:
            self.trace_label = prev

    def new_graph(self) -> None:
        """A micro-step's forward begins: no node registered yet."""
        self.nodes = []

    def use_graph(self, nodes: list) -> None:
        """Backward of a graph recorded earlier (pipeline parallelism keeps one per micro-batch in flight,
        :mod:`memcalc.engine.pipeline`): its nodes become the ones backward runs."""
        self.nodes = nodes

    @contextmanager
    def recomputing(self, layer: int, label: str) -> Iterator[None]:
        """Within: a checkpointed region's recompute in backward, in decoder layer ``layer``, labelled
        ``label`` (no observer hears of it: the allocations carry it); the phase and the layer come
        back afterwards (the label stays until backward marks its next one)."""
        phase, prev_layer = self.phase, self.layer
        self.phase, self.layer, self.label = "backward", layer, label
        try:
            yield
        finally:
            self.phase, self.layer = phase, prev_layer

    @contextmanager
    def apart(self, ghosts: Container[int]) -> Iterator[list[Node]]:
        """Within: the nodes made go to a list of their own (yielded), the allocations whose counts
        are in ``ghosts`` take no memory (:class:`memcalc.engine.checkpoint.Ghosts`); the graph and
        the ghosts before come back afterwards."""
        nodes, prev = self.nodes, self.ghosts
        self.nodes, self.ghosts = [], ghosts
        try:
            yield self.nodes
        finally:
            self.nodes, self.ghosts = nodes, prev
