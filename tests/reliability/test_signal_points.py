"""A signal at every point where CPython would run its handler: each outcome is all or nothing.

:mod:`test_interrupts` raises from a tracer at flatpool's lines. That skips two things a real
signal meets: the guard's deferral (a raise from a tracer bypasses the installed dispatcher),
and the frames of the standard library's context managers (``contextlib``'s generator wrapper
and ``nullcontext``) that flatpool's operations run through. The SIGALRM fuzz meets both, but by
chance. Here the walk is exhaustive and repeatable:

* A *signal point* is an instruction right after one where the interpreter checks for pending
  signals (a call returning, a backward jump, a frame starting or a generator resuming), in
  flatpool's frames and ``contextlib``'s.
* At the k-th point the currently installed Python handler is called with that frame, exactly
  as the eval loop calls it for a pending signal: flatpool's dispatcher defers it (while the
  operation takes its lock, unwinds or finishes) or passes it to the user's handler, which
  raises :class:`~reliability.test_interrupts.Interrupt`.
* The world must then be exactly as before or fully done, with the gc thresholds and the
  user's handler back.

The default run samples the points evenly; ``--slow`` visits every one (about 20,000).
"""

from __future__ import annotations

import contextlib
import dis
import gc
import os
import signal
import sys
import types
from typing import Any

import pytest

import flatpool
from flatpool import _interrupts as interrupts

from .scenarios import values_of
from .state import Snapshot
from .test_interrupts import ALLOC_OPS, EVERY_LINE, Interrupt, _done, _positions, settled

TRACED = (os.path.dirname(os.path.abspath(flatpool.__file__)), os.path.abspath(contextlib.__file__))

CHECKED_AFTER = frozenset({
    "RESUME", "CALL", "CALL_FUNCTION_EX", "JUMP_BACKWARD",  # 3.11+
    "CALL_FUNCTION", "CALL_METHOD", "CALL_FUNCTION_KW", "JUMP_ABSOLUTE",  # 3.10
})
"""Instructions after which the interpreter may run a pending signal's handler. A superset (a
call to a Python function returns without a check on 3.11+): extra points only test more."""


class SignalPoints:
    """Deliver SIGALRM at the ``k``-th signal point (``k=None``: only count them)."""

    def __init__(self, k: int | None) -> None:
        self.k = k
        self.points = 0
        self.where = ""
        self._last: dict[int, str] = {}

    def __call__(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code.co_filename.startswith(TRACED):
            frame.f_trace_opcodes = True
            self._last[id(frame)] = "RESUME"  # a frame starting or a generator resuming
            return self.local
        return None

    def local(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event != "opcode":
            return self.local
        before = self._last.get(id(frame))
        self._last[id(frame)] = dis.opname[frame.f_code.co_code[frame.f_lasti]]
        if before in CHECKED_AFTER:
            if self.points == self.k:
                code = frame.f_code
                self.where = f"{os.path.basename(code.co_filename)}:{code.co_name}:{frame.f_lineno}"
                handler = signal.getsignal(signal.SIGALRM)
                assert callable(handler)
                self.points += 1
                handler(signal.SIGALRM, frame)
            else:
                self.points += 1
        return self.local


def _unlocked(pool: flatpool.FlatPool) -> bool:
    """Nobody holds the pool's lock (an RLock: its owner shows in its repr)."""
    return "owner=0 " in repr(pool.lock)


def _users_handler(signum: int, frame: types.FrameType | None) -> None:
    raise Interrupt("SIGALRM")


@pytest.fixture
def alarm_raises() -> Any:
    old = signal.signal(signal.SIGALRM, _users_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGALRM, old)


def _walk(op: str, k: int | None) -> tuple[str, SignalPoints]:
    """Run ``op`` on a fresh world with a signal at point ``k``; the verdict."""
    build, prepare = EVERY_LINE[op]
    w = build()
    run = prepare(w)
    before = values_of(w)
    snap = Snapshot(w.pools, w.tensors, w.places)
    threshold = gc.get_threshold()
    handlers = [signal.getsignal(s) for s in interrupts._ASYNC_SIGNALS]
    tracer = SignalPoints(k)
    interrupted = False
    sys.settrace(tracer)
    try:
        try:
            run()
        finally:
            sys.settrace(None)
    except Interrupt:
        interrupted = True
    assert gc.get_threshold() == threshold, f"{op} at {tracer.where}: the gc pause was not undone"
    assert signal.getsignal(signal.SIGALRM) is _users_handler, (
        f"{op} at {tracer.where}: a handler was left installed")
    assert [signal.getsignal(s) for s in interrupts._ASYNC_SIGNALS] == handlers, (
        f"{op} at {tracer.where}: another signal's handler was left routed to the guard")
    assert all(_unlocked(p) for p in w.pools), (
        f"{op} at {tracer.where}: a pool's lock was left held (every other thread would wait)")
    assert not interrupts._stack.guards and not interrupts._installed, (
        f"{op} at {tracer.where}: the guard did not end (later operations would run unguarded)")
    if not interrupted:
        assert not tracer.where, f"{op}: the signal at point {k} ({tracer.where}) never reached its handler's raise"
        _done(op, w, before)
        return "not reached", tracer
    try:
        verdict = settled(op, w, before, snap)
    except AssertionError as err:
        raise AssertionError(f"{op}: signal at point {k} ({tracer.where}): {err}") from None
    if verdict == "rolled back":
        run()  # the same operation then succeeds
        _done(op, w, before)
    return verdict, tracer


@pytest.mark.parametrize("op", list(EVERY_LINE))
def test_a_signal_at_every_point_leaves_all_or_nothing(
        op: str, alarm_raises: None, request: pytest.FixtureRequest) -> None:
    # No automatic collection during the walks: the release proof's gc scan visits every
    # tensor alive, so a collection of earlier runs' garbage between the counting run and a
    # later one would make that run shorter than counted, its last point never reached (which
    # pass or fail depended on when the suite's allocations set one off).
    collecting = gc.isenabled()
    gc.disable()
    try:
        _walk(op, None)  # first runs take extra paths (probes, caches): count on a warm one
        _, counted = _walk(op, None)
        n = counted.points
        assert n > 30, f"{op}: only {n} signal points"
        slow = bool(request.config.getoption("--slow")) or op in ALLOC_OPS
        verdicts: dict[str, int] = {}
        places: set[str] = set()
        for k in _positions(n, 40, slow):
            verdict, tracer = _walk(op, k)
            verdicts[verdict] = verdicts.get(verdict, 0) + 1
            places.add(tracer.where.split(":")[0])
    finally:
        if collecting:
            gc.enable()
    print(f"{op}: {n} signal points, {sum(verdicts.values())} visited: {verdicts}")
    assert verdicts.get("rolled back", 0) > 0, verdicts
    assert verdicts.get("not reached", 0) == 0, verdicts
    if slow and op not in ALLOC_OPS:
        assert "contextlib.py" in places, f"{op}: no point in contextlib's frames: {places}"
