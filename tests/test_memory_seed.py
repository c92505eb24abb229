"""The seed case of the bug report, seen through flatpool.memory on 2 real gloo ranks.

Naive rebase: each rank's memory holds the 8 MiB flat buffer *and* two stale 4 MiB original
shard storages (the parameters still use them). After flatpool's ``fuse_fully_sharded``: only
the 8 MiB pool, nothing stale.

Set ``FLATPOOL_MEMORY_PNG=path.png`` to also write rank 0's before/after picture there (the
one in docs/census.md was made so).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from examples.launch import launch
from flatpool.memory import MemoryAttribution, draw_comparison

MiB = 1 << 20


@pytest.fixture(scope="module")
def results() -> list[dict[str, MemoryAttribution]]:
    import memory_workers

    t0 = time.perf_counter()
    out = launch(memory_workers.seed_case, world_size=2, timeout_s=150)
    print(f"2-rank job: {time.perf_counter() - t0:.1f} s")
    return out


def test_naive_rebase_leaves_two_stale_4mib_originals_beside_the_8mib_flat(
        results: list[dict[str, MemoryAttribution]]) -> None:
    for rank, per_rank in enumerate(results):
        a = per_rank["naive rebase"]
        stale = sorted((i.label, i.nbytes, i.attributed_bytes, i.referrers) for i in a.stale)
        assert stale == [
            ("down.weight", 4 * MiB, 4 * MiB, ("model.down.weight",)),
            ("up.weight", 4 * MiB, 4 * MiB, ("model.up.weight",)),
        ], f"rank {rank}"
        assert [b.size for b in a.blocks_of("stale")] == [4 * MiB, 4 * MiB]
        pool_blocks = a.blocks_of("pool")
        assert [b.size for b in pool_blocks] == [8 * MiB], f"rank {rank}"
        (flat,) = a.items_of("pool")
        assert (flat.label, flat.reason) == ("flat[0]", "flat buffer (not a flatpool pool)")
        assert sum(t.nbytes for t in a.totals) == a.active_bytes


def test_flatpool_fusion_leaves_only_the_flat_buffer(
        results: list[dict[str, MemoryAttribution]]) -> None:
    for rank, per_rank in enumerate(results):
        a = per_rank["flatpool"]
        assert a.stale == () and a.bytes_of("stale") == 0, f"rank {rank}"
        assert [b.size for b in a.blocks_of("pool")] == [8 * MiB]
        (pool,) = a.manifest.pools
        assert (pool.capacity, pool.adopted_bytes) == (8 * MiB, 8 * MiB)
        names = {s.slice_id: set(s.tensors) for s in pool.slices}
        assert {"model.up.weight", "fused.groups.0.fsdp_params.0._sharded_param_data"} \
            <= names[0], names[0]
        assert {"model.down.weight", "fused.groups.0.fsdp_params.1._sharded_param_data"} \
            <= names[1], names[1]
        # the parameters live in the pool: no storage of 4 MiB is reachable outside it
        assert [t.label for t in a.manifest.tensors if t.nbytes >= 4 * MiB] == []
        assert sum(t.nbytes for t in a.totals) == a.active_bytes


def test_before_after_picture(results: list[dict[str, MemoryAttribution]],
                              tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rank0 = results[0]
    target = Path(os.environ.get("FLATPOOL_MEMORY_PNG") or tmp_path / "seed.png")
    draw_comparison(target, [("naive rebase (rank 0 of 2)", rank0["naive rebase"]),
                             ("flatpool fuse_fully_sharded (rank 0 of 2)", rank0["flatpool"])],
                    max_segments=8)
    data = target.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 30_000
