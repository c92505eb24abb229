"""The plain-text report of an attribution (per-class totals, largest items, pools) and the
byte counts of every table and picture, as people read them (``8 MiB``, ``1.50 KiB``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._table import table

if TYPE_CHECKING:
    from ._result import MemoryAttribution

_UNITS = ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


def fmt_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit it reaches (``4 MiB``, not ``4.00 MiB``)."""
    for size, name in _UNITS:
        if abs(n) >= size:
            return f"{n // size} {name}" if n % size == 0 else f"{n / size:.2f} {name}"
    return f"{n} B"


def _bytes(n: int) -> str:
    return f"{fmt_bytes(n)} ({n} B)" if n >= 1024 else f"{n} B"


def render(a: MemoryAttribution, top: int = 10) -> str:
    active = [b for b in a.blocks if b.active]
    lines = [
        f"memory attribution ({a.source}): {len(a.segments)} segment(s), {len(a.blocks)} "
        f"block(s), {len(active)} active; reserved {_bytes(a.reserved_bytes)}, "
        f"active {_bytes(a.active_bytes)}"
    ]
    rows: list[tuple[str, ...]] = [("class", "blocks", "bytes")]
    for t in a.totals:
        rows.append((t.kind, str(t.blocks), _bytes(t.nbytes)))
    total = sum(t.nbytes for t in a.totals)
    check = "= active bytes" if total == a.active_bytes else f"!= active {a.active_bytes} B"
    rows.append(("total", str(len(active)), f"{_bytes(total)} {check}"))
    lines += table(rows, right=(1,))

    ranked = sorted(a.items, key=lambda i: (-i.attributed_bytes, i.address))
    shown = ranked[:top]
    if shown:
        lines.append("")
        lines.append(f"largest items ({len(shown)} of {len(a.items)}):")
        rows = [("class", "bytes", "blocks", "address", "label", "why / referenced as")]
        for i in shown:
            refs = [r for r in i.referrers if r != i.label]
            why = i.reason + (f"; referenced as {', '.join(refs[:3])}"
                              + (f" (+{len(refs) - 3})" if len(refs) > 3 else "") if refs else "")
            rows.append((i.kind.upper() if i.kind == "stale" else i.kind,
                         fmt_bytes(i.attributed_bytes), str(i.blocks), f"{i.address:#x}",
                         i.label, why))
        lines += table(rows, right=(1, 2))

    if a.manifest.pools:
        lines.append("")
        lines.append("pools:")
        rows = [("pool", "device", "capacity", "slices", "in slices", "adopted", "padding",
                 "free (ranges)")]
        for p in a.manifest.pools:
            gaps = p.gaps()
            free = [g for g in gaps if g.kind == "free"]
            rows.append((p.name, p.device, fmt_bytes(p.capacity), str(len(p.slices)),
                         fmt_bytes(p.used_bytes), fmt_bytes(p.adopted_bytes),
                         fmt_bytes(sum(g.nbytes for g in gaps if g.kind == "padding")),
                         f"{fmt_bytes(sum(g.nbytes for g in free))} ({len(free)})"))
        lines += table(rows)
    for note in a.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)
