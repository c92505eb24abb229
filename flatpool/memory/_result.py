"""The typed result of attributing a snapshot: blocks, the items they belong to, totals.

Every byte of every active block belongs to exactly one item, so the per-class bytes
(:data:`KINDS`) add up to :attr:`MemoryAttribution.active_bytes` exactly.
"""

from __future__ import annotations

from typing import Literal

from attrs import define

from ._manifest import Manifest, PoolEntry

Kind = Literal["pool", "tensor", "stale", "unattributed"]
KINDS: tuple[Kind, ...] = ("pool", "tensor", "stale", "unattributed")


@define(frozen=True)
class Item:
    """One thing memory is attributed to (``unattributed``: one block nothing known touches)."""

    kind: Kind
    label: str
    reason: str
    """Why it has this class (for an unknown block: where it was allocated)."""
    address: int
    nbytes: int
    """The object's own size (its storage's ``nbytes``; a block's size when unattributed)."""
    device: str | None
    attributed_bytes: int
    """Bytes of active blocks attributed to it (with the allocator's rounding slack)."""
    blocks: int
    referrers: tuple[str, ...] = ()
    pool: PoolEntry | None = None


@define(frozen=True)
class Piece:
    """Bytes of a block and their item (``slack``: uncovered, given to the main item)."""

    address: int
    nbytes: int
    item: int
    slack: bool = False


@define(frozen=True)
class BlockView:
    segment: int
    address: int
    size: int
    state: str
    pieces: tuple[Piece, ...]
    """Covering the block exactly, in address order; empty for an inactive block."""
    kind: Kind | None
    """The class holding most of the block's bytes; ``None`` for an inactive block."""

    @property
    def active(self) -> bool:
        return self.kind is not None


@define(frozen=True)
class SegmentView:
    address: int
    total_size: int
    device: int | None
    first_block: int
    """Index of its first block in :attr:`MemoryAttribution.blocks`."""
    block_count: int


@define(frozen=True)
class ClassTotal:
    kind: Kind
    blocks: int
    """Active blocks with at least one byte of this class."""
    nbytes: int


@define(frozen=True)
class MemoryAttribution:
    source: str
    """``"allocator"`` (a device snapshot) or ``"cpu census"`` (:func:`cpu_snapshot`)."""
    segments: tuple[SegmentView, ...]
    blocks: tuple[BlockView, ...]
    items: tuple[Item, ...]
    totals: tuple[ClassTotal, ...]
    active_bytes: int
    reserved_bytes: int
    manifest: Manifest
    notes: tuple[str, ...] = ()

    def bytes_of(self, kind: Kind) -> int:
        return sum(t.nbytes for t in self.totals if t.kind == kind)

    def items_of(self, kind: Kind) -> tuple[Item, ...]:
        return tuple(i for i in self.items if i.kind == kind)

    def blocks_of(self, kind: Kind) -> tuple[BlockView, ...]:
        """Active blocks whose main class is ``kind``."""
        return tuple(b for b in self.blocks if b.kind == kind)

    @property
    def stale(self) -> tuple[Item, ...]:
        return self.items_of("stale")

    def segment_blocks(self, index: int) -> tuple[BlockView, ...]:
        seg = self.segments[index]
        return self.blocks[seg.first_block:seg.first_block + seg.block_count]

    def render(self, top: int = 10) -> str:
        """The plain-text table: per class blocks and bytes, the ``top`` largest items, pools."""
        from ._table import render

        return render(self, top)
