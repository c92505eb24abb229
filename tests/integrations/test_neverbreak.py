"""A training loop that runs on plain FSDP2 runs unchanged with the fusion layer (issue 17).

All scenarios (tests/integrations/neverbreak_workers.py) run in one spawned 2-rank gloo job;
each test reports its own scenario on both ranks.
"""

from __future__ import annotations

import time

import pytest

from examples.launch import launch

import neverbreak_workers

APPLY = [f"apply-{how}-{op}" for how in ("eager", "meta") for op in neverbreak_workers.APPLY]
HELD = [f"held-{k}-{r}" for k in neverbreak_workers.HELD for r in ("all", "rank0")]
RANKFAIL = [f"rankfail-{how}-{r}" for how in ("eager", "eager_lazy") for r in ("all", "rank0")]
OTHER = ["pytorch-to_float64_after_init", "strict-raises", "reprs"]


@pytest.fixture(scope="module")
def results() -> list[dict[str, str | None]]:
    t0 = time.perf_counter()
    out = launch(neverbreak_workers.run_all, world_size=2, timeout_s=600)  # a loaded CI box
    print(f"2-rank job: {time.perf_counter() - t0:.1f} s")
    return out


def test_every_scenario_ran(results: list[dict[str, str | None]]) -> None:
    for per_rank in results:
        assert sorted(per_rank) == sorted(APPLY + HELD + RANKFAIL + OTHER)


@pytest.mark.parametrize("name", APPLY + HELD + RANKFAIL + OTHER)
def test_scenario(results: list[dict[str, str | None]], name: str) -> None:
    failures = {rank: r[name] for rank, r in enumerate(results) if r.get(name)}
    assert not failures, "\n".join(f"rank {k}:\n{v}" for k, v in failures.items())
