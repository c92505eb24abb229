"""Pictures of an attribution: device memory by class, and one pool's layout.

The top view draws each segment as a horizontal bar (full width = that segment's size, its
size and address on the left) with its blocks coloured by class: pool, adopted (pool slices
that named tensors live in), stale, tensor (outside the pools), unattributed, free (inactive).
Pools and stale originals are labelled. With many segments, those holding pool or stale
blocks are shown first, then the fullest, up to ``max_segments``.

The bottom view lays out one pool (the largest unless named): slices coloured by dtype and
labelled with the tensor that lives there, alignment padding hatched, free ranges pale.

Needs the ``viz`` extra (matplotlib); without it :class:`MissingExtraError` says so. Files are
written atomically.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence

from .errors import ManifestError
from .files import write_atomic
from .manifest import PoolEntry
from .mpl import Axes, Matplotlib, load
from .result import MemoryAttribution
from .units import fmt_bytes

COLOURS = {
    "pool": "#4C72B0",
    "adopted": "#55A868",
    "stale": "#C44E52",
    "tensor": "#8172B2",
    "unattributed": "#8C8C8C",
    "free": "#E6E6E6",
}
LEGEND = (
    ("pool", "pool / flat buffer"),
    ("adopted", "adopted slice (named tensor)"),
    ("stale", "STALE original"),
    ("tensor", "tensor outside pools"),
    ("unattributed", "unattributed"),
    ("free", "free (inactive)"),
)
DTYPE_COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#8172B2", "#937860", "#DA8BC3", "#CCB974",
                 "#64B5CD", "#C44E52")
PADDING = "#BDBDBD"
ROW_INCHES = 0.34
POOL_INCHES = 2.4
COLUMN_INCHES = 9.0
DPI = 100


def draw(
    attribution: MemoryAttribution,
    out: str | os.PathLike[str],
    *,
    title: str | None = None,
    pool: str | None = None,
    max_segments: int = 24,
) -> None:
    """Write the picture of ``attribution`` to ``out`` (PNG)."""
    draw_comparison(out, [(title or "device memory", attribution)], pool=pool,
                    max_segments=max_segments)


def draw_comparison(
    out: str | os.PathLike[str],
    panels: Sequence[tuple[str, MemoryAttribution]],
    *,
    pool: str | None = None,
    max_segments: int = 24,
) -> None:
    """Several attributions side by side (e.g. ``[("naive rebase", a), ("flatpool", b)]``),
    one column each, in one PNG."""
    if not panels:
        raise ManifestError("nothing to draw: give at least one (title, attribution)", "panels")
    write_atomic(out, render_png(panels, pool=pool, max_segments=max_segments))


def render_png(
    panels: Sequence[tuple[str, MemoryAttribution]],
    *,
    pool: str | None = None,
    max_segments: int = 24,
) -> bytes:
    """The PNG bytes :func:`draw_comparison` writes."""
    mpl = load()
    if pool is not None:
        for _, a in panels:
            a.manifest.pool(pool)  # an unknown name fails before any drawing
    chosen = [_chosen(a, max_segments) for _, a in panels]
    rows = max(3, max(len(c) for c in chosen))
    # Fixed margins in inches (a layout engine costs a third of the drawing time): titles
    # above each view, tick labels and the legend below, segment labels on the left.
    width, height = COLUMN_INCHES * len(panels), 1.55 + ROW_INCHES * rows + POOL_INCHES
    fig = mpl.figure(figsize=(width, height), dpi=DPI)

    def box(col: int, bottom: float, top: float) -> tuple[float, float, float, float]:
        left = col * COLUMN_INCHES + 1.8
        return (left / width, bottom / height, (COLUMN_INCHES - 2.2) / width,
                (top - bottom) / height)

    top_bottom, top_top = POOL_INCHES + 0.85, height - 0.7
    for col, ((title, a), segs) in enumerate(zip(panels, chosen)):
        _segments_view(fig.add_axes(box(col, top_bottom, top_top)), a, title, segs, rows,
                       top_top - top_bottom, mpl)
        _pool_view(fig.add_axes(box(col, 0.65, POOL_INCHES - 0.6)), a, pool, mpl)
    buf = io.BytesIO()
    mpl.canvas(fig).print_png(buf)
    return buf.getvalue()


def _chosen(a: MemoryAttribution, max_segments: int) -> list[int]:
    def score(i: int) -> tuple[bool, bool, int]:
        kinds = {b.kind for b in a.segment_blocks(i)}
        active = sum(b.size for b in a.segment_blocks(i) if b.active)
        return ("stale" in kinds, "pool" in kinds, active)

    best = sorted(range(len(a.segments)), key=score, reverse=True)[:max(1, max_segments)]
    return sorted(best)


def _split(start: int, end: int, inside: Sequence[tuple[int, int]]) -> list[tuple[int, int, bool]]:
    """``[start, end)`` cut into runs inside/outside the sorted ranges ``inside``."""
    out: list[tuple[int, int, bool]] = []
    pos = start
    for a, b in inside:
        a, b = max(a, start), min(b, end)
        if b <= a:
            continue
        if a > pos:
            out.append((pos, a, False))
        out.append((a, b, True))
        pos = b
    if pos < end:
        out.append((pos, end, False))
    return out


def _adopted_ranges(p: PoolEntry) -> list[tuple[int, int]]:
    return sorted((p.address + s.offset, p.address + s.end) for s in p.slices if s.tensors)


def _segments_view(ax: Axes, a: MemoryAttribution, title: str, chosen: Sequence[int],
                   rows: int, inches: float, mpl: Matplotlib) -> None:
    ticks: list[float] = []
    labels: list[str] = []
    for row, si in enumerate(chosen):
        seg = a.segments[si]
        y = rows - 1 - row
        scale = 1.0 / max(seg.total_size, 1)
        spans: dict[str, list[tuple[float, float]]] = {}
        named: dict[int, tuple[int, int]] = {}
        adopted_in: dict[int, list[tuple[int, int]]] = {}
        for b in a.segment_blocks(si):
            if not b.active:
                spans.setdefault("free", []).append(((b.address - seg.address) * scale,
                                                     b.size * scale))
                continue
            for p in b.pieces:
                item = a.items[p.item]
                if item.pool is not None:
                    inside = adopted_in.setdefault(p.item, _adopted_ranges(item.pool))
                    runs = _split(p.address, p.address + p.nbytes, inside)
                else:
                    runs = [(p.address, p.address + p.nbytes, False)]
                for s, e, adopted in runs:
                    colour: str = "adopted" if adopted else item.kind
                    width = (e - s) * scale
                    if item.kind == "stale":
                        width = max(width, 0.004)  # a stale sliver must stay visible
                    spans.setdefault(colour, []).append(((s - seg.address) * scale, width))
                lo, hi = named.get(p.item, (p.address, p.address))
                if p.nbytes > hi - lo:  # labels sit on an item's largest piece in the row
                    named[p.item] = (p.address, p.address + p.nbytes)
        for colour, xs in spans.items():
            ax.broken_barh(xs, (y - 0.38, 0.76), facecolors=COLOURS[colour],
                           edgecolor="white", linewidth=0.6)
        for index, (lo, hi) in named.items():
            item = a.items[index]
            loud = item.kind in ("pool", "stale")
            if not loud and (hi - lo) * scale < 0.15:
                continue  # pools and stale originals are always named; the rest when roomy
            text = {"stale": f"STALE {item.label}", "unattributed": item.reason}.get(
                item.kind, item.label)
            ax.text(((lo + hi) / 2 - seg.address) * scale, y, _short(text, 48), ha="center",
                    va="center", fontsize=8 if loud else 7, color="white",
                    fontweight="bold" if loud else "normal", clip_on=True)
        ticks.append(float(y))
        labels.append(f"{fmt_bytes(seg.total_size)} @ {seg.address:#x}")
    ax.set_xlim(0.0, 1.0)
    ax.set_ylim(-0.6, rows - 0.4)
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.set_xticks([0.0, 0.25, 0.5, 0.75, 1.0], ["0", "1/4", "1/2", "3/4", "end"],
                  fontsize=7)
    totals = {t.kind: t for t in a.totals}
    shown = f"{len(chosen)} of {len(a.segments)} segment(s)" if len(chosen) < len(a.segments) \
        else f"{len(a.segments)} segment(s)"
    ax.set_title(
        f"{title}\nactive {fmt_bytes(a.active_bytes)}: pool {fmt_bytes(totals['pool'].nbytes)}"
        f" | STALE {fmt_bytes(totals['stale'].nbytes)} in {len(a.stale)} | tensor "
        f"{fmt_bytes(totals['tensor'].nbytes)} | unattributed "
        f"{fmt_bytes(totals['unattributed'].nbytes)}\n{shown} ({a.source}); one row per "
        "segment, full width = its size", fontsize=9, loc="left")
    handles = [mpl.patch(facecolor=COLOURS[k], label=text) for k, text in LEGEND]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25 / inches),
              ncol=3, fontsize=7, frameon=False)


def _pick_pool(a: MemoryAttribution, name: str | None) -> PoolEntry | None:
    if name is not None:
        return a.manifest.pool(name)
    pools = sorted(a.manifest.pools, key=lambda p: -p.capacity)
    return pools[0] if pools else None


def _pool_view(ax: Axes, a: MemoryAttribution, name: str | None, mpl: Matplotlib) -> None:
    ax.set_yticks([], [])
    p = _pick_pool(a, name)
    if p is None or p.capacity == 0:
        ax.set_xticks([], [])
        ax.text(0.5, 0.5, "no flatpool pool in this process's manifest", ha="center",
                va="center", fontsize=9)
        return
    dtypes = sorted({s.dtype for s in p.slices})
    colour = {d: DTYPE_COLOURS[i % len(DTYPE_COLOURS)] for i, d in enumerate(dtypes)}
    sliver = p.capacity * 0.002  # a tiny slice (a bias) must stay visible
    for s in p.slices:
        ax.broken_barh([(s.offset, max(s.nbytes, sliver))], (0.1, 0.8),
                       facecolors=colour[s.dtype], edgecolor="white", linewidth=0.4)
        if s.nbytes / p.capacity > 0.06:
            label = s.tensors[0] if s.tensors else f"slice {s.slice_id}"
            ax.text(s.offset + s.nbytes / 2, 0.5, f"{_short(label, 28)}\n{fmt_bytes(s.nbytes)}",
                    ha="center", va="center", fontsize=7, color="white", clip_on=True)
    gaps = p.gaps()
    for g in gaps:
        if g.kind == "padding":
            ax.broken_barh([(g.offset, g.nbytes)], (0.1, 0.8), facecolors=PADDING,
                           edgecolor="#7F7F7F", hatch="////", linewidth=0.3)
        else:
            ax.broken_barh([(g.offset, g.nbytes)], (0.1, 0.8), facecolors=COLOURS["free"],
                           edgecolor="white", linewidth=0.6)
    ax.set_xlim(0.0, float(p.capacity))
    ax.set_ylim(0.0, 1.0)
    ticks = [p.capacity * f for f in (0.0, 0.25, 0.5, 0.75, 1.0)]
    ax.set_xticks(ticks, [fmt_bytes(int(t)) for t in ticks], fontsize=7)
    padding = sum(g.nbytes for g in gaps if g.kind == "padding")
    free = [g for g in gaps if g.kind == "free"]
    ax.set_title(
        f"layout of pool {p.name!r} on {p.device}: capacity {fmt_bytes(p.capacity)}, "
        f"alignment {p.alignment} B\n{len(p.slices)} slice(s) holding "
        f"{fmt_bytes(p.used_bytes)} ({fmt_bytes(p.adopted_bytes)} adopted), padding "
        f"{fmt_bytes(padding)}, free {fmt_bytes(sum(g.nbytes for g in free))} in "
        f"{len(free)} range(s)", fontsize=9, loc="left")
    handles = [mpl.patch(facecolor=colour[d], label=d) for d in dtypes]
    handles.append(mpl.patch(facecolor=PADDING, edgecolor="#7F7F7F", hatch="////",
                             label="alignment padding"))
    handles.append(mpl.patch(facecolor=COLOURS["free"], label="free range"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25),
              ncol=len(handles), fontsize=7, frameon=False)


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else "..." + text[-(limit - 3):]


__all__ = ["COLOURS", "draw", "draw_comparison", "render_png"]
