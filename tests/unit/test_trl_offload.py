"""TRL's activation offloading rules on the simulator (memcalc/engine/offload_trl.py), each against the
torchtune rules it departs from (memcalc/engine/offload.py): the storage dedup, parameter storages kept,
parameters' pack ids, and the graph the last unpacking node keeps. Torch-free; the traced evidence is
tests/trace/test_trl_grid.py (TRL 1.16's own OffloadActivations on meta)."""

from __future__ import annotations

from memcalc.core.rules import MAX_FWD_STASH
from memcalc.engine.offload import ActivationOffload
from memcalc.engine.offload_trl import TrlActivationOffload
from memcalc.engine.sim import Sim

KB64 = 64 * 1024


def _sim(off: ActivationOffload) -> Sim:
    sim = Sim()
    sim.set_offload(off)
    off.active = True
    return sim


def _act(sim: Sim, n: int = KB64):
    return sim.alloc(n, "activations", "saved activations", numel=n // 2, itemsize_bits=16)


def test_a_second_save_of_a_stashed_block_stays_on_the_device():
    """source: trl/models/activation_offloading.py pack_tensor: ``storage_key in self.storage_to_tensor_id``
    keeps the tensor (an RMSNorm's input saved by pow and by mul); torchtune offloads it twice."""
    for off, offloaded, host in ((TrlActivationOffload(), 1, KB64), (ActivationOffload(), 2, 2 * KB64)):
        sim = _sim(off)
        x = _act(sim)
        _, off1 = off.pack(sim, [x])
        keep2, off2 = off.pack(sim, [x])
        assert len(off1) + len(off2) == offloaded
        assert off.host_bytes == host
        if isinstance(off, TrlActivationOffload):
            assert keep2 == [x]  # kept as it is: autograd holds it to its backward


def test_the_key_goes_with_the_forward_stash():
    """source: release_storage_key as the stash drops an id: a save MAX_FWD_STASH ids later is offloaded
    again (a second host copy)."""
    off = TrlActivationOffload()
    sim = _sim(off)
    x = _act(sim)
    off.pack(sim, [x])
    for _ in range(MAX_FWD_STASH):
        off.pack(sim, [_act(sim)])
    _, again = off.pack(sim, [x])
    assert again and off.host_bytes == (MAX_FWD_STASH + 2) * KB64


def test_weight_views_are_kept_and_parameters_take_an_id():
    """source: update_model_params / ``data_ptr() in self.param_storages`` (a ``weight.t()`` view is no
    copy), and ``get_tensor_id()`` before every check (a saved nn.Parameter, ``None`` here, is an id)."""
    off = TrlActivationOffload()
    sim = _sim(off)
    w = sim.alloc(KB64, "weights", "frozen base weights")
    keep, out = off.pack(sim, [w, None])
    assert keep == [w] and out == [] and off.host_bytes == 0 and off.next_id == 2
    torchtune = ActivationOffload()
    sim2 = _sim(torchtune)
    _, out2 = torchtune.pack(sim2, [sim2.alloc(KB64, "weights", "frozen base weights")])
    assert len(out2) == 1  # torchtune's rule offloads the view


def test_the_last_graph_is_held_until_the_next_backward_unpacks():
    """source: ``self.curr_autograd_node = node`` is replaced only at the next backward's first unpack: the
    input leaf and its .grad live on (keep_graph), and a steady step starts with them (carry_prior)."""
    off = TrlActivationOffload(prior=True)
    sim = _sim(off)
    leaf = _act(sim)
    before = sim.total
    off.carry_prior(sim, leaf)
    off.carry_prior(sim, leaf)  # once per step
    assert sim.total == before + 2 * KB64
    off.pack(sim, [_act(sim)])  # a forward
    held = list(off.held)

    class _Node:  # what unpack reads of a node (nothing of its own comes back)
        offloaded: tuple = ()
        on_backward = None

    off.unpack(sim, _Node())
    assert all(not t.alive for t in held) and off.held == []
    base = ActivationOffload()
    sim2 = _sim(base)
    base.carry_prior(sim2, _act(sim2))
    base.keep_graph(sim2, (leaf,))
    assert sim2.total == KB64  # torchtune's estimate: nothing carried
