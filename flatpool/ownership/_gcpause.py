"""Pause Python's automatic cycle collection around batch work that creates many small objects.

A batch over thousands of tensors (adoption, a census) creates a few Python objects per tensor;
the growing heap triggers full gc passes that cost more than the work itself. Nothing in
flatpool relies on the cycle collector for correctness (release proofs go by reference counts,
and an explicit ``gc.collect()`` is used where cycles matter), so it is paused for the batch.

The pause sets the first collection threshold to 0 (``gc.set_threshold(0, ...)``: no automatic
collection) instead of calling ``gc.disable()``, so it never touches the flag a user sets with
``gc.disable()``/``gc.enable()``: a user's call in another thread while an adoption runs stands.
It is reference-counted across threads: the first pause saves the thresholds, the last one puts
them back, unless someone set other thresholds meanwhile (then theirs stand). Overlapping
batches in two threads therefore stay paused until both end.

Each thread's pauses are counted apart so that a process forked while another thread is
inside a pause can drop that thread's share: the thread does not exist in the child, and its
pause would otherwise stop automatic collection there for good (:func:`after_fork_in_child`,
called by :mod:`flatpool._fork`).
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
    """Only the forking thread lives on: forget the other threads' pauses (they never end
    here) and give automatic collection back if none of the forking thread's is left. Called
    by :mod:`flatpool._fork` while it holds ``_lock`` (taken before the fork)."""
    global _depth
    mine = _by_thread.get(threading.get_ident(), 0)
    _by_thread.clear()
    if mine:
        _by_thread[threading.get_ident()] = mine
    _depth = mine
    _restore_if_unpaused()


__all__ = ["after_fork_in_child", "gc_paused", "paused"]
