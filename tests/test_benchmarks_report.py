"""The benchmark report says what its numbers are: each ratio's kind is printed beside it and
explained under the table, figures say how they were measured, and a quick run says it judged
no target instead of "0 PASS, 0 MISS"."""

from __future__ import annotations

import pytest

from benchmarks import run


def test_quick_run_labels_its_ratios_and_judges_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert run.main(["--quick", "--only", "census", "--only", "validity"]) == 0
    out = capsys.readouterr().out
    assert "0 PASS, 0 MISS" not in out and "PASS" not in out and "MISS" not in out
    assert "quick run: targets not judged (2 of 4 results have one" in out
    assert "measured as" in out and "ratio is" in out
    assert "ratio 'per-round': median over the rounds of figure / baseline" in out
    table = out[out.index("benchmark  case"):]
    census_row = next(line for line in table.splitlines() if line.startswith("census "))
    assert "median of 2 rounds" in census_row and "per-round" in census_row
    assert census_row.rstrip().endswith("not judged")
    # the streamed line says it too
    assert "census(model, Adam), 1000 params" in out and "(per-round)" in out
