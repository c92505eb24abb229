"""The flat-optimizer demo (2 gloo ranks): per kind of tensor, what pooling saves, and
identical losses (issue 32.7: the table said neither what it counted nor that gradients were
pooled)."""

from __future__ import annotations

import re

import pytest

from examples import optim_demo

CELL = r"(\d+) (storages|pools)(?: \((\d+) pools\))?, ([\d.]+ (?:B|KiB|MiB))"


def _cells(line: str) -> list[tuple[int, str, str]]:
    """(count, "storages"/"pools", bytes) of the three trainings' cells of a table line."""
    cells = [(int(n), what, nbytes) for n, what, _, nbytes in re.findall(CELL, line)]
    return cells[:3]  # the three trainings; the last column says what pooling saves


def test_demo_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert optim_demo.main(["--layers", "4", "--hidden", "16", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    params, groups = 8, 4  # 4 Linear layers with biases, one fully_shard group each
    for rank in (0, 1):
        start = out.index(f"rank {rank}: {params} parameters in {groups} fully_shard groups")
        table = out[start:].split("\n\n")[0]
        head = table.splitlines()[1].split()
        assert head[:7] == ["kind", "no", "pools", "parameters", "pooled", "all", "pooled"]
        line = {name: next(row for row in table.splitlines() if row.startswith(f"  {name}  "))
                for name in ("parameters", "gradients", "optimizer state", "total", "losses")}
        # no pools / parameters pooled / all pooled: distinct storages, and which are pools
        assert [c[:2] for c in _cells(line["parameters"])] == [
            (params, "storages"), (groups, "pools"), (groups, "pools")]
        assert [c[:2] for c in _cells(line["gradients"])] == [
            (groups, "storages"), (groups, "storages"), (groups, "pools")]
        assert [c[:2] for c in _cells(line["optimizer state"])] == [
            (3 * params, "storages"), (3 * params, "storages"), (3 * groups, "pools")]
        assert len({c[2] for c in _cells(line["parameters"])}) == 1  # the same bytes
        assert line["parameters"].rstrip().endswith(f"{params - groups} of {params} storages, "
                                                    "same bytes")
        assert f"0 of {groups} storages, same bytes" in line["gradients"]
        assert f"{3 * params - 3 * groups} of {3 * params} storages" in line["optimizer state"]
        assert re.search(r"-\s+identical\s+identical\s+bit-identical training$", line["losses"])
    assert out.count("Each cell: the distinct storages (memory allocations)") == 1
    assert "the gradient pool stays" in out and "DIFFER" not in out
