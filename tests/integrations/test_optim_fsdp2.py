"""2-rank gloo: flat optimizer steps over FSDP2's fused groups vs torch's foreach step
(20 AdamW steps, clipping, 2-step accumulation), storage counts, DCP save + resume."""

from __future__ import annotations

import pytest

from flatpool.integrations.hsdp.launch import launch

SCENARIOS = ["fsdp2-flat-vs-foreach", "fsdp2-dcp-resume"]


@pytest.fixture(scope="module")
def results() -> list[dict[str, str | None]]:
    import optim_workers

    return launch(optim_workers.run_all, world_size=2, timeout_s=300)


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario(results: list[dict[str, str | None]], name: str) -> None:
    outcomes = [r.get(name) for r in results]
    assert outcomes == [None, None], "\n".join(o or "" for o in outcomes)
