"""A reference the user holds never breaks a HyperParallel step (issue 17), with the docs' lines.

Scenarios: tests/integrations/hp_neverbreak_workers.py, run in the shared 2-rank HyperParallel
job (``hp_job``). Each compares the fused unit with the same unit without a flat buffer.
"""

from __future__ import annotations

from typing import Any

import pytest

import hp_neverbreak_workers as workers
from hp_jobs import trained_like_reference

NAMES = [f"{shape}/{kind}/{ranks}" for shape in workers.SHAPES for kind in workers.KINDS
         for ranks in ("all", "rank0")]


@pytest.mark.parametrize("name", NAMES)
def test_held_reference_trains_like_no_fusion(hp_job: list[dict[str, Any]], name: str) -> None:
    for rank, res in trained_like_reference(hp_job, "neverbreak", name):
        fused = res["fused"]
        assert fused["flat"] == [1, 1, 1], f"rank {rank}: no flat buffer at some step"
        assert fused["valid"] is True
        kept_before_drop, kept_at_end = fused["kept"]
        assert len(fused["warnings"]) == kept_before_drop, fused["warnings"]  # one per original
        if res["holds"] and name.split("/")[1] != "to_local":
            assert kept_before_drop >= 1, f"rank {rank}: the held original was not reported"
        if not res["holds"]:
            assert kept_before_drop == 0 and not fused["warnings"]
        for text in fused["warnings"]:
            assert "bytes of the original shard storage kept alive, held by: " in text, text
            assert "list[" in text or "dict['" in text, text  # the caller's container
        assert kept_at_end == 0, f"rank {rank}: still reported after the reference was dropped"
        assert fused["originals_alive"] == 0, f"rank {rank}: an original outlived the drop"
