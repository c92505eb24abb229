"""Fusion failing on one rank never breaks a HyperParallel step: the failing rank trains
unfused, the others fused, with the same collectives; the next step fuses everywhere.

Scenarios: tests/integrations/hp_rankfail_workers.py, run in the shared 2-rank HyperParallel job
(``hp_job``). Each compares the unit with the docs' lines against the same unit without a flat
buffer.
"""

from __future__ import annotations

from typing import Any

import pytest

import hp_rankfail_workers as workers
from hp_jobs import trained_like_reference

NAMES = [f"{shape}/{mode}/{failing}" for shape in workers.SHAPES for mode in workers.MODES
         for failing in workers.FAILING]


@pytest.mark.parametrize("name", NAMES)
def test_a_rank_whose_fusion_fails_trains_like_no_fusion(hp_job: list[dict[str, Any]],
                                                         name: str) -> None:
    for rank, res in trained_like_reference(hp_job, "rankfail", name):
        fused = res["fused"]
        if res["fails_here"]:
            assert fused["raised"] >= 1, f"rank {rank}: the fault never fired"
            assert fused["flat"][0] == 0, f"rank {rank}: fused although every operation failed"
        else:
            assert fused["raised"] == 0 and fused["flat"][0] == 1, (rank, fused)
        assert fused["flat"][1:] == [1] * (workers.STEPS - 1), (rank, fused["flat"])
        assert fused["valid"] is True
