"""The newest doors fuzzed by hand (issue 32): what a hostile or careless user typed into ``estimate``,
``plan``, ``compare`` and ``explain`` that did not end in one line on stderr and exit 2. Each row is
(args, exit code, message); the messages are the inputs' own checks.
"""

from __future__ import annotations

import pytest
from conftest import cli_run, one_line_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

NINES = "9" * 400

# (args, exit code, message)
SLOW = [
    # source: memcalc.core.aliases.seq: float("9"*400) * 1024 was inf, and int(inf) an OverflowError traceback
    (["estimate", "--model", "gpt2", "--seq", NINES + "k"], 2, "is more than 16,777,216 tokens"),
    # source: aliases.notes_on_success: the alias's note was a second line before the refusal
    (["estimate", "--model", "gpt2", "--seq", "2k"], 2, "exceeds gpt2's learned position table (1024)"),
    # source: memcalc.inputs.profiles.compose: "" was taken as "not given" (the default PyTorch, silently)
    (["estimate", "--model", "gpt2", "--torch", ""], 2, "unknown --torch ''; valid: 2.1 to 2.13"),
    (["plan", "--model", "gpt2", "--torch", ""], 2, "unknown --torch ''"),
    (["estimate", "--model", "gpt2", "--framework", ""], 2, "unknown --framework ''; valid: plain, hf"),
    # source: aliases.notes_on_success, through plan and through a later check of the estimate
    (["plan", "--model", "gpt2", "--gpu", "4090", "--seq", "99999999999k"], 2, "is more than 16,777,216 tokens"),
    (["plan", "--model", "gpt2", "--seq", "2k"], 2, "--seq 2048 exceeds gpt2's maximum sequence length (1024)"),
    (["estimate", "--model", "gpt2", "--precision", "bfloat16", "--batch", "0"], 2, "--batch must be positive"),
    (["estimate", "--model", "gpt2", "--seq", "0.0001k"], 2, "is 0.1024 tokens, not a whole number"),
    # source: memcalc.inputs.pydantic_errors._short_repr: repr of a 5,000-digit int raised ValueError (the
    # 4,300-digit limit of int to str)
    (["estimate", "--model", "gpt2", "--seq", "9" * 5000], 2, "seq = an integer of about 5,000 digits: Input should"),
    # source: issue 32 fuzz (stop 30): an empty path was the current folder ('--recipe : a directory') or taken as not
    # given (--adapter-config '', --config '' beside --model: silently the estimate without them)
    (["estimate", "--model", "gpt2", "--recipe", ""], 2, "--recipe '': an empty path; give a file path"),
    (["estimate", "--model", "gpt2", "--adapter-config", ""], 2, "--adapter-config '': an empty path"),
    (["plan", "--model", "gpt2", "--adapter-config", ""], 2, "--adapter-config '': an empty path"),
    (["estimate", "--model", "gpt2", "--gpus", "2", "--deepspeed", ""], 2, "--deepspeed '': an empty path"),
    (["estimate", "--model", "gpt2", "--config", ""], 2, "--config '': an empty name"),
    # source: configs._raw: a folder was 'config file not found'
    (["estimate", "--config", "/"], 2, "config file / is a directory; give a file path"),
    # source: engine.timeline.check_supported: --seq was held to a learned position table, --first-seq was not
    # (gpt2 --first-seq 16777216 gave a 27.9 TB peak)
    (["estimate", "--model", "gpt2", "--seq", "64", "--first-seq", "2048"], 2,
     "first_seq (2048) exceeds gpt2's learned position table (1024)"),
    # source: profiles.with_loss, KernelProfile.loss_chunks le=MAX_COUNT (10**30 chunks were taken)
    (["estimate", "--model", "gpt2", "--loss", "chunked", "--loss-chunks", "9" * 30], 2,
     "--loss-chunks must be at most 1,048,576"),
]


@pytest.mark.slow  # 18 command lines that resolve a model: about 1 s
@pytest.mark.parametrize("args,code,message", SLOW)
def test_hand_fuzz_rows(args, code, message):
    one_line_error(cli_run(args), code, message)


# (--seq as typed, message): source: memcalc.core.aliases.seq (Decimal arithmetic, the bound before the note)
SEQS = [
    (NINES + "k", "is more than 16,777,216 tokens"),
    ("16385k", "is more than 16,777,216 tokens"),
    ("0.0001k", "is 0.1024 tokens, not a whole number"),
]


@pytest.mark.parametrize("value,message", SEQS, ids=["nines", "16385k", "fraction"])
def test_seq_refusals(value, message, capsys):
    from memcalc.core.aliases import seq
    from memcalc.core.errors import UserError

    with pytest.raises(UserError, match=message):
        seq(value)
    assert capsys.readouterr().err == ""  # no note before the refusal
    assert seq("16384k") == 16 * 2**20


def test_notes_wait_for_success(capsys):
    """aliases.notes_on_success: the note is written when the call returns, dropped when it raises."""
    from memcalc.core import aliases
    from memcalc.core.errors import UserError

    @aliases.notes_on_success
    def resolve(value, fail):
        tokens = aliases.seq(value)
        if fail:
            raise UserError(f"seq ({tokens}) exceeds the model's 1024")
        return tokens

    with pytest.raises(UserError):
        resolve("2k", True)
    assert capsys.readouterr().err == ""
    assert resolve("1k", False) == 1024
    assert capsys.readouterr().err == "memcalc: note: --seq 1k is 1,024 tokens (k = 1,024)\n"


# -- explain's message, every size slot fuzzed (issue 32: 'Tried to allocate 1e26 GiB' was computed on) -------------

_MESSAGE = ("CUDA out of memory. Tried to allocate {0}. GPU {dev} has a total capacity of {1} of which {2} is free. "
            "Including non-PyTorch memory, this process has {3} memory in use. Of the allocated memory {4} is "
            "allocated by PyTorch, and {5} is reserved by PyTorch but unallocated.")
_GOOD = ["2.00 GiB", "79.15 GiB", "1.20 GiB", "77.94 GiB", "75.10 GiB", "2.31 GiB"]
# source: c10's format_size (bytes up to 1024, else two decimals of KiB/MiB/GiB), and hostile numbers in its layout
_NUMBER = st.one_of(st.integers(0, 2**70).map(str), st.sampled_from(["9" * 400, "0", "1" + "0" * 26 + ".00"]),
                    st.decimals(0, 10**9, places=2, allow_nan=False, allow_infinity=False).map(str))
_SIZE = st.tuples(_NUMBER, st.sampled_from(["bytes", "KiB", "MiB", "GiB"])).map(" ".join)


def _parse_or_refuse(sizes, dev):
    from memcalc.core.errors import UserError
    from memcalc.snapshot.oom import MAX_DEVICE, MAX_SIZE_BYTES, parse_oom

    try:
        m = parse_oom(_MESSAGE.format(*sizes, dev=dev))
    except UserError as e:
        assert "\n" not in str(e) and len(str(e)) < 1000, str(e)[:200]
        return
    parts = [m.requested_bytes, m.total_bytes, m.free_bytes, m.allocated_bytes, m.reserved_unallocated_bytes,
             m.process_bytes]
    assert all(0 <= p <= MAX_SIZE_BYTES for p in parts), parts  # never an absurd size computed on
    assert max(parts[2:]) <= m.total_bytes + 2**30 // 200 and m.device <= MAX_DEVICE, (parts, m.device)


_SLOTS = st.lists(st.one_of(st.sampled_from(_GOOD), _SIZE), min_size=6, max_size=6)
_DEVICE = st.one_of(st.integers(0, 200).map(str), st.just("9" * 5000))


@settings(max_examples=5, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(sizes=_SLOTS, dev=_DEVICE)
def test_any_sizes_in_an_oom_message_are_read_or_refused(sizes, dev):
    """Each size slot of PyTorch's message (and the GPU number) holds anything in the size layout: the
    message is read with every part within MAX_SIZE_BYTES and the device total, or refused in one line."""
    _parse_or_refuse(sizes, dev)


@pytest.mark.slow
@settings(max_examples=1000, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(sizes=_SLOTS, dev=_DEVICE)
def test_many_sizes_in_an_oom_message_are_read_or_refused(sizes, dev):
    _parse_or_refuse(sizes, dev)
