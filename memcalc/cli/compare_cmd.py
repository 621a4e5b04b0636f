"""``memcalc compare`` and ``memcalc explain``: a measured step (a PyTorch memory snapshot, a CUDA
out-of-memory message) held against the estimate of the same setup.

Both take exactly the setup flags of ``memcalc estimate`` (``--model``, ``--lora``, ``--recipe``,
``--config``...): each command's signature is its own options followed by estimate's experiment
options (:func:`with_setup`), so the two never drift apart. The estimate runs through
:func:`memcalc.api.estimate`; the snapshot's replay and the message's reading are
:mod:`memcalc.snapshot` (torch-free).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Annotated, Any, Optional

import typer

from memcalc.cli import estimate_cmd
from memcalc.cli.group import app
from memcalc.cli.options import Json, inputs_of


def setup_parameters() -> list[inspect.Parameter]:
    """``memcalc estimate``'s experiment options (its parameters less its own, ``_OWN``), as
    keyword parameters with their typer annotations."""
    sig = inspect.signature(estimate_cmd.estimate, eval_str=True)
    return [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for name, p in sig.parameters.items()
            if name not in estimate_cmd._OWN]


def with_setup(own: Callable[..., Any]) -> Callable[..., Any]:
    """``own`` with estimate's experiment options appended to its signature (typer reads
    ``__signature__``); the command receives them in ``**setup``."""
    params = [p for p in inspect.signature(own, eval_str=True).parameters.values()
              if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if p.default is not p.empty else p for p in params]
    full = params + setup_parameters()
    own.__signature__ = inspect.Signature(full)  # type: ignore[attr-defined]
    own.__annotations__ = {p.name: p.annotation for p in full}
    return own


Device = Annotated[Optional[int], typer.Option(
    "--device", help="The snapshot's device to read (default: the one device its trace has entries for).")]


def compare(
    snapshot: Annotated[str, typer.Argument(
        metavar="SNAPSHOT.pickle", help="A PyTorch memory snapshot: torch.cuda.memory._dump_snapshot()'s pickle "
                                        "(read as data only: no code in it runs), or memcalc's own "
                                        "(estimate --snapshot, the meta tracer's).")],
    device: Device = None,
    as_json: Json = False,
    **setup: Any,
) -> None:
    """Hold a PyTorch memory snapshot against the estimate of its step: peak, kinds, phases, where they part.

    Record two steps (the first makes the optimizer state, the second is the steady state):
    torch.cuda.memory._record_memory_history() before the first,
    torch.cuda.memory._dump_snapshot("step.pickle") after the second, then give the setup flags of
    `memcalc estimate` for that run (docs/compare.md). A snapshot memcalc wrote names each allocation's kind; a real
    one is attributed from the stacks (stacks="all", the default) and the lifetimes: made before the
    first forward and kept = weights; made in forward and alive when backward begins = activations;
    made in backward (the autograd engine) and alive at the optimizer step = gradients; made in
    torch/optim and kept = optimizer state; freed within their phase = temporaries; cuBLAS
    workspaces on their own row.

    Examples:

    \b
      memcalc compare examples/gpt2_step.pickle --model gpt2 --batch 1 --seq 128 --bf16
      memcalc compare examples/gpt2_step.pickle --model gpt2 --batch 1 --seq 128 --bf16 --optimizer sgd --json
    """
    import memcalc.api
    from memcalc.snapshot.compare import compare as run_compare, comparison_lines
    from memcalc.snapshot.reader import read_snapshot
    from memcalc.snapshot.replay import pick_device, replay

    snap = read_snapshot(snapshot)
    rep = replay(snap, pick_device(snap, device))
    est = memcalc.api.estimate(**inputs_of(setup, ())).estimate
    c = run_compare(rep, est, snapshot)
    if as_json:
        from memcalc.render.report import dumps

        typer.echo(dumps(c.document()))
    else:
        typer.echo("\n".join(comparison_lines(c)))


app.command("compare")(with_setup(compare))


def _message_text(message: Optional[str]) -> str:
    """The OOM text: stdin for ``-`` or no argument, else :func:`memcalc.snapshot.oom.message_text`."""
    import sys

    from memcalc.snapshot.oom import MAX_MESSAGE_CHARS, message_text

    if message is None or message == "-":
        return sys.stdin.read(MAX_MESSAGE_CHARS)
    return message_text(message)


def explain(
    message: Annotated[Optional[str], typer.Argument(
        metavar="[MESSAGE|FILE|-]", help="The CUDA out-of-memory error: its text, a file holding it (a log: the "
                                          "last one is read), or - / nothing for stdin.")] = None,
    as_json: Json = False,
    **setup: Any,
) -> None:
    """Read a CUDA out-of-memory error against the estimate of its step: what crossed the card, fragmentation, the fix.

    Give the setup flags of `memcalc estimate` for the run that failed. The card is the capacity the
    message names (its allowed fraction when one is set); the answer is the phase and the kind where
    the predicted step crosses it, whether the memory PyTorch held but could not use
    ("reserved but unallocated") was the cause, and the smallest changes that fit, as commands.

    Examples:

    \b
      memcalc explain examples/oom_h100.txt --model llama-3.1-8b --lora --seq 16k
      memcalc explain examples/oom_h100.txt --model llama-3.1-8b --lora --seq 16k --checkpoint full --json
    """
    import memcalc.api
    from memcalc.snapshot.explain import explain as run_explain, explanation_lines
    from memcalc.snapshot.oom import capacity_flag, parse_oom

    msg = parse_oom(_message_text(message))
    r = memcalc.api.estimate(gpu=[capacity_flag(msg)], **inputs_of(setup, ()))
    fixes = [x for v in (r.to_make_it_fit or {}).values() for x in v]
    x = run_explain(r.estimate, msg, fixes)
    if as_json:
        from memcalc.render.report import dumps

        typer.echo(dumps(x.document()))
    else:
        typer.echo("\n".join(explanation_lines(x)))


app.command("explain")(with_setup(explain))
