"""``memcalc compare``: a PyTorch memory snapshot replayed, attributed by kind and held against the
estimate (torch-free: the snapshots are small dicts pickled here, in both styles: memcalc's frames and
a real run's stacks)."""

from __future__ import annotations

import os
import pickle
from types import SimpleNamespace

import pytest
from conftest import cli_run, one_line_error

from memcalc.core.errors import UserError
from memcalc.engine.result import KINDS, TimelinePoint
from memcalc.snapshot.attribute import BACKWARD, FORWARD, OPTIMIZER, entry_phase
from memcalc.snapshot.compare import PART_FRACTION, compare, comparison_lines
from memcalc.snapshot.format import memcalc_frame
from memcalc.snapshot.reader import read_snapshot
from memcalc.snapshot.replay import pick_device, replay

MiB = 2**20

# -- frames of a real CUDA run (the shapes torch/csrc/profiler/combined_traceback.cpp symbolizes) ------
PY_FORWARD = {"filename": "/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py", "line": 125,
              "name": "forward"}
PY_CALL = {"filename": "/venv/lib/python3.11/site-packages/torch/nn/modules/module.py", "line": 1784,
           "name": "_call_impl"}
CPP_ENGINE = {"filename": "??", "line": 0, "name": "torch::autograd::Engine::evaluate_function(...)"}
PY_ENGINE = {"filename": "/venv/lib/python3.11/site-packages/torch/autograd/graph.py", "line": 829,
             "name": "_engine_run_backward"}
PY_ADAMW = {"filename": "/venv/lib/python3.11/site-packages/torch/optim/adamw.py", "line": 430,
            "name": "_multi_tensor_adamw"}
CPP_WORKSPACE = {"filename": "??", "line": 0, "name": "at::cuda::getNewWorkspace()"}
PY_TRAIN = {"filename": "train.py", "line": 10, "name": "<module>"}


@pytest.mark.parametrize("frames, phase", [
    ([PY_FORWARD, PY_CALL, PY_TRAIN], FORWARD),  # source: torch/nn/modules/module.py _call_impl -> forward
    ([CPP_ENGINE, PY_TRAIN], BACKWARD),  # source: torch/csrc/autograd/engine.cpp Engine::evaluate_function
    ([PY_ENGINE, PY_TRAIN], BACKWARD),  # source: torch/autograd/graph.py _engine_run_backward
    ([PY_FORWARD, PY_CALL, CPP_ENGINE], BACKWARD),  # source: checkpoint recompute runs forward inside the engine
    ([PY_ADAMW, PY_TRAIN], OPTIMIZER),  # source: torch/optim/adamw.py _multi_tensor_adamw
    ([{"filename": "/x/bitsandbytes/optim/optimizer.py", "line": 1, "name": "step"}], OPTIMIZER),  # source: bnb step
    ([PY_TRAIN], None),  # source: a frame of the user's script shows no phase
    # source: torch/utils/checkpoint.py, the non-reentrant checkpoint's recompute runs from the unpack hook
    ([PY_FORWARD, PY_CALL, {"filename": "/venv/lib/python3.11/site-packages/torch/utils/checkpoint.py", "line": 1,
                            "name": "recompute_fn"}], BACKWARD),
    ([memcalc_frame("activations", 2, "x"), {"filename": "memcalc", "line": 0, "name": "forward"}], "forward"),
])
def test_entry_phase(frames, phase):
    assert entry_phase(frames) == phase


def _pickle(tmp_path, obj, name="s.pickle"):
    p = tmp_path / name
    p.write_bytes(pickle.dumps(obj))
    return str(p)


def _real_snapshot():
    """A real-style step (sizes in MiB, multiples of 512 B so rounding keeps them): 8 weights before
    recording (a segment block), a 1 workspace, forward: 4 saved + 2 freed in forward; backward: 8
    gradients kept + 3 freed; optimizer: 16 state kept + 8 freed; zero_grad frees the gradients."""
    t = []

    def alloc(addr, mib, frames):
        t.append({"action": "alloc", "addr": addr, "size": mib * MiB, "stream": 0, "frames": frames})

    def free(addr, mib, frames):
        t.append({"action": "free_requested", "addr": addr, "size": mib * MiB, "stream": 0, "frames": frames})
        t.append({"action": "free_completed", "addr": addr, "size": mib * MiB, "stream": 0, "frames": frames})

    fwd, bwd, opt = [PY_FORWARD, PY_CALL, PY_TRAIN], [CPP_ENGINE, PY_TRAIN], [PY_ADAMW, PY_TRAIN]
    alloc(100, 1, [CPP_WORKSPACE, *fwd])
    alloc(200, 4, fwd)
    alloc(300, 2, fwd)
    free(300, 2, fwd)
    alloc(400, 8, bwd)  # the gradient
    alloc(500, 3, bwd)  # an activation gradient: peak here = 8 + 1 + 4 + 8 + 3 = 24
    free(500, 3, bwd)
    free(200, 4, bwd)
    alloc(600, 16, opt)
    alloc(700, 8, opt)  # 8 + 1 + 8 + 16 + 8 = 41: the peak
    free(700, 8, opt)
    free(400, 8, opt)  # zero_grad
    segments = [{"device": 0, "address": 0, "total_size": 8 * MiB, "stream": 0, "blocks": [
        {"address": 0, "size": 8 * MiB, "requested_size": 8 * MiB, "state": "active_allocated", "frames": []}]}]
    return {"segments": segments, "device_traces": [t]}


def test_two_recorded_steps():
    """docs/compare.md's recipe: recording from before the first step, two steps; the state made in the
    first step's optimizer step is optimizer state, each step's gradients are gradients, and the peak is
    the second step's (the state exists then)."""
    snap = _real_snapshot()
    t = snap["device_traces"][0]
    fwd, bwd, opt = [PY_FORWARD, PY_CALL, PY_TRAIN], [CPP_ENGINE, PY_TRAIN], [PY_ADAMW, PY_TRAIN]
    for action, addr, mib, frames in [("alloc", 210, 4, fwd), ("alloc", 410, 8, bwd), ("free", 210, 4, bwd),
                                      ("alloc", 710, 9, opt), ("free", 710, 9, opt), ("free", 410, 8, opt)]:
        for a in (["alloc"] if action == "alloc" else ["free_requested", "free_completed"]):
            t.append({"action": a, "addr": addr, "size": mib * MiB, "stream": 0, "frames": frames})
    rep = replay(snap, 0)
    kinds = {a.addr: a.kind for a in rep.allocations}
    # source: attribute.real_kind, the second step's allocations
    assert (kinds[210], kinds[410], kinds[600], kinds[710]) == ("activations", "gradients", "optimizer_state",
                                                                "temporaries")
    c = compare(rep, _estimate(), "s.pickle")
    assert c.measured_peak_bytes == 41 * MiB  # weights 8 + state 16 + gradients 8 + step temporaries 9
    assert rep.phases[-1] == OPTIMIZER
    # the last step is compared; the first (which made the state: 8 + 1 + 8 + 16 + 8 = 41 with the workspace,
    # 40 without) beside the estimate's first step
    assert c.steps == 2 and c.first_step == (32 * MiB, 40 * MiB)
    assert comparison_lines(c)[2].startswith("2 steps recorded: the last is compared (the steady state); the first "
                                             "peaks at 40.00 MiB, +25.0% against the estimate's first step")


def test_python_frames_only():
    """A snapshot recorded with stacks="python" (validate --protocol's): the engine's device thread holds no
    Python frame, so backward's allocations have none; the kinds come out as with every frame."""
    snap = _real_snapshot()
    for e in snap["device_traces"][0]:  # the engine's thread: no frame at all; the loop's: its Python frames
        e["frames"] = [] if CPP_ENGINE in e["frames"] else [f for f in e["frames"] if f is not CPP_WORKSPACE]
    rep = replay(snap, 0)
    kinds = {a.addr: a.kind for a in rep.allocations}
    # source: attribute's docstring (no frame after a forward began: backward); the workspace needs C++ frames
    assert (kinds[200], kinds[400], kinds[500], kinds[600]) == ("activations", "gradients", "temporaries",
                                                                "optimizer_state")
    assert kinds[100] == "activations"  # the cuBLAS workspace, unnamed without its C++ frame: a known limit


def _estimate(**kw):
    """The attributes of memcalc.engine.result.Estimate that compare reads."""
    base = dict(peak_bytes=40 * MiB, peak_phase=OPTIMIZER, peak_label="optimizer step", first_step_peak_bytes=32 * MiB,
                components_by_kind={"weights": 8 * MiB, "optimizer_state": 16 * MiB, "gradients": 8 * MiB,
                                    "activations": 0, "temporaries": 8 * MiB},
                phases={FORWARD: 14 * MiB, BACKWARD: 23 * MiB, OPTIMIZER: 40 * MiB},
                timeline=[TimelinePoint(0, "fwd", FORWARD, {k: 0 for k in KINDS})],
                device_parts={"workspace_bytes": 1 * MiB})
    base.update(kw)
    return SimpleNamespace(**base)


def test_real_snapshot_kinds_at_peak():
    rep = replay(_real_snapshot(), 0)
    kinds = {a.addr: a.kind for a in rep.allocations}
    # source: the attribution rules of memcalc/snapshot/attribute.py, one allocation each
    assert kinds == {0: "weights", 100: "workspace", 200: "activations", 300: "temporaries", 400: "gradients",
                     500: "temporaries", 600: "optimizer_state", 700: "temporaries"}
    c = compare(rep, _estimate(), "s.pickle")
    assert c.measured_peak_bytes == 40 * MiB  # 41 less the workspace
    assert c.measured_phase == OPTIMIZER
    got = {r.name: (r.predicted_bytes, r.measured_bytes) for r in c.kinds}
    assert got["optimizer_state"] == (16 * MiB, 16 * MiB) and got["gradients"] == (8 * MiB, 8 * MiB)
    assert got["workspace"] == (1 * MiB, 1 * MiB)
    assert c.parts_at is None  # every phase within PART_FRACTION: forward 14, backward 23, optimizer 40


def test_first_parting_phase():
    est = _estimate(phases={FORWARD: 14 * MiB, BACKWARD: 30 * MiB, OPTIMIZER: 40 * MiB},
                    timeline=[TimelinePoint(0, "bwd", BACKWARD, {"weights": 8 * MiB, "gradients": 15 * MiB,
                                                                  "activations": 4 * MiB, "temporaries": 3 * MiB})])
    c = compare(replay(_real_snapshot(), 0), est, "s.pickle")
    assert 7 * MiB > PART_FRACTION * est.peak_bytes
    assert c.parts_at["phase"] == BACKWARD and c.parts_at["difference_bytes"] == -7 * MiB
    assert c.parts_at["kind"] == "gradients"
    lines = comparison_lines(c)
    assert lines[0].startswith("Measured peak 40.00 MiB in optimizer step: +0.0%, within 1% of the predicted")
    assert lines[1].startswith("They part in backward: measured 23.00 MiB vs predicted 30.00 MiB")


def _memcalc_snapshot(est):
    """A snapshot in memcalc's style holding exactly the estimate's peak, kind by kind: one block per
    kind allocated in the peak's phase, then freed."""
    t = []
    for i, (kind, n) in enumerate(est.components_by_kind.items()):
        if n:
            frames = [memcalc_frame(kind, 0, f"{kind} block"), {"filename": "memcalc", "line": 0,
                                                                "name": est.peak_phase}]
            t.append({"action": "alloc", "addr": 4096 * (i + 1), "size": n, "stream": 0, "frames": frames})
    for e in list(t):
        t.append({**e, "action": "free_requested"})
    return {"segments": [], "device_traces": [t]}


def test_memcalc_snapshot_round_trip(tmp_path):
    est = _estimate()
    path = _pickle(tmp_path, _memcalc_snapshot(est))
    rep = replay(read_snapshot(path), 0)
    assert rep.memcalc_frames
    c = compare(rep, est, path)
    assert c.source == "memcalc" and c.measured_peak_bytes == est.peak_bytes
    assert all(r.measured_bytes == r.predicted_bytes for r in c.kinds)


class _Evil:
    def __reduce__(self):
        return os.system, ("touch pwned",)


def _rows(tmp_path):
    """(args, exit code, message) for the command line; files made in tmp_path."""
    good = _pickle(tmp_path, _real_snapshot(), "good.pickle")
    two = _real_snapshot()
    two["device_traces"].append(list(two["device_traces"][0]))
    bad_size = _real_snapshot()
    bad_size["device_traces"][0][0]["size"] = -5
    (tmp_path / "text.pickle").write_text("not a pickle at all")
    setup = ["--model", "gpt2", "--batch", "1", "--seq", "128"]
    return [
        # source: memcalc/snapshot/reader.py read_snapshot, a missing file
        ([str(tmp_path / "nope.pickle"), *setup], 2, "not found"),
        # source: reader.DataOnlyUnpickler.find_class refuses every global (no code runs)
        ([_pickle(tmp_path, _Evil(), "evil.pickle"), *setup], 2, "refused global"),
        # source: reader.read_snapshot, a file that is no pickle
        ([str(tmp_path / "text.pickle"), *setup], 2, "is not a PyTorch memory snapshot pickle"),
        # source: reader.check_snapshot, a pickle of another shape
        ([_pickle(tmp_path, [1, 2], "list.pickle"), *setup], 2, "no 'segments' and 'device_traces'"),
        # source: replay._int, a negative size
        ([_pickle(tmp_path, bad_size, "neg.pickle"), *setup], 2, "not a non-negative integer"),
        # source: replay.pick_device, an empty trace
        ([_pickle(tmp_path, {"segments": [], "device_traces": [[]]}, "empty.pickle"), *setup], 2, "trace is empty"),
        # source: replay.pick_device, two traced devices
        ([_pickle(tmp_path, two, "two.pickle"), *setup], 2, "pick one with --device"),
        ([_pickle(tmp_path, two, "two2.pickle"), "--device", "5", *setup], 2, "--device 5"),
        # source: the estimate's own checks (memcalc.api.estimate)
        ([good, "--model", "gpt2", "--batch", "0"], 2, "--batch must be positive"),
        ([good, "--device", "1", *setup], 2, "--device 1"),
        ([good, *setup], 0, "Measured peak"),
        ([good, "--device", "0", *setup, "--json"], 0, '"kinds_at_peak"'),
    ]


@pytest.mark.slow  # 12 command lines at about 40 ms each (typer builds the command every time)
def test_cli_rows(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for args, code, message in _rows(tmp_path):
        r = cli_run(["compare", *args])
        if code == 2:
            one_line_error(r, code, message)
        else:
            assert r.exit_code == code and message in r.stdout, (args, r.output)
    assert not (tmp_path / "pwned").exists()


def test_cli_rows_quick(tmp_path, monkeypatch):
    """The quick lane's share of the rows: the reader's refusals called directly, and one command
    line (a pickle that names a callable: one line, exit 2, and nothing ran)."""
    monkeypatch.chdir(tmp_path)
    rows = _rows(tmp_path)
    for args, _, message in rows[:7]:
        try:
            snap = read_snapshot(args[0])
            replay(snap, pick_device(snap, None))
        except UserError as e:
            assert message in str(e)
        else:
            raise AssertionError(f"{args[0]}: no error")
    args, code, message = rows[1]
    one_line_error(cli_run(["compare", *args]), code, message)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.slow  # two estimates written as snapshots and compared: about 1 s
@pytest.mark.parametrize("setup", [
    # source: memcalc.snapshot.export, the steady-state step of a full fine-tune (peak in the optimizer step)
    ["--model", "gpt2", "--batch", "1", "--seq", "128", "--bf16"],
    # source: LoRA with full checkpointing (the recompute's allocations in backward)
    ["--params", "60M", "--seq", "256", "--lora", "--checkpoint", "full"],
])
def test_estimate_snapshot_compares_to_the_byte(tmp_path, setup):
    import json

    path = str(tmp_path / "step.pickle")
    assert cli_run(["estimate", *setup, "--snapshot", path]).exit_code == 0
    r = cli_run(["compare", path, *setup, "--json"])
    doc = json.loads(r.stdout)
    assert doc["attributed_from"] == "memcalc" and doc["peak"]["difference_bytes"] == 0
    assert all(k["difference_bytes"] == 0 for k in doc["kinds_at_peak"]), doc["kinds_at_peak"]
    assert all(p["difference_bytes"] in (0, None) for p in doc["phases"]), doc["phases"]
    assert doc["parts_at"] is None


def test_layer_count_note():
    """A snapshot of a model cut to fewer layers (validate --scale-layers) against the whole model's estimate:
    the layers memcalc's frames name are fewer than the setup's, and the output says so."""
    est = _estimate(experiment=SimpleNamespace(model=SimpleNamespace(n_layers=12)))
    snap = _memcalc_snapshot(est)  # every frame names layer 0: one layer
    c = compare(replay(snap, 0), est, "s.pickle")
    assert (c.snapshot_layers, c.setup_layers) == (1, 12)
    assert any(line.startswith("Note: the snapshot's frames name 1 decoder layers, the setup has 12")
               for line in comparison_lines(c))
    est.experiment.model.n_layers = 1
    assert not any(line.startswith("Note:") for line in comparison_lines(compare(replay(snap, 0), est, "s.pickle")))
