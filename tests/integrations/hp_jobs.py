"""One spawned 2-rank gloo job for every HyperParallel-simulation test module.

Spawning two ranks costs seconds (each re-imports torch); the simulation's own tests
(``hp_faithful_workers``), the drop-in lines' tests (``hp_hook_workers``), the held-reference
cases (``hp_neverbreak_workers``) and the rank-local failures (``hp_rankfail_workers``) share
one job, started by the session fixture in this folder's conftest.py.
"""

from __future__ import annotations

from typing import Any


def run_all() -> dict[str, Any]:
    import hp_faithful_workers
    import hp_hook_workers
    import hp_neverbreak_workers
    import hp_rankfail_workers

    return {"faithful": hp_faithful_workers.run_all(), "hook": hp_hook_workers.run_all(),
            "neverbreak": hp_neverbreak_workers.run_all(),
            "rankfail": hp_rankfail_workers.run_all()}


def trained_like_reference(hp_job: list[dict[str, Any]], part: str, name: str,
                           ) -> list[tuple[int, dict[str, Any]]]:
    """Each rank's result of scenario ``name`` of ``part`` (``(rank, result)``), after checking
    it ran and its fused unit trained bit-identically to its reference (losses, digests)."""
    out = []
    for rank, per_rank in enumerate(hp_job):
        res = per_rank[part][name]
        assert res["error"] is None, f"rank {rank}:\n{res['error']}"
        fused, ref = res["fused"], res["reference"]
        assert fused["losses"] == ref["losses"], (rank, fused["losses"], ref["losses"])
        assert fused["digests"] == ref["digests"], f"rank {rank}: trained shards differ"
        out.append((rank, res))
    return out


__all__ = ["run_all", "trained_like_reference"]
