"""2-rank gloo: flat optimizer steps over FSDP2's fused groups vs torch's foreach step
(20 AdamW steps, clipping, 2-step accumulation), storage counts, DCP save + resume, no_sync
accumulation with the checks in the forward hook, model and optimizer state reloaded mid-training (re-adoption), also after ``to_empty``; torchtitan's build order (the optimizer
before the first forward puts the shards back), an unused group and a frozen layer, gradient
memory released by ``zero_grad()``."""

from __future__ import annotations

import pytest

from examples.launch import launch

SCENARIOS = ["fsdp2-flat-vs-foreach", "fsdp2-dcp-resume", "fsdp2-no_sync-verify_forward",
             "fsdp2-reload-in-place", "fsdp2-to_empty-reload", "fsdp2-torchtitan-order",
             "fsdp2-torchtitan-order-adopt-at-forward", "fsdp2-unused-and-frozen",
             "fsdp2-memory-like-torch", "fsdp2-reduce-scatter-into-pool", "fsdp2-kernel-count",
             "fsdp2-reduce-scatter-after-close", "fsdp2-reduce-scatter-hand-out-fails",
             "fsdp2-gradient-bytes-peak",
             "fsdp2-fallback-reduce_dtype", "fsdp2-fallback-cpu-offload", "fsdp2-fallback-hsdp",
             "fsdp2-fallback-custom-comm", "fsdp2-fallback-no-api"]


@pytest.fixture(scope="module")
def results() -> list[dict[str, str | None]]:
    import optim_workers

    return launch(optim_workers.run_all, world_size=2, timeout_s=300)


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario(results: list[dict[str, str | None]], name: str) -> None:
    outcomes = [r.get(name) for r in results]
    assert outcomes == [None, None], "\n".join(o or "" for o in outcomes)
