"""The newest doors fuzzed by hand (issue 32): what a hostile or careless user typed into ``estimate``,
``plan``, ``compare`` and ``explain`` that did not end in one line on stderr and exit 2. Each row is
(args, exit code, message); the messages are the inputs' own checks.
"""

from __future__ import annotations

import pytest
from conftest import cli_run, one_line_error

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
