"""Pause Python's automatic cycle collection around batch work that creates many small objects.

Release proofs go by reference counts, so nothing relies on the cycle collector, whose full
passes would cost more than the batch. The pause sets threshold 0 rather than calling
``gc.disable()``, leaving the user's flag alone; it is counted across threads (the last pause
restores the thresholds unless someone changed them) and per thread, so a forked child can drop
the pauses of threads that do not exist there (:func:`after_fork_in_child`).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_by_thread: dict[int, int] = {}
_saved: tuple[int, ...] = ()
_paused: tuple[int, ...] = ()


@contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic collection for the block; the outermost pause restores the thresholds."""
    global _depth, _saved, _paused
    me = threading.get_ident()
    with _lock:
        if _depth == 0:
            _saved = tuple(gc.get_threshold())
            _paused = (0, *_saved[1:])
            gc.set_threshold(*_paused)
        _depth += 1
        _by_thread[me] = _by_thread.get(me, 0) + 1
    try:
        yield
    finally:
        with _lock:
            _by_thread[me] -= 1
            if not _by_thread[me]:
                del _by_thread[me]
            _depth -= 1
            _restore_if_unpaused()


def _restore_if_unpaused() -> None:
    if _depth == 0 and tuple(gc.get_threshold()) == _paused:
        gc.set_threshold(*_saved)


def paused() -> bool:
    """True while some thread is inside :func:`gc_paused` (for tests and diagnostics)."""
    return _depth > 0


def after_fork_in_child() -> None:
    """Forget the other threads' pauses (they never end here); called by :mod:`flatpool._fork`
    while it holds ``_lock``."""
    global _depth
    mine = _by_thread.get(threading.get_ident(), 0)
    _by_thread.clear()
    if mine:
        _by_thread[threading.get_ident()] = mine
    _depth = mine
    _restore_if_unpaused()
