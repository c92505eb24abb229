"""Pictures of an attribution: device memory by class, and the layout of its pools.

Bar lengths are bytes on one linear scale shared by every column; a bar too short to see is
drawn :data:`MIN_FRACTION` of the axis long and labelled with its true size. Needs the ``viz``
extra (matplotlib).
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence

from attrs import define

from ._errors import ManifestError
from ._files import write_atomic
from ._manifest import PoolEntry
from ._mpl import Axes, Figure, Matplotlib, load, plain_text
from ._result import MemoryAttribution
from ._table import fmt_bytes

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
    ("free", "free (inactive)"))
DTYPE_COLOURS = ("#DD8452", "#64B5CD", "#DA8BC3", "#CCB974", "#937860", "#2A9D8F", "#E9C46A",
                 "#6D597A", "#B5838D")
PADDING = "#BDBDBD"
MIN_FRACTION = 0.005
"""The shortest bar drawn, as a fraction of its axis."""
ROW_INCHES = 0.34
POOL_INCHES = 2.5
COLUMN_INCHES = 9.0
LEFT_INCHES, RIGHT_INCHES = 1.8, 0.4
DPI = 100
_CHAR_INCHES = 0.55 / 72  # average DejaVu Sans advance per point of font size
_SMALL_LABELS = 24  # small slices named above a pool's bar; the rest are counted


def draw(attribution: MemoryAttribution, out: str | os.PathLike[str], *, title: str | None = None,
         pool: str | None = None, max_segments: int = 24) -> None:
    """Write the picture of ``attribution`` to ``out`` (PNG)."""
    draw_comparison(out, [(title or "device memory", attribution)], pool=pool,
                    max_segments=max_segments)


def draw_comparison(out: str | os.PathLike[str], panels: Sequence[tuple[str, MemoryAttribution]],
                    *, pool: str | None = None, max_segments: int = 24) -> None:
    """Several attributions side by side, one column each on one byte scale, in one PNG."""
    write_atomic(out, render_png(panels, pool=pool, max_segments=max_segments))


def render_png(panels: Sequence[tuple[str, MemoryAttribution]], *, pool: str | None = None,
               max_segments: int = 24) -> bytes:
    """The PNG bytes :func:`draw_comparison` writes."""
    mpl = load()
    with plain_text():  # names are shown as written, never parsed as mathtext
        fig = figure(panels, pool=pool, max_segments=max_segments, mpl=mpl)
        buf = io.BytesIO()
        mpl.canvas(fig).print_png(buf)
    return buf.getvalue()


def figure(panels: Sequence[tuple[str, MemoryAttribution]], *, pool: str | None = None,
           max_segments: int = 24, mpl: Matplotlib | None = None) -> Figure:
    """The matplotlib ``Figure`` :func:`render_png` prints (bars carry ``gid`` s naming what
    they draw: ``total:<class>``, ``segment:<address>:<class>``, ``slice:<id>``)."""
    if not panels:
        raise ManifestError("nothing to draw: give at least one (title, attribution)", "panels")
    mpl = mpl or load()
    if pool is not None:
        for _, a in panels:
            a.manifest.pool(pool)  # an unknown name fails before any drawing
    chosen = [_chosen(a, max_segments) for _, a in panels]
    layouts = [(title, p) for (title, a) in panels
               if (p := _pick_pool(a, pool)) is not None and p.capacity > 0]
    rows = 1 + max(2, max(len(c) for c in chosen))  # the total row, then the segments
    span = max(max([a.active_bytes] + [a.segments[i].total_size for i in c])
               for (_, a), c in zip(panels, chosen))
    # Fixed margins in inches: a layout engine costs a third of the drawing time.
    pool_part = POOL_INCHES if layouts else 0.0
    width = COLUMN_INCHES * len(panels)
    height = 0.75 + ROW_INCHES * rows + 0.9 + pool_part
    fig = mpl.figure(figsize=(width, height), dpi=DPI)

    def box(left: float, w: float, bottom: float, top: float) -> tuple[float, float, float,
                                                                        float]:
        return (left / width, bottom / height, w / width, (top - bottom) / height)

    top_top = height - 0.75
    top_bottom = top_top - ROW_INCHES * rows
    axis_inches = COLUMN_INCHES - LEFT_INCHES - RIGHT_INCHES
    scale = _Scale(float(max(span, 1)), axis_inches)
    for _ in range(2):  # widen the shared scale until the names after the rows fit
        plans = [_plan(a, c, scale) for (_, a), c in zip(panels, chosen)]
        reach = max(r.reach(scale) for p in plans for r in p)
        scale = _Scale(min(max(scale.span, reach), 1.5 * max(span, 1)), axis_inches)
    plans = [_plan(a, c, scale) for (_, a), c in zip(panels, chosen)]
    for col, ((title, a), segs, plan) in enumerate(zip(panels, chosen, plans)):
        ax = fig.add_axes(box(col * COLUMN_INCHES + LEFT_INCHES, axis_inches, top_bottom,
                              top_top))
        shown = f"{len(segs)} of {len(a.segments)} segment(s)" if len(segs) < len(a.segments) \
            else f"{len(a.segments)} segment(s)"
        _segments_view(ax, a, title, plan, shown, rows, scale, mpl, multi=len(panels) > 1)
    for i, (title, p) in enumerate(layouts):
        share = width / len(layouts)
        ax = fig.add_axes(box(i * share + LEFT_INCHES, share - LEFT_INCHES - RIGHT_INCHES,
                              0.7, pool_part - 0.75))
        _pool_view(ax, p, title if len(panels) > 1 else None,
                   _Scale(float(p.capacity), share - LEFT_INCHES - RIGHT_INCHES), mpl)
    return fig


@define(frozen=True)
class _Scale:
    """A linear byte axis ``[0, span]`` drawn ``inches`` long."""

    span: float
    inches: float

    def shortest(self) -> float:
        return self.span * MIN_FRACTION

    def fits(self, text: str, nbytes: float, fontsize: float) -> bool:
        return len(text) * fontsize * _CHAR_INCHES + 0.08 <= nbytes / self.span * self.inches

    def text_bytes(self, text: str, fontsize: float) -> float:
        return (len(text) * fontsize * _CHAR_INCHES + 0.1) / self.inches * self.span


def _ticks(span: float) -> list[float]:
    """0 and multiples of a power of two: 3 to 8 ticks up to ``span``."""
    step = 1
    while span / step > 8:
        step *= 2
    while span / step < 3 and step > 1:
        step //= 2
    return [float(step * k) for k in range(int(span // step) + 1)]


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


def _bar(ax: Axes, spans: Sequence[tuple[float, float]], y: float, colour: str, gid: str,
         scale: _Scale, height: float = 0.76) -> None:
    """Bars of true length, or :data:`MIN_FRACTION` of the axis when shorter."""
    shown = [(x, max(w, scale.shortest())) for x, w in spans]
    ax.broken_barh(shown, (y - height / 2, height), facecolors=colour, edgecolor="white",
                   linewidth=0.6, gid=gid)


@define(frozen=True)
class _Row:
    """One row of bars, planned before drawing (names inside bars, names after, its end)."""

    label: str
    bars: tuple[tuple[str, str, tuple[tuple[float, float], ...]], ...]  # colour, gid, runs
    inside: tuple[tuple[float, str, bool], ...]  # centre, name, loud
    after: tuple[str, ...]
    end: float

    def reach(self, scale: _Scale) -> float:
        """The span the row needs so that its names after it fit (at most 1.8 x its end)."""
        if not self.after:
            return self.end
        share = min(scale.text_bytes(", ".join(self.after), 7) / scale.span, 0.45)
        return self.end / (1.0 - share)


def _plan_total(a: MemoryAttribution, scale: _Scale) -> _Row:
    """The column's active bytes of every segment, stacked by class."""
    by_colour: dict[str, int] = {}
    for si in range(len(a.segments)):
        for colour, xs in _segment_spans(a, si)[0].items():
            if colour != "free":
                by_colour[colour] = by_colour.get(colour, 0) + int(sum(w for _, w in xs))
    x = 0.0
    bars, inside, after = [], [], []
    for colour, _ in LEGEND:
        n = by_colour.get(colour, 0)
        if n == 0:
            continue
        bars.append((colour, f"total:{colour}", ((x, float(n)),)))
        text = f"{colour.upper() if colour == 'stale' else colour} {fmt_bytes(n)}"
        if scale.fits(text, n, 7):
            inside.append((x + n / 2, text, True))
        else:
            after.append(text)
        x += max(float(n), scale.shortest())
    return _Row(f"active {fmt_bytes(a.active_bytes)}", tuple(bars), tuple(inside), tuple(after),
                x)


def _plan_segment(a: MemoryAttribution, si: int, scale: _Scale) -> _Row:
    seg = a.segments[si]
    spans, named = _segment_spans(a, si)
    bars = tuple((c, f"segment:{seg.address:#x}:{c}", tuple(xs)) for c, xs in spans.items())
    inside, after = [], []
    for index, (lo, hi) in named.items():
        item = a.items[index]
        loud = item.kind in ("pool", "stale")
        text = {"stale": f"STALE {item.label}", "unattributed": item.reason}.get(
            item.kind, item.label) or item.kind
        if scale.fits(_short(text, 48), hi - lo, 7):
            inside.append((lo - seg.address + (hi - lo) / 2, _short(text, 48), loud))
        else:
            after.append(f"{_short(text, 40)} ({fmt_bytes(item.attributed_bytes)})")
    return _Row(f"{fmt_bytes(seg.total_size)} @ {seg.address:#x}", bars, tuple(inside),
                tuple(after), max(float(seg.total_size), scale.shortest()))


def _plan(a: MemoryAttribution, chosen: Sequence[int], scale: _Scale) -> list[_Row]:
    return [_plan_total(a, scale), *(_plan_segment(a, si, scale) for si in chosen)]


def _draw_row(ax: Axes, row: _Row, y: float, scale: _Scale) -> None:
    for colour, gid, xs in row.bars:
        _bar(ax, xs, y, COLOURS[colour], gid, scale)
    for x, text, loud in row.inside:
        ax.text(x, y, text, ha="center", va="center", fontsize=7, color="white",
                fontweight="bold" if loud else "normal", gid="label")
    if not row.after:
        return
    text = ", ".join(row.after)
    room = scale.span - row.end
    fits = scale.text_bytes(text, 7) <= room
    if not fits:  # no room left on the scale: over the row's right end, on white
        text = _short(text, int(0.45 * scale.inches / (7 * _CHAR_INCHES)))
    ax.text(row.end + scale.span * 0.005 if fits else scale.span * 0.995, y, text,
            ha="left" if fits else "right", va="center", fontsize=7, color="black", gid="label",
            bbox=None if fits else {"facecolor": "white", "alpha": 0.85, "edgecolor": "none",
                                    "pad": 1.0})


Spans = dict[str, list[tuple[float, float]]]


def _segment_spans(a: MemoryAttribution, si: int) -> tuple[Spans, dict[int, tuple[int, int]]]:
    """Segment ``si``'s runs by colour, and per item the range of its largest piece there."""
    seg = a.segments[si]
    spans: Spans = {}
    named: dict[int, tuple[int, int]] = {}
    adopted_in: dict[int, list[tuple[int, int]]] = {}
    for b in a.segment_blocks(si):
        if not b.active:
            spans.setdefault("free", []).append((float(b.address - seg.address), float(b.size)))
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
                spans.setdefault(colour, []).append((float(s - seg.address), float(e - s)))
            lo, hi = named.get(p.item, (p.address, p.address))
            if p.nbytes > hi - lo:
                named[p.item] = (p.address, p.address + p.nbytes)
    return spans, named


def _segments_view(ax: Axes, a: MemoryAttribution, title: str, plan: Sequence[_Row],
                   shown: str, rows: int, scale: _Scale, mpl: Matplotlib, *,
                   multi: bool) -> None:
    for i, row in enumerate(plan):
        _draw_row(ax, row, float(rows - 1 - i), scale)
    ax.set_xlim(0.0, scale.span)
    ax.set_ylim(-0.6, rows - 0.4)
    ax.set_yticks([float(rows - 1 - i) for i in range(len(plan))], [r.label for r in plan],
                  fontsize=7)
    xt = _ticks(scale.span)
    ax.set_xticks(xt, [fmt_bytes(int(t)) for t in xt], fontsize=7)
    totals = {t.kind: t for t in a.totals}
    same = ", the same scale in every column" if multi else ""
    ax.set_title(
        f"{title}\nactive {fmt_bytes(a.active_bytes)}: pool {fmt_bytes(totals['pool'].nbytes)}"
        f" | STALE {fmt_bytes(totals['stale'].nbytes)} in {len(a.stale)} | tensor "
        f"{fmt_bytes(totals['tensor'].nbytes)} | unattributed "
        f"{fmt_bytes(totals['unattributed'].nbytes)}\n{shown} ({a.source}), one row each; "
        f"bar length = bytes{same}", fontsize=9, loc="left")
    handles = [mpl.patch(facecolor=COLOURS[k], label=text) for k, text in LEGEND]
    ax.legend(handles=handles, loc="upper center",
              bbox_to_anchor=(0.5, -0.3 / (ROW_INCHES * rows)), ncol=3, fontsize=7,
              frameon=False)


def _pick_pool(a: MemoryAttribution, name: str | None) -> PoolEntry | None:
    if name is not None:
        return a.manifest.pool(name)
    pools = sorted(a.manifest.pools, key=lambda p: -p.capacity)
    return pools[0] if pools else None


def _pool_view(ax: Axes, p: PoolEntry, column: str | None, scale: _Scale,
               mpl: Matplotlib) -> None:
    ax.set_yticks([], [])
    dtypes = sorted({s.dtype for s in p.slices})
    colour = {d: DTYPE_COLOURS[i % len(DTYPE_COLOURS)] for i, d in enumerate(dtypes)}
    gaps = p.gaps()
    for g in gaps:
        if g.kind == "padding":
            ax.broken_barh([(g.offset, g.nbytes)], (0.1, 0.8), facecolors=PADDING,
                           edgecolor="#7F7F7F", hatch="////", linewidth=0.3, gid="padding")
        else:
            ax.broken_barh([(g.offset, g.nbytes)], (0.1, 0.8), facecolors=COLOURS["free"],
                           edgecolor="white", linewidth=0.6, gid="free")
    above: list[tuple[float, str]] = []
    for s in p.slices:
        _bar(ax, [(float(s.offset), float(s.nbytes))], 0.5, colour[s.dtype],
             f"slice:{s.slice_id}", scale, height=0.8)
        label = s.tensors[0] if s.tensors else f"slice {s.slice_id}"
        text = f"{_short(label, 28)}\n{fmt_bytes(s.nbytes)}"
        size = next((f for f in (7, 6) if scale.fits(_short(label, 28), s.nbytes, f)), None)
        if size is not None:
            ax.text(s.offset + s.nbytes / 2, 0.5, text, ha="center", va="center",
                    fontsize=size, color="black", gid="label")
        else:
            shown = max(float(s.nbytes), scale.shortest())
            above.append((s.offset + shown / 2, f"{_short(label, 24)} {fmt_bytes(s.nbytes)}"))
    unlabelled = _label_above(ax, above, scale)
    ax.set_xlim(0.0, float(p.capacity))
    ax.set_ylim(0.0, 1.75)
    xt = _ticks(float(p.capacity))
    ax.set_xticks(xt, [fmt_bytes(int(t)) for t in xt], fontsize=7)
    padding = sum(g.nbytes for g in gaps if g.kind == "padding")
    free = [g for g in gaps if g.kind == "free"]
    where = f"{column}: " if column else ""
    more = f" ({unlabelled} small slice(s) not named)" if unlabelled else ""
    ax.set_title(
        f"{where}layout of pool {p.name!r} on {p.device}: capacity {fmt_bytes(p.capacity)}, "
        f"alignment {p.alignment} B\n{len(p.slices)} slice(s) holding "
        f"{fmt_bytes(p.used_bytes)} ({fmt_bytes(p.adopted_bytes)} adopted), padding "
        f"{fmt_bytes(padding)}, free {fmt_bytes(sum(g.nbytes for g in free))} in "
        f"{len(free)} range(s)\nbar length = bytes{more}", fontsize=9, loc="left")
    handles = [mpl.patch(facecolor=colour[d], label=d) for d in dtypes]
    handles.append(mpl.patch(facecolor=PADDING, edgecolor="#7F7F7F", hatch="////",
                             label="alignment padding"))
    handles.append(mpl.patch(facecolor=COLOURS["free"], label="free range"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.22),
              ncol=len(handles), fontsize=7, frameon=False)


def _label_above(ax: Axes, labels: Sequence[tuple[float, str]], scale: _Scale) -> int:
    """Name small slices above the bar on two staggered levels; returns how many found no room."""
    level_end = [0.0, 0.0]
    levels = (1.1, 1.4)
    placed = 0
    for x, text in sorted(labels)[:_SMALL_LABELS]:
        w = scale.text_bytes(text, 6)
        spots = []
        for i in range(2):
            left = min(max(x - w / 2, level_end[i], 0.0), scale.span - w)
            if left >= level_end[i]:
                spots.append((abs(left + w / 2 - x), i, left))
        if not spots:
            continue
        _, best, left = min(spots)
        level_end[best] = left + w
        y = levels[best]
        ax.plot([x, left + w / 2], [0.9, y - 0.06], color="#555555", linewidth=0.5)
        ax.text(left + w / 2, y, text, ha="center", va="bottom", fontsize=6, color="black",
                gid="label")
        placed += 1
    return len(labels) - placed


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else "..." + text[-(limit - 3):]
