"""Make ``os.fork()`` safe while other threads are inside flatpool.

A forked child has only the forking thread: another thread's held lock, gc pause or signal
guard would last forever there. So (``os.register_at_fork``) *before* a fork we wait, up to
:data:`FORK_WAIT` seconds, for every pool's lock in one global order, then take the module
locks; the parent lets go of them; the child lets go too, gives a pool whose lock could not be
had a fresh one (with a :class:`~flatpool.errors.FlatPoolWarning`), drops other threads' gc
pauses and puts the user's signal handlers back.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Protocol

from . import _state, checkpoint
from ._warn import warn
from .errors import FlatPoolWarning
from . import _gcpause as gcpause
from . import _interrupts as interrupts

class LockLike(Protocol):
    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool: ...

    def release(self) -> None: ...


FORK_WAIT = 2.0
"""Seconds ``fork()`` waits, in all, for pool operations running in other threads to end."""

_held: list[Callable[[], None]] = []
"""How to let go of each lock taken for the fork, in order (exact even if :func:`_before` was
interrupted)."""
_missed: list[_state.PoolState] = []  # pools whose lock another thread kept past FORK_WAIT


def _module_locks() -> tuple[LockLike, ...]:
    return (checkpoint._lock, checkpoint._twins_lock, _state._registry_lock, gcpause._lock)


def _take(pool: _state.PoolState, timeout: float) -> None:
    lock = pool.lock
    if lock.acquire(timeout=timeout):
        _held.append(lock.release)
    else:
        _missed.append(pool)


def _before() -> None:
    deadline = time.monotonic() + FORK_WAIT
    waited = sorted(_state.live_states(), key=id)
    for pool in waited:
        _take(pool, max(0.0, deadline - time.monotonic()))
    for module_lock in _module_locks():  # each held for a few instructions only
        module_lock.acquire()
        _held.append(module_lock.release)
    # Pools made while we waited: taken without waiting (a thread holding one may wait for the
    # registry lock, which is ours now), else they count as missed.
    known = set(map(id, waited))
    for pool in sorted(_state._all_states, key=id):
        if id(pool) not in known:
            _take(pool, 0.0)


def _release_held() -> None:
    while _held:
        _held.pop()()


def _after_in_parent() -> None:
    _release_held()
    _missed.clear()


def _after_in_child() -> None:
    gcpause.after_fork_in_child()
    interrupts.after_fork_in_child()
    _release_held()
    missed = list(_missed)
    _missed.clear()
    for pool in missed:
        pool._lock = threading.RLock()  # its holder does not exist here
    if missed:
        names = ", ".join(repr(p.name) for p in missed)
        warn(
            f"this process was forked while another thread was inside an operation on pool(s) "
            f"{names} (fork waits up to {FORK_WAIT} s for such operations; these had not "
            "ended); their locks are reset here, but their state is whatever that operation "
            "had reached. Fork before using pools from threads, or build new pools in the child.",
            FlatPoolWarning)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before, after_in_parent=_after_in_parent, after_in_child=_after_in_child)
