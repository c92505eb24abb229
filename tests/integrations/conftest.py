"""Fixtures shared by the integration tests."""

from __future__ import annotations

import time
from typing import Any

import pytest

from flatpool.integrations.hsdp.launch import launch


@pytest.fixture(scope="session")
def hp_job() -> list[dict[str, Any]]:
    """Per rank, the results of the HyperParallel-simulation scenarios (see hp_jobs.py)."""
    import hp_jobs

    t0 = time.perf_counter()
    out = launch(hp_jobs.run_all, world_size=2, timeout_s=400)
    print(f"2-rank HyperParallel job: {time.perf_counter() - t0:.1f} s")
    return out
