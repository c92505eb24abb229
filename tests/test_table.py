"""The one table renderer (flatpool._table) and the reports built on it: columns align, numbers
right-justify where asked, no line ends in spaces, markdown has its head; every table the
project prints comes from it (no module measures column widths itself)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from flatpool import FlatPool, census
from flatpool._table import table
from flatpool.errors import InvalidRequestError
from examples.table import render as rank_table

ROOT = Path(__file__).resolve().parent.parent


def test_columns_align_and_right_justify() -> None:
    lines = table([("a", "1"), ("bbb", "22")], head=("name", "n"), right=(1,), rule=True,
                  indent="  ")
    assert lines == ["  name   n", "  ----  --", "  a      1", "  bbb   22"]
    assert table([("x", ""), ("yy", "z")]) == ["x", "yy  z"]  # no trailing spaces
    assert table([]) == []


def test_markdown_needs_a_head() -> None:
    assert table([("a", "b")], head=("x", "y"), markdown=True) == [
        "| x | y |", "|---|---|", "| a | b |"]
    with pytest.raises(InvalidRequestError, match="head"):
        table([("a",)], markdown=True)


def test_every_report_aligns_the_same_way() -> None:
    pool = FlatPool("cpu", capacity=4096, name="p")
    w = torch.nn.Parameter(torch.randn(8, 4))
    pool.adopt(w)
    texts = [pool.describe(), census({"w": w}, pools=[pool]).render(),
             rank_table(0, [("mode a", "1", "2 MiB", "0 MiB", "-", "identical", "ok")])]
    for text in texts:
        assert all(line == line.rstrip() for line in text.splitlines()), text
    rows = rank_table(3, [("x", "1", "2", "3", "4", "5", "6")]).splitlines()
    assert rows[0] == "rank 3:" and set(rows[2].replace(" ", "")) == {"-"}
    assert [rows[1].index("live shard"), rows[3].index("1")] == [rows[1].index("live shard")] * 2


def test_no_module_measures_its_own_column_widths() -> None:
    """The hand-written renderers (memory, hsdp, census, describe, benchmarks) are gone."""
    pattern = re.compile(r"max\(len\(\w+\[i\]\)")
    offenders = [str(p.relative_to(ROOT)) for d in ("flatpool", "integrations", "benchmarks")
                 for p in (ROOT / d).rglob("*.py")
                 if p.name != "_table.py" and pattern.search(p.read_text())]
    assert offenders == []
