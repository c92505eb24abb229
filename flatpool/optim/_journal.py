"""All-or-nothing changes to objects others can see (optimizer, state, ``.grad``s, hooks).

Each change is recorded before it is made and each undo sets the old value, so rollback is
exact wherever an exception (Ctrl-C included) landed, and harmless twice. :func:`committed`
runs with signals deferred, so a Ctrl-C lands after the commit or after its rollback.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

from .._interrupts import run_undo, signals_guarded

_MISSING = object()


class Journal:
    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def set_item(self, d: MutableMapping[Any, Any], key: Any, value: Any) -> None:
        old = d.get(key, _MISSING)

        def undo() -> None:
            if old is _MISSING:
                d.pop(key, None)
            else:
                d[key] = old

        self._undo.append(undo)
        d[key] = value

    def set_attr(self, obj: Any, name: str, value: Any) -> None:
        old = getattr(obj, name)
        self._undo.append(lambda: setattr(obj, name, old))
        setattr(obj, name, value)

    def add_hook(self, hooks: dict[Any, Any], fn: object, register: Callable[[], object]) -> None:
        """``register()`` adds ``fn`` to ``hooks``; undo removes every entry holding ``fn``."""

        def undo() -> None:
            for k in [k for k, v in hooks.items() if v is fn]:
                hooks.pop(k, None)

        self._undo.append(undo)
        register()

    def rollback(self) -> None:
        while self._undo:
            run_undo(self._undo[-1])
            self._undo.pop()


@contextmanager
def committed() -> Iterator[Journal]:
    """A journal whose changes stand only if the block finishes, a deferred signal included."""
    journal = Journal()
    try:
        with signals_guarded():  # never opened: signals wait until the block or rollback ends
            try:
                yield journal
            except BaseException:
                journal.rollback()
                raise
    except BaseException:
        with signals_guarded():  # a signal delivered at the end: undo all (again: no-op)
            journal.rollback()
        raise
