"""Pause Python's cycle collector around batch work that creates many small objects.

A batch over thousands of tensors (adoption, a census) creates a few Python objects per tensor;
the growing heap triggers full gc passes that cost more than the work itself. Nothing in
flatpool relies on the cycle collector for correctness (release proofs go by reference counts,
and an explicit ``gc.collect()`` is used where cycles matter), so it is paused for the batch.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable automatic collection for the block; restore the previous state after it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
