"""memcalc.snapshot.format: memcalc's frames in a PyTorch memory snapshot, the trace's peak, loading (torch-free)."""

from __future__ import annotations

import pickle

import pytest

from memcalc.core.errors import UserError
from memcalc.snapshot.format import (entry_memcalc, load_snapshot, memcalc_frame, memcalc_frames, parse_memcalc_frame,
                                     trace_peak, write_snapshot)


@pytest.mark.parametrize("frame, parsed", [
    # source: the contract of memcalc.snapshot.format (first frame of every entry memcalc writes)
    ({"filename": "memcalc/activations", "line": 3, "name": "layers.3.mlp.up_proj out"},
     ("activations", 3, "layers.3.mlp.up_proj out")),
    # source: memcalc.engine.result.KINDS, a kind with an underscore
    ({"filename": "memcalc/optimizer_state", "line": 0, "name": "exp_avg"}, ("optimizer_state", 0, "exp_avg")),
    # source: a real snapshot's Python frame (torch/csrc/profiler/combined_traceback.cpp symbolize)
    ({"filename": "/usr/lib/python3.11/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"},
     None),
    # source: a memcalc-looking frame with a kind memcalc does not have
    ({"filename": "memcalc/loss", "line": 0, "name": "x"}, None),
    ("not a frame", None),
])
def test_parse_memcalc_frame(frame, parsed):
    assert parse_memcalc_frame(frame) == parsed


def test_memcalc_frame_round_trip():
    f = memcalc_frame("gradients", None, "layers.0.self_attn.q_proj.weight grad")
    assert f == {"filename": "memcalc/gradients", "line": 0, "name": "layers.0.self_attn.q_proj.weight grad"}
    assert entry_memcalc({"frames": [f, {"filename": "memcalc", "line": 0, "name": "backward"}]}) == (
        "gradients", 0, "layers.0.self_attn.q_proj.weight grad")
    with pytest.raises(AssertionError):
        memcalc_frame("loss", 0, "x")


def test_memcalc_frames_name_the_phase_for_compare():
    """The frames after the kind frame: the phase (what memcalc.snapshot.attribute.entry_phase reads), the category."""
    from memcalc.snapshot.attribute import entry_phase

    frames = memcalc_frames("temporaries", 2, "aten.mm.default (layer 2)", "backward", "activation gradients")
    assert entry_memcalc({"frames": frames}) == ("temporaries", 2, "aten.mm.default (layer 2)")
    assert entry_phase(frames) == "backward"
    assert frames[2] == {"filename": "memcalc/category", "line": 0, "name": "activation gradients"}
    assert len(memcalc_frames("weights", None, "wte.weight", "setup")) == 2


def _snapshot():
    """A block allocated before recording (still alive, in segments), one freed in the trace that the
    trace never allocated (100 bytes: 512 rounded), then 1000 + 600 requested, 1000 freed, 513 more."""
    seg_blocks = [
        {"address": 0, "size": 1024, "requested_size": 1000, "state": "active_allocated", "frames": []},  # pre-trace
        {"address": 1024, "size": 1024, "requested_size": 513, "state": "active_allocated", "frames": []},
        {"address": 2048, "size": 2048, "requested_size": 0, "state": "inactive", "frames": []},
    ]
    trace = [
        {"action": "free_requested", "addr": 4096, "size": 100, "stream": 0},
        {"action": "free_completed", "addr": 4096, "size": 100, "stream": 0},
        {"action": "alloc", "addr": 2048, "size": 1000, "stream": 0},
        {"action": "alloc", "addr": 3072, "size": 600, "stream": 0},
        {"action": "free_requested", "addr": 2048, "size": 1000, "stream": 0},
        {"action": "free_completed", "addr": 2048, "size": 1000, "stream": 0},
        {"action": "free_completed", "addr": 3072, "size": 600, "stream": 0},
        {"action": "alloc", "addr": 1024, "size": 513, "stream": 0},
    ]
    return {"segments": [{"device": 0, "address": 0, "total_size": 4096, "blocks": seg_blocks}],
            "device_traces": [trace]}


def test_trace_peak():
    s = _snapshot()
    # source: hand count: alive at the start 1024 (the pre-trace block, rounded) + 512 (the 100 bytes freed at
    # index 1); after index 3: 1024 + 1024 (1000) + 1024 (600) = 3072
    assert trace_peak(s) == (3072, 3)
    assert trace_peak(s, rounded=False) == (1000 + 1000 + 600, 3)
    s["segments"][0]["blocks"][0]["state"] = "inactive"  # without the pre-trace block, and 1 byte at index 3
    s["device_traces"][0][3]["size"] = 1
    assert trace_peak(s) == (1024 + 512, 3)
    assert trace_peak(s, device=1) == (0, -1)  # no trace and no segment on device 1


def test_trace_peak_address_freed_and_allocated_again():
    # source: a two-step recording (validate/step.py run_on_device records from before the first step): a
    # gradient freed by zero_grad and allocated again at the same address in step 2, alive at the end, was made
    # before the trace in no sense; hand count: 1024 at index 0, 1024 again at index 2, never both
    trace = [{"action": "alloc", "addr": 0, "size": 1000, "stream": 0},
             {"action": "free_completed", "addr": 0, "size": 1000, "stream": 0},
             {"action": "alloc", "addr": 0, "size": 1000, "stream": 0}]
    block = {"address": 0, "size": 1024, "requested_size": 1000, "state": "active_allocated", "frames": []}
    s = {"segments": [{"device": 0, "address": 0, "total_size": 2048, "blocks": [block]}], "device_traces": [trace]}
    assert trace_peak(s) == (1024, 0)


def test_load_snapshot(tmp_path):
    p = tmp_path / "s.pickle"
    write_snapshot(_snapshot(), p)
    assert load_snapshot(p) == _snapshot()
    (tmp_path / "bad.pickle").write_bytes(b"not a pickle")
    (tmp_path / "dict.pickle").write_bytes(pickle.dumps({"segments": []}))
    for name, msg in [("missing.pickle", "not found"), ("bad.pickle", "is not a PyTorch memory snapshot pickle"),
                      ("dict.pickle", "no 'segments' and 'device_traces'")]:
        with pytest.raises(UserError, match=msg):
            load_snapshot(tmp_path / name)


# -- the estimate's step as a snapshot (memcalc.snapshot.export), torch-free --------------------------------------

def _labels(events):
    """Labels as memcalc.snapshot.export.LabelledEvents gives them, requesting 100 bytes less than each event."""
    return {uid: ("activations", "saved activations", "", 1, "fwd layer 1", "forward", n - 100)
            for uid, n in events if n}


@pytest.mark.parametrize("events, start, warm", [
    # source: memcalc.core.allocator rules: two small blocks share a 2 MiB segment, a 3 MiB request takes a 20 MiB one
    ([(1, 1024), (2, 1536), (3, 3 << 20), (2, 0), (4, 512), (3, 0), (4, 0)], 1, True),
    # source: the first step (not warm): what the step leaves alive stays in the segments
    ([(1, 12 << 20), (2, 1024), (3, 2 << 20), (2, 0)], 1, False),
])
def test_snapshot_of_replays_as_the_estimate(events, start, warm):
    """The snapshot's trace replays the events exactly as memcalc.estimate.peak.replay_allocator does: the same
    allocated and reserved peaks; its live peak is the events' (rounded bytes), and trace_peak reads it back."""
    from memcalc.estimate.peak import replay_allocator
    from memcalc.snapshot.export import snapshot_of

    out = snapshot_of(events, start, warm, _labels(events))
    assert (out.allocated_peak_bytes, out.reserved_peak_bytes) == replay_allocator(events, start, warm)
    sizes = {uid: n for uid, n in events if n}
    live = peak = 0
    for uid, n in events[:start] + (events[start:] if warm else []) + events[start:]:
        live += n if n else -sizes[uid]
        peak = max(peak, live)
    assert out.live_peak_bytes == trace_peak(out.snapshot).peak_bytes == peak
    trace = out.snapshot["device_traces"][0]
    assert all(entry_memcalc(e) == ("activations", 1, "fwd layer 1") for e in trace if e["action"] != "segment_alloc")
    assert {e["size"] for e in trace if e["action"] == "alloc"} == {n - 100 for _u, n in events if n}
    for seg in out.snapshot["segments"]:  # blocks tile their segment (what _memory_viz.segsum asserts)
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]


SNAPSHOT_CLI = [
    # (args, exit code, message); source: memcalc.cli.options._check_output
    (["--snapshot", "{tmp}/notours.txt"], 2,
     "exists and is not a memory snapshot (pickle); give another path, or --force"),
    (["--snapshot", "{tmp}/missing/s.pickle"], 2, "folder {tmp}/missing does not exist"),
    (["--snapshot", "{tmp}"], 2, "it is a directory; give a file path"),
    (["--snapshot", " "], 2, "an empty path"),
]


@pytest.mark.parametrize("args, code, message", SNAPSHOT_CLI)
def test_estimate_snapshot_cli_errors(tmp_path, args, code, message):
    from typer.testing import CliRunner

    from memcalc.cli import app

    (tmp_path / "notours.txt").write_text("x")
    res = CliRunner().invoke(app, ["estimate", "--params", "20M"] + [a.format(tmp=tmp_path) for a in args])
    assert res.exit_code == code
    assert message.format(tmp=tmp_path) in res.output
    assert res.output.count("\n") == 1 and "Traceback" not in res.output


def test_free_entries_name_the_phase_they_happen_in():
    """A free's phase frame is the phase it is made in (SimResult.event_phases), its kind frame the allocation's."""
    from memcalc.snapshot.export import snapshot_of

    events = [(1, 1024), (2, 1536), (3, 3 << 20), (2, 0), (3, 0)]
    out = snapshot_of(events, 1, False, _labels(events), [(0, "setup"), (1, "forward"), (3, "backward")])
    phases = [(e["action"], e["frames"][1]["name"]) for e in out.snapshot["device_traces"][0] if e["frames"]]
    assert phases == [("alloc", "forward"), ("alloc", "forward"), ("alloc", "forward"),
                      ("free_requested", "backward"), ("free_completed", "backward"),
                      ("free_requested", "backward"), ("free_completed", "backward")]
