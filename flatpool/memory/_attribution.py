"""Attribute every active block of an allocator snapshot to the objects a manifest names.

Rules that keep totals exact: where object ranges overlap the higher class wins each byte
(``stale`` over ``pool`` over ``tensor``); a block is cut at range boundaries, each piece to its
object; uncovered bytes of a block (rounding slack) go to the object holding most of it; a
block no range touches is ``unattributed``. Objects match only segments of their own device.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence

import torch
from attrs import define

from .. import FlatPool, InvalidRequestError
from ._collect import Watches, build_manifest
from ._manifest import Manifest, PoolEntry
from ._result import KINDS, BlockView, ClassTotal, Item, Kind, MemoryAttribution, Piece
from ._result import SegmentView
from ._snapshot import Snapshot, SnapshotSource, load_snapshot
from ._table import fmt_bytes

Progress = Callable[[int, int], None]
"""Called with (blocks done, blocks in all) during attribution."""

_PRIORITY: dict[Kind, int] = {"stale": 3, "pool": 2, "tensor": 1, "unattributed": 0}


@define(frozen=True)
class _Obj:
    kind: Kind
    label: str
    reason: str
    start: int
    end: int
    device: str | None
    names: tuple[str, ...]
    pool: PoolEntry | None = None


@define(frozen=True)
class _Region:
    start: int
    end: int
    obj: int


def attribute(
    snapshot: SnapshotSource,
    roots: object = None,
    *,
    manifest: Manifest | None = None,
    pools: Iterable[FlatPool] | None = None,
    flats: Sequence[torch.Tensor] | None = None,
    watch: Watches | None = None,
    progress: Progress | None = None,
) -> MemoryAttribution:
    """Classify every active block of ``snapshot``, naming objects live or by a ``manifest``."""
    snap = load_snapshot(snapshot)
    if manifest is None:
        manifest = build_manifest(roots, pools=pools, flats=flats or (), watch=watch or ())
    elif roots is not None or pools is not None or flats is not None or watch is not None:
        raise InvalidRequestError("attribute() takes either a manifest or live roots/pools/"
                                  "flats/watch, not both: the manifest already names them")
    return attribute_manifest(snap, manifest, progress=progress)


def _objects(manifest: Manifest) -> list[_Obj]:
    """Manifest entries as ranges, the most specific first (ties go to the earlier one)."""
    objs: list[_Obj] = []
    for o in manifest.originals:
        reason = (f"original kept alive by pool {o.pool!r}" if o.source == "pool"
                  else "watched original, still alive")
        objs.append(_Obj("stale", o.label, reason, o.address, o.end, o.device, ()))
    for t in manifest.tensors:
        if t.stale_of is not None:
            objs.append(_Obj("stale", t.label, f"copy of {t.stale_of}", t.address, t.end,
                             t.device, t.names))
    for p in manifest.pools:
        adopted = sum(1 for s in p.slices if s.tensors)
        reason = (f"flatpool pool: {len(p.slices)} slice(s), {fmt_bytes(p.used_bytes)} in "
                  f"slices, {adopted} adopted")
        objs.append(_Obj("pool", p.name, reason, p.address, p.end, p.device, (), p))
    for f in manifest.flats:
        objs.append(_Obj("pool", f.label, "flat buffer (not a flatpool pool)", f.address, f.end,
                         f.device, f.names))
    for t in manifest.tensors:
        if t.stale_of is None:
            roles = ", ".join(dict.fromkeys(t.roles)) or "tensor"
            objs.append(_Obj("tensor", t.label, roles, t.address, t.end, t.device, t.names))
    return objs


def _device_matches(obj_device: str | None, seg_device: int | None, source: str) -> bool:
    if obj_device is None:
        return True
    kind, _, index = obj_device.partition(":")
    if source == "cpu census":
        return kind == "cpu"
    if kind == "cpu":
        return False
    return seg_device is None or not index.isdigit() or int(index) == seg_device


def _resolve(objs: list[_Obj], chosen: list[int],
             extra_names: dict[int, list[str]]) -> list[_Region]:
    """Non-overlapping regions, each owned by the highest-priority object covering it."""
    live = sorted((i for i in chosen if objs[i].end > objs[i].start),
                  key=lambda i: objs[i].start)
    points = sorted({x for i in live for x in (objs[i].start, objs[i].end)})
    heap: list[tuple[int, int, int]] = []  # (-priority, object index, end)
    regions: list[_Region] = []
    j = 0
    for x, nxt in zip(points, points[1:]):
        while j < len(live) and objs[live[j]].start <= x:
            i = live[j]
            heapq.heappush(heap, (-_PRIORITY[objs[i].kind], i, objs[i].end))
            j += 1
        while heap and heap[0][2] <= x:
            heapq.heappop(heap)
        if not heap:
            continue
        winner = heap[0][1]
        for _, other, end in heap:
            if other != winner and end > x:
                names = extra_names.setdefault(winner, [])
                for n in objs[other].names or (objs[other].label,):
                    if n not in names:
                        names.append(n)
        if regions and regions[-1].obj == winner and regions[-1].end == x:
            regions[-1] = _Region(regions[-1].start, nxt, winner)
        else:
            regions.append(_Region(x, nxt, winner))
    return regions


class _Tally:
    def __init__(self) -> None:
        self.bytes: dict[int, int] = {}
        self.blocks: dict[int, int] = {}

    def add(self, item: int, nbytes: int) -> None:
        self.bytes[item] = self.bytes.get(item, 0) + nbytes


def attribute_manifest(
    snapshot: Snapshot, manifest: Manifest, *, progress: Progress | None = None
) -> MemoryAttribution:
    """The attribution of ``snapshot`` against ``manifest`` (see the module docstring)."""
    objs = _objects(manifest)
    extra_names: dict[int, list[str]] = {}
    regions_by_device: dict[int | None, list[_Region]] = {}
    for dev in {s.device for s in snapshot.segments}:
        chosen = [i for i, o in enumerate(objs) if _device_matches(o.device, dev, snapshot.source)]
        regions_by_device[dev] = _resolve(objs, chosen, extra_names)
    starts_by_device = {dev: [r.start for r in regs] for dev, regs in regions_by_device.items()}
    winners = sorted({r.obj for regs in regions_by_device.values() for r in regs})
    item_of = {obj: n for n, obj in enumerate(winners)}

    tally = _Tally()
    kind_blocks: dict[Kind, int] = {}
    kind_bytes: dict[Kind, int] = {}
    unattributed: list[Item] = []
    blocks: list[BlockView] = []
    segments: list[SegmentView] = []
    total = snapshot.block_count
    done = 0
    for si, seg in enumerate(snapshot.segments):
        regs, starts = regions_by_device[seg.device], starts_by_device[seg.device]
        segments.append(SegmentView(seg.address, seg.total_size, seg.device, len(blocks),
                                    len(seg.blocks)))
        for b in seg.blocks:
            done += 1
            if progress is not None and done % 8192 == 0:
                progress(done, total)
            if not b.active:
                blocks.append(BlockView(si, b.address, b.size, b.state, (), None))
                continue
            parts: list[Piece] = []
            gaps: list[tuple[int, int]] = []
            pos = b.address
            i = max(bisect_right(starts, b.address) - 1, 0)
            while i < len(regs) and regs[i].start < b.end:
                r = regs[i]
                s, e = max(r.start, b.address), min(r.end, b.end)
                if e > s:
                    if s > pos:
                        gaps.append((pos, s))
                    parts.append(Piece(s, e - s, item_of[r.obj]))
                    pos = e
                i += 1
            if pos < b.end:
                gaps.append((pos, b.end))
            if parts:
                share: dict[int, int] = {}
                for p in parts:
                    share[p.item] = share.get(p.item, 0) + p.nbytes
                owner = max(share, key=lambda k: (share[k], -k))
                pieces = sorted(parts + [Piece(g0, g1 - g0, owner, True) for g0, g1 in gaps],
                                key=lambda p: p.address)
            else:
                index = len(winners) + len(unattributed)
                unattributed.append(Item(
                    "unattributed", f"block@{b.address:#x}",
                    b.where or ("pending free" if b.state != "active_allocated"
                                else "no known object"),
                    b.address, b.size, None if seg.device is None else f"device {seg.device}",
                    b.size, 1))
                pieces = [Piece(b.address, b.size, index)]
            kinds: dict[Kind, int] = {}
            for p in pieces:
                kind = objs[winners[p.item]].kind if p.item < len(winners) else "unattributed"
                kinds[kind] = kinds.get(kind, 0) + p.nbytes
                if p.item < len(winners):
                    tally.add(p.item, p.nbytes)
            for item in {p.item for p in pieces if p.item < len(winners)}:
                tally.blocks[item] = tally.blocks.get(item, 0) + 1
            for kind, nbytes in kinds.items():
                kind_blocks[kind] = kind_blocks.get(kind, 0) + 1
                kind_bytes[kind] = kind_bytes.get(kind, 0) + nbytes
            main = max(kinds, key=lambda k: (kinds[k], _PRIORITY[k]))
            blocks.append(BlockView(si, b.address, b.size, b.state, tuple(pieces), main))
    if progress is not None:
        progress(done, total)

    items: list[Item] = []
    notes: list[str] = []
    for n, obj_index in enumerate(winners):
        o = objs[obj_index]
        refs = tuple(dict.fromkeys(o.names + tuple(extra_names.get(obj_index, ()))))
        got = tally.bytes.get(n, 0)
        items.append(Item(o.kind, o.label, o.reason, o.start, o.end - o.start, o.device, got,
                          tally.blocks.get(n, 0), refs, o.pool))
        if got == 0:
            notes.append(f"{o.kind} {o.label!r} ({fmt_bytes(o.end - o.start)} at {o.start:#x}) "
                         "is in no active block: snapshot and manifest taken at different "
                         "times, or on another device")
    items.extend(unattributed)

    totals = [ClassTotal(k, kind_blocks.get(k, 0), kind_bytes.get(k, 0)) for k in KINDS]
    return MemoryAttribution(
        snapshot.source, tuple(segments), tuple(blocks), tuple(items), tuple(totals),
        snapshot.active_bytes, snapshot.reserved_bytes, manifest, tuple(notes))
