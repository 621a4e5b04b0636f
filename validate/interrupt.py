"""Stopping ``memcalc validate`` promptly on SIGINT / SIGTERM.

Python runs a signal handler between bytecodes of the main thread, wherever it is; when that
is the body of a weakref callback (the tracer's own finalizers, or a ``WeakValueDictionary``'s
``remove`` inside torch, which fire by the thousand when a traced step's storages die) the
``KeyboardInterrupt`` raised there is *printed* ("Exception ignored in: ...") and dropped, and
the run goes on. So, while :func:`stoppable` is active:

- the handler records the signal and raises :class:`StopRequested` (a ``KeyboardInterrupt``);
- every traced op (``StorageTracer.__torch_dispatch__``) and every phase/layer label calls
  :func:`check`, a safe point that raises it again while a stop is pending;
- a repeating 0.25 s timer (``SIGALRM``, Unix) raises it again until it lands outside a
  finalizer, in case no traced op follows (model building, the estimate, ``gc.collect``);
- an interrupt dropped inside a finalizer is not printed (``sys.unraisablehook``).

The caller catches :class:`StopRequested`, prints what finished and exits with
``128 + signal`` (130 for SIGINT, 143 for SIGTERM). A signal the parent process ignores (a
shell's background job ignores SIGINT) stays ignored.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Iterator, Optional

#: the pending signal number while a stop is requested (None otherwise)
_pending: Optional[int] = None

_REPEAT_S = 0.25


class StopRequested(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived; ``signum`` says which (exit status ``128 + signum``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def check() -> None:
    """A safe point: raise :class:`StopRequested` when a stop is pending."""
    if _pending is not None:
        raise StopRequested(_pending)


def acknowledge() -> None:
    """The caller caught the stop: no more repeats (call it in a loop until it returns, as the timer
    may fire once more before it runs)."""
    global _pending
    _pending = None
    if hasattr(signal, "setitimer"):
        signal.setitimer(signal.ITIMER_REAL, 0, 0)


def stopped(_stop: StopRequested) -> None:
    """Call first thing in the ``except StopRequested`` clause: stops the repeats (retrying if
    the timer fires once more before it is disarmed)."""
    while True:
        try:
            acknowledge()
            return
        except StopRequested:
            pass


def _on_signal(signum, _frame) -> None:
    global _pending
    if _pending is None:
        _pending = signum
        if hasattr(signal, "setitimer"):
            signal.setitimer(signal.ITIMER_REAL, _REPEAT_S, _REPEAT_S)
    raise StopRequested(_pending)


def _on_alarm(_signum, _frame) -> None:
    check()


@contextlib.contextmanager
def stoppable() -> Iterator[None]:
    """Install the handlers (main thread only; elsewhere a no-op) and restore them on exit."""
    global _pending
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _pending = None
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    has_alarm = hasattr(signal, "SIGALRM") and hasattr(signal, "setitimer")
    if has_alarm:
        saved[signal.SIGALRM] = signal.getsignal(signal.SIGALRM)
    hook = sys.unraisablehook

    def quiet(u) -> None:  # an interrupt raised inside a finalizer: re-raised by check(), not printed
        if isinstance(u.exc_value, KeyboardInterrupt):
            return
        hook(u)

    try:
        for s in (signal.SIGINT, signal.SIGTERM):
            if saved[s] is not signal.SIG_IGN:  # ignored by the parent (a background job, nohup): stays so
                signal.signal(s, _on_signal)
        if has_alarm:
            signal.signal(signal.SIGALRM, _on_alarm)
        sys.unraisablehook = quiet
        yield
    finally:
        if has_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0, 0)
        for s, h in saved.items():
            signal.signal(s, h)
        sys.unraisablehook = hook
        _pending = None
