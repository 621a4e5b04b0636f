"""``memcalc explain``: PyTorch's CUDA out-of-memory message parsed, held against the estimate of its
step (torch-free)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import cli_run, one_line_error

from memcalc.core.errors import UserError
from memcalc.engine.result import TimelinePoint
from memcalc.snapshot.explain import explain, explanation_lines
from memcalc.snapshot.oom import capacity_flag, parse_oom

GiB, MiB = 2**30, 2**20
#: format_size prints two decimals: a parsed size is exact to half a unit of the last one
PARSE_TOLERANCE_GIB = 0.005 * GiB

H100 = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
        "79.15 GiB of which 1.20 GiB is free. Including non-PyTorch memory, this process has 77.94 GiB memory in use. "
        "Of the allocated memory 75.10 GiB is allocated by PyTorch, and 2.31 GiB is reserved by PyTorch but "
        "unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")


@pytest.mark.parametrize("text, want", [
    # source: c10/cuda/CUDACachingAllocator.cpp DeviceCachingAllocator::malloc, torch >= 2.1 (proc_info of this
    # process from reportProcessMemoryInfo)
    (H100, dict(requested_bytes=2 * GiB, device=0, total_bytes=int(79.15 * GiB), free_bytes=int(1.2 * GiB),
                allocated_bytes=int(75.1 * GiB), reserved_unallocated_bytes=int(2.31 * GiB),
                process_bytes=int(77.94 * GiB))),
    # source: a published message (Process N has X: other processes listed), wrapped over lines as a log is
    ("CUDA out of memory. Tried to allocate 1.22 GiB. GPU 0 has a total capacity of\n15.77 GiB of which 959.44 MiB "
     "is free. Process 12447 has 14.83 GiB memory in use. Of the allocated memory 14.01 GiB\nis allocated by "
     "PyTorch, and 472.05 MiB is reserved by PyTorch but unallocated.",
     dict(requested_bytes=int(1.22 * GiB), total_bytes=int(15.77 * GiB), free_bytes=int(959.44 * MiB),
          other_processes_bytes=int(14.83 * GiB), reserved_unallocated_bytes=int(472.05 * MiB))),
    # source: allowed_info ("X allowed; ") under set_per_process_memory_fraction, private_pool_msg (CUDA Graphs)
    ("CUDA out of memory. Tried to allocate 512 bytes. GPU 1 has a total capacity of 23.99 GiB of which 10.00 GiB is "
     "free. 12.00 GiB allowed; Of the allocated memory 11.50 GiB is allocated by PyTorch, with 1.00 GiB allocated "
     "in private pools (e.g., CUDA Graphs), and 100.00 MiB is reserved by PyTorch but unallocated.",
     dict(requested_bytes=512, device=1, allowed_bytes=12 * GiB, allocated_bytes=int(11.5 * GiB),
          reserved_unallocated_bytes=100 * MiB)),
    # source: torch <= 2.0's layout (reserved in total: the unallocated part is reserved - allocated)
    ("RuntimeError: CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB total capacity; 130.35 MiB "
     "already allocated; 47.06 MiB free; 188.00 MiB reserved in total by PyTorch)",
     dict(requested_bytes=36 * MiB, total_bytes=int(7.93 * GiB), allocated_bytes=int(130.35 * MiB),
          reserved_unallocated_bytes=int((188 - 130.35) * MiB))),
])
def test_parse_oom(text, want):
    m = parse_oom(text)
    for key, value in want.items():
        assert abs(getattr(m, key) - value) <= PARSE_TOLERANCE_GIB, key


@pytest.mark.parametrize("text, message", [
    ("Segmentation fault", "it names no CUDA out-of-memory error"),  # source: parse_oom, no message at all
    ("CUDA out of memory. Tried to allocate lots", "its numbers are not in PyTorch's layout"),  # source: parse_oom
    # source: oom._last reads one message's window (from the last "Tried to allocate" before the end marker): a log
    # of 2,000 partial messages is read in linear time (a lazy match from each of them scanned the rest: seconds)
    ("CUDA out of memory. Tried to allocate 1 bytes. GPU 0 has a total capacity of 1 bytes of which 1 bytes is free. "
     * 2000, "its numbers are not in PyTorch's layout"),
    # source: oom.size_bytes, MAX_SIZE_BYTES (issue 32: 'Tried to allocate 1e26 GiB' was computed on; a
    # 400-digit size was an OverflowError in units.fmt)
    (H100.replace("allocate 2.00 GiB", "allocate 100000000000000000000000000.00 GiB"), "is more than 1,024 TiB"),
    (H100.replace("allocate 2.00 GiB", f"allocate {'9' * 400}.00 GiB"), "a size of 99999999999999999999... GiB"),
    # source: oom._consistent: a part above the device total (the 'free' of an absurd message)
    (H100.replace("1.20 GiB is free", "100000.00 GiB is free"), "bytes free is more than the GPU's total capacity"),
    (H100.replace("75.10 GiB is allocated", "80.00 GiB is allocated"), "allocated by PyTorch is more than the GPU's"),
    # source: oom._device, c10/core/Device.h DeviceIndex = int8_t (a 5,000-digit GPU number was a ValueError)
    (H100.replace("GPU 0", "GPU 128"), "GPU 128 is no CUDA device number"),
    (H100.replace("GPU 0", "GPU " + "9" * 5000), "GPU 99999999999999999999... is no CUDA"),
])
def test_parse_oom_refuses(text, message):
    with pytest.raises(UserError, match=message):
        parse_oom(text)


def test_parse_oom_rounding_is_not_refused():
    """A part printed as the total is (format_size's two decimals) is within it, not above."""
    m = parse_oom(H100.replace("77.94 GiB memory in use", "79.15 GiB memory in use"))
    assert m.process_bytes == m.total_bytes


def test_capacity_flag():
    assert capacity_flag(parse_oom(H100)) == "79.15GiB"  # source: the message's own text, as --gpu reads it


def _estimate():
    """The attributes of memcalc.engine.result.Estimate that explain reads: a step that passes 70 GiB
    at fwd layer 2 (activations) and peaks at 90 GiB in backward."""
    def point(i, label, phase, acts):
        return TimelinePoint(i, label, phase, {"weights": 16 * GiB, "activations": acts})
    return SimpleNamespace(
        timeline=[point(0, "fwd layer 0", "forward", 40 * GiB), point(1, "fwd layer 1", "forward", 52 * GiB),
                  point(2, "fwd layer 2", "forward", 64 * GiB)],
        peak_bytes=90 * GiB, peak_phase="backward", peak_label="bwd layer 2",
        components_by_kind={"weights": 16 * GiB, "activations": 60 * GiB, "temporaries": 14 * GiB},
        device_parts={"cuda_context_bytes": 500 * MiB, "workspace_bytes": 100 * MiB, "nccl_bytes": 0,
                      "allocator_overhead_bytes": 2 * GiB},
        device_total_bytes=int(92.6 * GiB))


def test_explain_crossing_and_fragmentation():
    x = explain(_estimate(), parse_oom(H100), [])
    # source: explain's rule: the first timeline point above capacity - (context + workspace + NCCL)
    assert x.tensor_budget_bytes == int(79.15 * GiB) - 600 * MiB
    assert (x.crosses["phase"], x.crosses["label"], x.crosses["kind"]) == ("forward", "fwd layer 2", "activations")
    assert x.fragmentation  # 2.31 GiB reserved but unallocated >= 2.00 GiB asked for
    assert x.failed_at["label"] == "fwd layer 2"  # 75.10 + 2.00 GiB: first held at 80 GiB
    lines = explanation_lines(x)
    assert lines[0].startswith("The step crosses the 79.15 GiB card in forward, at fwd layer 2")
    assert lines[1].startswith("Fragmentation failed this request") and "will not make the step fit" in lines[1]
    fits = explain(SimpleNamespace(**{**vars(_estimate()), "timeline": [], "peak_bytes": 60 * GiB,
                                      "device_total_bytes": 62 * GiB}), parse_oom(H100), [])
    assert explanation_lines(fits)[1].startswith("Fragmentation is the issue") and "expandable_segments:True" in \
        explanation_lines(fits)[1]


def test_explain_fits_and_no_fragmentation():
    msg = parse_oom(H100.replace("2.31 GiB is reserved", "1.00 GiB is reserved"))
    est = _estimate()
    est.timeline, est.peak_bytes, est.device_total_bytes = est.timeline[:1], 60 * GiB, 62 * GiB
    x = explain(est, msg, [])
    assert x.crosses is None and not x.fragmentation
    assert explanation_lines(x)[0].startswith("memcalc predicts this step fits the 79.15 GiB card")


#: an 8 GiB card's message for GPT-2 at batch 16 x 1024 (fp32), the command-line rows' (a small model: fast remedies)
SMALL = ("CUDA out of memory. Tried to allocate 768.00 MiB. GPU 0 has a total capacity of 7.63 GiB of which 300.00 "
         "MiB is free. Including non-PyTorch memory, this process has 7.33 GiB memory in use. Of the allocated memory "
         "6.20 GiB is allocated by PyTorch, and 800.00 MiB is reserved by PyTorch but unallocated.")


def _rows(tmp_path):
    """(args, exit code, message) for the command line."""
    log = tmp_path / "train.log"
    log.write_text("step 10 loss 2.3\n" + SMALL + "\n")
    setup = ["--model", "gpt2", "--batch", "16", "--seq", "1024"]
    return [
        # source: oom.message_text, an argument that is neither a message nor a file
        (["nothing here", *setup], 2, "is neither a CUDA out-of-memory message nor a file"),
        # source: data_files.path_kind (a 300-character file name was an OSError traceback: ENAMETOOLONG)
        ([str(tmp_path / ("x" * 300)), *setup], 2, "is neither a CUDA out-of-memory message nor a file"),
        # source: oom.parse_oom, the error named but not in PyTorch's layout
        (["CUDA out of memory. somewhere", *setup], 2, "its numbers are not in PyTorch's layout"),
        # source: the estimate's own checks (memcalc.api.estimate)
        ([SMALL, "--model", "gpt2", "--batch", "0"], 2, "--batch must be positive"),
        ([SMALL, *setup], 0, "The step crosses the 7.63 GiB card in forward"),
        ([str(log), *setup], 0, "Fragmentation failed this request"),
        ([str(log), *setup, "--json"], 0, '"fragmentation": true'),
        ([SMALL, *setup], 0, "--batch 2 --gpu 7.63GiB"),  # source: plan.remedies.gpu_word
    ]


@pytest.mark.slow  # 7 command lines, 4 with GPT-2's remedies: about 1 s
def test_cli_rows(tmp_path):
    for args, code, message in _rows(tmp_path):
        r = cli_run(["explain", *args])
        if code == 2:
            one_line_error(r, code, message)
        else:
            assert r.exit_code == code and message in r.stdout, (args, r.output)


def test_cli_stdin_quick():
    """The quick lane's command line: the message on stdin (no argument), refused with one line."""
    from typer.testing import CliRunner

    from memcalc.cli import app

    r = CliRunner().invoke(app, ["explain", "--model", "gpt2"], input="Killed\n", prog_name="memcalc")
    one_line_error(r, 2, "it names no CUDA out-of-memory error")
