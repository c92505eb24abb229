"""Pause Python's cycle collector around batch work that creates many small objects.

A batch over thousands of tensors (adoption, a census) creates a few Python objects per tensor;
the growing heap triggers full gc passes that cost more than the work itself. Nothing in
flatpool relies on the cycle collector for correctness (release proofs go by reference counts,
and an explicit ``gc.collect()`` is used where cycles matter), so it is paused for the batch.

The pause is reference-counted across threads: the first pause remembers whether collection
was enabled, the last one restores exactly that, so two overlapping batches never turn a
user's ``gc.disable()`` back on, nor leave collection off.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable automatic collection for the block; the outermost pause restores it."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
