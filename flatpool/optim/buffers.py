"""Companion buffers of a set of parameter pools: one mirror pool per (pool, kind).

A kind is ``"grad"`` or an optimizer-state name (``"exp_avg"``, ...). Mirrors are reused as
long as their parameter pool keeps its layout (same slices at the same offsets), so re-planning
after ``load_state_dict`` or a re-adoption copies values into the same memory.
"""

from __future__ import annotations

import torch

from ..pool import FlatPool
from .layout import Member, Segment
from .mirror import mirror


def _signature(pool: FlatPool) -> tuple[object, ...]:
    return (pool.capacity,) + tuple(
        (s.slice_id, s.offset, s.nbytes, s.dtype) for s in sorted(pool.slices(), key=lambda s: s.offset))


class Mirrors:
    """``mirror(pool, kind)`` made once per layout of ``pool``."""

    def __init__(self) -> None:
        self._made: dict[tuple[int, str], tuple[tuple[object, ...], FlatPool, FlatPool]] = {}

    def get(self, pool: FlatPool, kind: str) -> tuple[FlatPool, bool]:
        """The mirror and whether it was made just now (zeroed) rather than reused."""
        sig = _signature(pool)
        key = (id(pool), kind)
        have = self._made.get(key)
        if have is not None and have[0] == sig and have[1] is pool:
            return have[2], False
        m, _ = mirror(pool, f"{pool.name}/{kind}")
        self._made[key] = (sig, pool, m)
        return m, True

    def pools(self) -> list[FlatPool]:
        return [m for _, _, m in self._made.values()]

    def drop(self, kind: str) -> None:
        for key in [k for k in self._made if k[1] == kind]:
            del self._made[key]


def member_view(buf: FlatPool, m: Member) -> torch.Tensor:
    """``m``'s place in a companion buffer, shaped like its local tensor."""
    return buf.view_at(m.offset, m.shape, m.dtype)


def segment_view(buf: FlatPool, s: Segment) -> torch.Tensor:
    """A segment's whole byte range of a buffer, 1-D in its dtype."""
    return buf.view_at(s.start, (s.numel,), s.dtype)


__all__ = ["Mirrors", "member_view", "segment_view"]
