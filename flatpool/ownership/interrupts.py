"""Keep asynchronous signals (Ctrl-C, alarms) from breaking a rollback in progress.

Python runs signal handlers in the main thread between bytecodes, so a ``KeyboardInterrupt``
can land anywhere. Inside an operation's body that is fine: the write-ahead journal makes the
rollback exact. *During* the rollback a second interrupt would leave it half done, so while an
operation runs, :func:`signals_guarded` routes every signal that has a Python handler through a
dispatcher: while the thread is unwinding (an exception other than the one current at entry is
being handled, which covers the ``except`` clause that starts the rollback and the rollback
itself) the signal is recorded, and it is delivered to the original handler once the operation
has finished. Outside unwinding the original handler runs at once, as if nothing was installed.

Only the main thread can install handlers, and only it receives them; in other threads this is
a no-op. Nested operations share the outermost guard.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, Callable

from ..errors import FlatPoolError

_ASYNC_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGVTALRM", "SIGPROF",
                 "SIGUSR1", "SIGUSR2")
    if hasattr(signal, name)
)
class _Depth(threading.local):
    active = False


_depth = _Depth()

Handler = Callable[[int, "FrameType | None"], Any]


class RollbackError(FlatPoolError, RuntimeError):
    """A rollback could not restore everything (a holder's setter failed, say); ``errors`` lists
    what failed. Everything else was restored."""

    def __init__(self, message: str, errors: list[BaseException]) -> None:
        super().__init__(message)
        self.errors = errors


class Guard:
    """What :func:`signals_guarded` yields. Signals are deferred from the start (while the
    operation takes its lock and pauses the gc) until :meth:`open`, which delivers what came
    meanwhile and lets later signals land in the body; :meth:`finishing`, once the work is done,
    defers them again through the epilogue (letting go of the lock and the gc pause)."""

    def __init__(self) -> None:
        self.deferring: bool = True
        self.pending: list[tuple[int, FrameType | None]] = []
        self.deliver: Callable[[int, FrameType | None], None] = lambda signum, frame: None

    def open(self) -> None:
        self.deferring = False
        while self.pending:
            signum, frame = self.pending.pop(0)
            self.deliver(signum, frame)

    def finishing(self) -> None:
        self.deferring = True


@contextmanager
def signals_guarded() -> Iterator[Guard]:
    """Defer Python-level signal handlers while the current thread unwinds, or after
    :meth:`Guard.finishing` (see module doc)."""
    guard = Guard()
    if threading.current_thread() is not threading.main_thread() or _depth.active:
        guard.deferring = False
        yield guard
        return
    entry = sys.exc_info()[1]
    pending = guard.pending
    originals: dict[int, Handler] = {}
    done: list[bool] = []

    def dispatch(signum: int, frame: FrameType | None) -> None:
        if done:  # the guard ended but could not put this handler back: do it now
            signal.signal(signum, originals[signum])
        elif guard.deferring or sys.exc_info()[1] is not entry:
            pending.append((signum, frame))  # entering, unwinding or finishing: later
            return
        originals[signum](signum, frame)

    guard.deliver = lambda signum, frame: originals[signum](signum, frame)

    try:
        _depth.active = True
        for sig in _ASYNC_SIGNALS:
            handler = signal.getsignal(sig)
            if callable(handler):
                originals[sig] = handler
                signal.signal(sig, dispatch)
        yield guard
    finally:
        done.append(True)
        _depth.active = False
        for sig, handler in originals.items():
            signal.signal(sig, handler)
        while pending:  # delivered now, after the rollback finished
            signum, frame = pending.pop(0)
            originals[signum](signum, frame)


def run_undo(undo: Callable[[], None], attempts: int = 3) -> None:
    """Run an idempotent ``undo`` to the end even if exceptions land inside it.

    A synchronous failure that repeats (a bug, a holder that refuses) is raised after
    ``attempts`` tries; an asynchronous one that slipped past :func:`signals_guarded` (a
    ``PyThreadState_SetAsyncExc``, say) only costs a retry.
    """
    last: BaseException | None = None
    for _ in range(attempts):
        try:
            undo()
            return
        except BaseException as exc:  # noqa: B902 - the rollback must finish first
            last = exc
    assert last is not None
    raise last


__all__ = ["Guard", "RollbackError", "run_undo", "signals_guarded"]
