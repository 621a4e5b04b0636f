"""One process plays rank ``r`` of ``N``: PyTorch's fake process group and a device mesh on ``cpu``.

``torch.testing._internal.distributed.fake_pg`` registers the ``fake`` backend (its import is the
registration, ``dist.Backend.register_backend(dist.Backend.FAKE, ...)``): every collective is a
no-op that returns at once, but the tensors it reads and writes are real allocations of the
caller, so FSDP's all-gather, reduce-scatter and prefetch buffers are made and freed as on GPUs.
``FakeStore`` replaces the rendezvous. The mesh is built outside any fake mode
(``init_device_mesh`` makes small real tensors of ranks).

:func:`fake_world` is a context manager: it initialises the default group (rank ``rank`` of
``world``), builds a 1-D mesh ``(world,)`` or a 2-D one (``shape=(dp, tp)``, ``names=("dp", "tp")``
for FSDP x tensor parallelism) and destroys the group on exit, so several traces of different
sizes run one after another in one process.

Tensor parallelism on the 2-D mesh (``tests/trace/test_sharded_trace.py``
``test_a_2d_mesh_parallelized_module_counts_local_shards``): build the model under
``FakeTensorMode()`` *and* ``torch.device("meta")``; ``parallelize_module(model, mesh["tp"], plan)``
(its DTensor parameters keep fake meta local shards); ``fully_shard(..., mesh=mesh["dp"])`` for
FSDP x TP; then, inside the fake mode, ``model.to_empty(device="cpu")`` (DTensor parameters swap,
plain fake ones do not). :class:`~.rank_tracer.RankTracer` counts each 2-D DTensor by its local
shard (1/(dp*tp) of a weight); the collectives ``parallelize_module``'s input/output hooks run
(``_c10d_functional.all_reduce`` / ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` and
``wait_tensor``) are ops on plain local tensors, so their outputs are counted like any other.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional, Sequence

import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from memcalc.core.errors import UserError

#: the device type the fake ranks' tensors report (fake tensors on it: nothing is allocated)
DEVICE = "cpu"


def check_world(world: int, rank: int, shape: Optional[Sequence[int]] = None) -> tuple[int, ...]:
    """The mesh shape for ``world`` ranks (one line of arithmetic when it does not fit)."""
    if world < 1:
        raise UserError(f"--gpus must be at least 1, got {world}")
    if not 0 <= rank < world:
        raise UserError(f"--rank {rank} is not a rank of {world} GPUs (valid: 0..{world - 1})")
    shape = tuple(shape) if shape else (world,)
    if math.prod(shape) != world:
        raise UserError(f"a mesh of {' x '.join(map(str, shape))} = {math.prod(shape)} ranks does not match "
                        f"{world} GPUs")
    return shape


@contextlib.contextmanager
def fake_world(world: int, rank: int = 0, shape: Optional[Sequence[int]] = None,
               names: Optional[Sequence[str]] = None) -> Iterator[DeviceMesh]:
    """Rank ``rank`` of ``world`` on the fake backend; yields the device mesh (1-D ``(world,)`` named
    ``("dp",)`` by default, or ``shape`` with ``names``, e.g. ``(2, 4)``, ``("dp", "tp")``)."""
    shape = check_world(world, rank, shape)
    names = tuple(names) if names else (("dp",) if len(shape) == 1 else ("dp", "tp")[: len(shape)])
    if len(names) != len(shape):
        raise UserError(f"mesh names {names} do not match the mesh shape {shape}")
    if dist.is_initialized():  # a trace that failed half-way, or a caller's own group: start clean
        dist.destroy_process_group()
    # DTensor's sharding propagation caches outlive a process group: an output spec cached for an earlier
    # world's mesh of the same shape (DeviceMesh compares by its ranks, not its groups) names that world's
    # process groups, which no longer resolve ("Could not resolve the process group registered under the
    # name 3": the pipeline x sequence-parallel trace of a second stage). Both caches are cleared: the C++
    # dispatch fast path's (torch._C._clear_DTensor_sharding_propagator_cache) and the Python one it falls
    # back on (torch/distributed/tensor/_sharding_prop.py LocalLRUCache)
    import torch
    from torch.distributed.tensor import DTensor

    torch._C._clear_DTensor_sharding_propagator_cache()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield init_device_mesh(DEVICE, shape, mesh_dim_names=names)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
