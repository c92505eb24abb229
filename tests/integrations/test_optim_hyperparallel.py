"""2-rank gloo: flat optimizer steps in the HyperParallel simulation (both group shapes) are
bit-identical to per-parameter foreach AdamW, with no per-parameter gradient or state storage."""

from __future__ import annotations

import pytest

from examples.launch import launch

NAMES = ["v1-even", "bucketed-padded"]


@pytest.fixture(scope="module")
def results() -> list[dict[str, str | None]]:
    import optim_hp_workers

    return launch(optim_hp_workers.run_all, world_size=2, timeout_s=300)


@pytest.mark.parametrize("name", NAMES)
def test_hyperparallel_sim(results: list[dict[str, str | None]], name: str) -> None:
    outcomes = [r.get(name) for r in results]
    assert outcomes == [None, None], "\n".join(o or "" for o in outcomes)
