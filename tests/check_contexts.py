"""Where a validity check runs in the property tests: alone, beside another live thread, or
under a tracer (``sys.settrace`` / ``sys.setprofile``), which each change what the check may
rely on (reference counts, frames)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

CONTEXTS = ("alone", "thread", "settrace", "setprofile")


@contextmanager
def context(kind: str) -> Iterator[None]:
    """Run the ``with`` body in the context ``kind`` (one of :data:`CONTEXTS`)."""
    if kind == "thread":
        stop = threading.Event()
        other = threading.Thread(target=stop.wait)
        other.start()
        try:
            yield
        finally:
            stop.set()
            other.join()
    elif kind in ("settrace", "setprofile"):
        def tracer(frame: Any, event: str, arg: Any) -> Any:
            return tracer if kind == "settrace" else None

        install = sys.settrace if kind == "settrace" else sys.setprofile
        old = sys.gettrace() if kind == "settrace" else sys.getprofile()
        install(tracer)
        try:
            yield
        finally:
            install(old)  # type: ignore[arg-type]
    else:
        yield
