"""Signals deferred while an operation unwinds all reach their handlers (issue 18.9).

Real signals (``signal.raise_signal``) are raised while the failed adoption's exception is
being handled, so the guard defers them to after the rollback. A handler that raises (a second
Ctrl-C) used to end the delivery loop: the SIGTERM and SIGUSR1 behind it never ran.
"""

from __future__ import annotations

import inspect
import signal
import sys
from collections.abc import Iterator
from types import FrameType

import pytest
import torch

from flatpool import FlatPool
from flatpool._interrupts import signals_guarded
from flatpool.testing import set_fault_hook

from .scenarios import ints

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class Injected(RuntimeError):
    pass


class UsersError(Exception):
    pass


@pytest.fixture
def calls() -> Iterator[list[int]]:
    """Handlers of the user's for SIGINT (raises KeyboardInterrupt), SIGTERM (records) and
    SIGUSR1 (raises UsersError); each records its signal first."""
    seen: list[int] = []

    def interrupt(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)
        raise KeyboardInterrupt

    def record(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)

    def fail(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)
        raise UsersError("SIGUSR1 handler")

    before = {s: signal.getsignal(s) for s in SIGNALS}
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, record)
    signal.signal(signal.SIGUSR1, fail)
    try:
        yield seen
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def _signals_while_unwinding(order: tuple[int, ...]) -> object:
    """A fault hook: the first checkpoint raises, and the signals arrive in its except clause
    (the operation is unwinding, so they are deferred to after the rollback)."""
    fired: list[bool] = []

    def hook(step: str) -> None:
        if fired:
            return
        fired.append(True)
        try:
            raise Injected(step)
        except Injected:
            for s in order:
                signal.raise_signal(s)
            raise

    return hook


def test_every_deferred_signal_is_delivered_after_a_rollback(calls: list[int]) -> None:
    pool = FlatPool(capacity=1 << 12, alignment=64)
    t = ints(16)
    storage = t.untyped_storage()
    set_fault_hook(_signals_while_unwinding(SIGNALS))  # type: ignore[arg-type]
    try:
        with pytest.raises(KeyboardInterrupt) as info:
            pool.adopt(t)
    finally:
        set_fault_hook(None)
    assert calls == list(SIGNALS), "a deferred signal never reached its handler"
    assert isinstance(info.value.__context__, Injected)  # the operation's own failure, chained
    # rolled back: the tensor is where it was, the pool holds nothing
    assert t.untyped_storage().data_ptr() == storage.data_ptr()
    assert torch.equal(t, ints(16)) and pool.slices() == () and not pool.owns(t)
    for s in SIGNALS:  # and the user's handlers are installed again
        assert signal.getsignal(s) is not None and signal.getsignal(s).__name__ in (
            "interrupt", "record", "fail")


def test_the_first_raising_handler_wins_after_all_ran(calls: list[int]) -> None:
    """Order of arrival is kept; the first exception is raised, the later ones only ran."""
    order = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    pool = FlatPool(capacity=1 << 12, alignment=64)
    set_fault_hook(_signals_while_unwinding(order))  # type: ignore[arg-type]
    try:
        with pytest.raises(UsersError):
            pool.adopt(ints(8))
    finally:
        set_fault_hook(None)
    assert calls == list(order)


def test_signals_taken_while_entering_are_all_delivered_at_open(calls: list[int]) -> None:
    """The guard's entry phase (taking the lock, pausing the gc) defers too; ``open()`` then
    delivers every one of them, not just those before the first raising handler."""
    with signals_guarded() as guard:
        for s in SIGNALS:
            signal.raise_signal(s)
        assert calls == []  # deferred
        with pytest.raises(KeyboardInterrupt):
            guard.open()
        assert calls == list(SIGNALS)



def test_a_guard_inside_an_open_one_defers_its_own_entry_and_exit(calls: list[int]) -> None:
    """An operation run inside another (an adoption inside a batch that guards its own gc
    pause): the inner guard's entry and finishing defer signals although the outer body is
    open; what the inner one held back lands in the outer body as it ends. (The inner guard
    used to be a no-op there, so its lock and gc pause were taken and let go unguarded.)"""
    term = signal.SIGTERM  # its handler records and returns
    with signals_guarded() as outer:
        outer.open()
        with signals_guarded() as inner:
            signal.raise_signal(term)  # the inner operation is entering: waits
            assert calls == []
            inner.open()  # ... and lands as its body starts
            assert calls == [term]
            inner.finishing()
            signal.raise_signal(term)  # the inner operation is finishing: waits for its end
            assert calls == [term]
        assert calls == [term, term]  # delivered in the outer body as the inner guard ended
        signal.raise_signal(term)  # the outer body is open: at once
        assert calls == [term, term, term]
        outer.finishing()


def test_a_signal_while_the_guard_ends_leaves_no_later_operation_unguarded(
        calls: list[int]) -> None:
    """A raising handler that ran in the middle of the guard's own ending (the SIGALRM fuzz's
    rare case) used to stop the ending there: the guard stayed marked active, so every later
    operation took itself for a nested one and ran with no deferral at all."""
    guarded = signals_guarded.__wrapped__  # type: ignore[attr-defined]
    lines, first = inspect.getsourcelines(guarded)
    final = first + next(i for i, text in enumerate(lines) if text.strip() == "finally:")
    seen: list[int] = []

    def local(frame: FrameType, event: str, arg: object) -> object:
        if event == "line" and frame.f_lineno > final:
            seen.append(frame.f_lineno)
            if len(seen) == 2:  # the second statement of the guard's ending
                signal.raise_signal(signal.SIGINT)
        return local

    sys.settrace(lambda f, e, a: local if f.f_code is guarded.__code__ else None)
    try:
        with pytest.raises(KeyboardInterrupt):
            with signals_guarded() as guard:
                guard.open()
                guard.finishing()
    finally:
        sys.settrace(None)
    assert calls == [signal.SIGINT]
    with signals_guarded():  # a later operation's entry is deferred again
        signal.raise_signal(signal.SIGTERM)
        assert calls == [signal.SIGINT], "the later guard did not defer: it ran unguarded"
    assert calls == [signal.SIGINT, signal.SIGTERM]
