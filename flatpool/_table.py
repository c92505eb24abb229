"""The project's one table renderer: aligned plain-text columns, or a markdown table.

Every text table flatpool prints (``FlatPool.describe()``, ``Census.render()``, the memory
report, the demos' per-rank tables, the benchmark report) goes through :func:`table`, so they
align, justify and end their lines the same way.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from .errors import InvalidRequestError


def table(
    rows: Sequence[Sequence[str]],
    *,
    head: Sequence[str] | None = None,
    right: Collection[int] = (),
    rule: bool = False,
    indent: str = "",
    markdown: bool = False,
) -> list[str]:
    """The lines of a table of ``rows`` (each as many cells as ``head``, or as the first row).

    Columns are two spaces apart, padded to their widest cell: left-justified, or right for
    the column indices in ``right``; lines carry no trailing spaces. ``rule`` draws dashes
    under ``head``; ``indent`` starts every line. ``markdown`` gives a GitHub table instead
    (``head`` required; ``right``, ``rule`` and ``indent`` do not apply).
    """
    body = [tuple(r) for r in rows]
    if markdown:
        if head is None:
            raise InvalidRequestError("a markdown table needs a head: pass head=(...)")
        return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                *("| " + " | ".join(r) + " |" for r in body)]
    every = ([tuple(head)] if head is not None else []) + body
    if not every:
        return []
    widths = [max(len(r[i]) for r in every) for i in range(len(every[0]))]

    def line(cells: Sequence[str]) -> str:
        return (indent + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                                   for i, (c, w) in enumerate(zip(cells, widths)))).rstrip()

    out = [line(r) for r in every]
    if head is not None and rule:
        out.insert(1, indent + "  ".join("-" * w for w in widths))
    return out
