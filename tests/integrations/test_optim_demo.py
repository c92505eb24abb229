"""The flat-optimizer demo (2 gloo ranks): identical losses, fewer state storages."""

from __future__ import annotations

import re

import pytest

from flatpool.integrations.hsdp import optim_demo


def test_demo_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert optim_demo.main(["--layers", "4", "--hidden", "16", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("rank ") == 2
    rows = re.findall(r"^  (per parameter \(foreach=True\)|flat \(flatpool\.optim\))\s+(\d+)\s+"
                      r"(\d+)\s+(\d+)\s+(\d+)\s+(\S+)", out, re.M)
    assert len(rows) == 4, out
    for name, params, pstor, grads, state, verdict in rows:
        groups = int(pstor)  # one parameter pool per (group, dtype): 4 groups here
        assert (int(params), groups) == (8, 4)
        if name.startswith("flat"):
            assert (int(grads), int(state), verdict) == (groups, 3 * groups, "identical")
        else:
            assert int(state) == 3 * int(params)  # exp_avg, exp_avg_sq, step per parameter
