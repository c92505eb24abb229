"""Keep asynchronous signals (Ctrl-C, alarms) from breaking a rollback in progress.

A ``KeyboardInterrupt`` can land at any bytecode. In an operation's body the write-ahead journal
makes the rollback exact; *during* the rollback a second one would leave it half done. So while
an operation runs, :func:`signals_guarded` routes every Python-handled signal through a
dispatcher that records it while the thread unwinds and delivers it once the operation ends.

A ``with lock:`` block ending in ``return f()`` is unsafe: CPython checks for signals right
after the call, outside the block's protected range, so an interrupt skips ``__exit__`` and the
lock stays held for good. Such blocks assign first (``result = f()``) and return the name.

Only the main thread receives signals (elsewhere this is a no-op). A nested guard shares the
outermost one's dispatcher and pending signals; a child forked by another thread gets the
user's handlers back (:func:`after_fork_in_child`).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from types import FrameType
from typing import Any, Callable, TypeVar

from .errors import FlatPoolError

_ASYNC_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGVTALRM", "SIGPROF",
                 "SIGUSR1", "SIGUSR2")
    if hasattr(signal, name))
class _Stack(threading.local):
    def __init__(self) -> None:
        self.guards: list[Guard] = []


_stack = _Stack()
"""The current thread's open guards, outermost first (only the main thread's are real)."""

_installed: list[tuple[int, dict[int, Any], list[bool]]] = []
"""The guard whose dispatcher is installed (at most one, the main thread's)."""

Handler = Callable[[int, "FrameType | None"], Any]
_T = TypeVar("_T")


class RollbackError(FlatPoolError, RuntimeError):
    """A rollback could not restore everything (a holder's setter failed, say); ``errors`` lists
    what failed. Everything else was restored."""

    def __init__(self, message: str, errors: list[BaseException]) -> None:
        super().__init__(message)
        self.errors = errors


class Guard:
    """What :func:`signals_guarded` yields: signals are deferred until :meth:`open` (while the
    operation takes its lock and gc pause) and again from :meth:`finishing` (letting go)."""

    def __init__(self, outer: Guard | None = None) -> None:
        self.deferring: bool = True
        self.pending: list[tuple[int, FrameType | None]] = [] if outer is None else outer.pending
        self.deliver: Callable[[int, FrameType | None], None] = (
            (lambda signum, frame: None) if outer is None else outer.deliver)
        self.entry: BaseException | None = None if outer is None else outer.entry

    def open(self) -> None:
        """Let signals land from here; deliver what came meanwhile, unless an enclosing
        operation is itself entering or finishing (it delivers them when it opens or ends)."""
        self.deferring = False
        if not _deferred(self.entry):
            deliver_all(self.pending, self.deliver)

    def finishing(self) -> None:
        self.deferring = True


def _deferred(entry: BaseException | None) -> bool:
    """A signal arriving now waits: some open guard is entering or finishing, or the thread is
    unwinding (handling another exception than the one current at the outermost entry)."""
    return sys.exc_info()[1] is not entry or any(g.deferring for g in _stack.guards)


@contextmanager
def signals_guarded() -> Iterator[Guard]:
    """Defer Python-level signal handlers while the current thread unwinds, or while any
    guard it is inside has not opened or is finishing (see module doc)."""
    if threading.current_thread() is not threading.main_thread():
        guard = Guard()
        guard.deferring = False
        yield guard
        return
    if _stack.guards:
        yield from _nested(_stack.guards[0])
        return
    guard = Guard()
    guard.entry = entry = sys.exc_info()[1]
    pending = guard.pending
    originals: dict[int, Handler] = {}
    ending: list[bool] = []  # the guard is putting everything back: signals wait
    done: list[bool] = []

    def dispatch(signum: int, frame: FrameType | None) -> None:
        if done:  # the guard ended but could not put this handler back: do it now
            signal.signal(signum, originals[signum])
        elif ending or _deferred(entry):
            pending.append((signum, frame))  # entering, unwinding or finishing: later
            return
        originals[signum](signum, frame)

    guard.deliver = lambda signum, frame: originals[signum](signum, frame)

    installed = (threading.get_ident(), originals, done)
    try:
        _stack.guards = [guard]
        _installed.append(installed)
        for sig in _ASYNC_SIGNALS:
            handler = signal.getsignal(sig)
            if callable(handler):
                originals[sig] = handler
                signal.signal(sig, dispatch)
        yield guard
    finally:
        # Every step of the ending is deferred (``ending``): a handler raising half-way would
        # leave other signals routed here and the guard stack set, and every later operation
        # would take itself for a nested one, unguarded.
        ending.append(True)
        _stack.guards = []
        if installed in _installed:
            _installed.remove(installed)
        for sig, handler in originals.items():
            signal.signal(sig, handler)
        done.append(True)
        # delivered now, after the rollback finished
        deliver_all(pending, lambda signum, frame: originals[signum](signum, frame))


def _nested(outer: Guard) -> Iterator[Guard]:
    """A guard inside ``outer``'s; what it held back goes to the enclosing guard at its end."""
    guard = Guard(outer)
    guards = _stack.guards
    guards.append(guard)
    try:
        yield guard
    finally:
        if guard in guards:
            guards.remove(guard)
    if not _deferred(outer.entry):
        deliver_all(outer.pending, outer.deliver)


def deliver_all(pending: list[tuple[int, FrameType | None]],
                deliver: Callable[[int, FrameType | None], None]) -> None:
    """Deliver every deferred signal in arrival order, emptying ``pending``; a handler that
    raises does not cost later signals their handlers (the first exception is raised last)."""
    first: BaseException | None = None
    later = 0
    while pending:
        signum, frame = pending.pop(0)
        try:
            deliver(signum, frame)
        except BaseException as exc:  # noqa: B902 - raised after the others are delivered
            if first is None:
                first = exc
            else:
                later += 1
    if first is not None:
        if later and hasattr(first, "add_note"):
            first.add_note(f"flatpool: {later} more deferred signal handler(s) raised after this "
                           "one; all deferred signals were delivered")
        raise first


def after_fork_in_child() -> None:
    """In a child forked by another thread than the guard's: put the user's handlers back."""
    me = threading.get_ident()
    for thread, originals, done in _installed:
        if thread != me:
            done.append(True)
            for sig, handler in originals.items():
                signal.signal(sig, handler)
    _installed[:] = [entry for entry in _installed if entry[0] == me]


def guarded_call(fn: Callable[[], _T], *around: AbstractContextManager[Any]) -> _T:
    """``fn()`` inside the context managers ``around``, entered and exited with signals deferred
    so an interrupt cannot leave a gc pause or a lock behind; ``fn`` stays interruptible."""
    with signals_guarded() as guard, ExitStack() as stack:
        for cm in around:
            stack.enter_context(cm)
        guard.open()
        try:
            result = fn()
            return result  # not `return f()`: see flatpool._interrupts
        finally:
            guard.finishing()


def run_undo(undo: Callable[[], None], attempts: int = 3) -> None:
    """Run an idempotent ``undo`` to the end even if exceptions land inside it; one that
    repeats is raised after ``attempts`` tries."""
    last: BaseException | None = None
    for _ in range(attempts):
        try:
            undo()
            return
        except BaseException as exc:  # noqa: B902 - the rollback must finish first
            last = exc
    assert last is not None
    raise last
