"""Originals a fail-safe fusion left alive: which member, how many bytes, held by what.

A user's reference to an original shard inside a framework's forward is not an error; each
such original is remembered once (for one warning) and forgotten when it dies.
"""

from __future__ import annotations

from collections.abc import Sequence

from attrs import define

from flatpool import AdoptionReport, FlatPool, OriginalKeptAliveWarning
from flatpool._warn import logger, warn


@define(frozen=True)
class KeptOriginal:
    """One original shard storage a fail-safe fusion kept alive."""

    member: str
    """The member whose original it is (its parameter name where the framework knows it)."""
    pool: str
    nbytes: int
    holders: tuple[str, ...]
    """What holds it, as the release proof's gc scan named it."""
    address: int
    """Data pointer of the original storage (with ``pool``, how it is found again)."""

    def describe(self) -> str:
        return (f"{self.member} (pool {self.pool!r}): {self.nbytes} bytes of the original shard "
                f"storage kept alive, held by: {'; '.join(self.holders)}")


def _when_freed(by_pool: bool) -> str:
    """When the memory of a kept original comes back."""
    if not by_pool:  # only the holders named keep it: it dies by reference count
        return ("The memory comes back the moment the last of those references is dropped "
                "(nothing else keeps the original).")
    return ("Something outside Python may still read the original, so the pool keeps it until "
            "that holder lets go; it is freed at the layer's next check after that (the next "
            "step's forward, or reading kept_alive).")


class KeptAlive:
    """The originals of one group still kept alive (mutable, beside the frozen GroupBuffers)."""

    __slots__ = ("_items", "_unreported", "logged")

    def __init__(self) -> None:
        # Tuples, replaced on change: a group that kept nothing (nearly every one) holds the
        # shared empty tuple, not two lists the cycle collector scans.
        self._items: tuple[tuple[FlatPool, KeptOriginal], ...] = ()
        self._unreported: tuple[tuple[KeptOriginal, bool], ...] = ()  # and: the pool keeps it
        self.logged: set[str] = set()
        """Reasons the group's hooks already logged (skips, failures): each is logged once."""

    def note(self, pool: FlatPool, report: AdoptionReport, names: Sequence[str]) -> None:
        """Record what ``report``'s adoption left alive; ``names[i]`` names spec ``i``'s member."""
        if report.all_released:  # nothing kept alive: no item to look at
            return
        items = list(report.items)
        pinned = [(i, item) for i, item in enumerate(items) if item.pinned_by]
        if not pinned:
            return
        if len(items) != len(names):
            names = []
        traced = {u.label.split(" ", 1)[0]: u for u in pool.unreleased_originals()}
        for i, item in pinned:
            u = traced.get(f"#{i}")
            if u is None:  # died between the proof and now
                continue
            kept = KeptOriginal(names[i] if names else u.label, pool.name, u.nbytes,
                                item.pinned_by, u.address)
            if any(k == kept for _, k in self._items):
                continue
            self._items = (*self._items, (pool, kept))
            self._unreported = (*self._unreported, (kept, u.kept_by_pool))

    def report(self) -> None:
        """One warning and one log record for each original noted since the last call."""
        todo, self._unreported = self._unreported, ()
        for kept, by_pool in todo:
            logger.info("kept alive: %s", kept.describe())  # the warning is the alert
            warn(f"{kept.describe()}. Training goes on from the pool. {_when_freed(by_pool)}",
                 OriginalKeptAliveWarning, past_torch=True)

    def refresh(self) -> int:
        """Forget the originals that died; returns how many are still alive."""
        if not self._items:
            return 0
        alive: list[tuple[FlatPool, KeptOriginal]] = []
        by_pool: dict[int, set[int]] = {}
        for pool, kept in self._items:
            if id(pool) not in by_pool:  # unreleased_originals() runs release_kept() first
                by_pool[id(pool)] = {u.address for u in pool.unreleased_originals()}
            if kept.address in by_pool[id(pool)]:
                alive.append((pool, kept))
            else:
                logger.info("released: %s (the reference was dropped)", kept.describe())
        self._items = tuple(alive)
        return len(alive)

    @property
    def originals(self) -> list[KeptOriginal]:
        return [k for _, k in self._items]

    def __len__(self) -> int:
        return len(self._items)
