"""``fuse_fully_sharded`` holds one gc pause over the whole fusion (docs/performance.md, "Fusion:
lighter pools, one gc pause"): the records it makes per group, before and while adopting, set
off no automatic collection, which would scan the model's whole heap."""

from __future__ import annotations

import gc
from typing import Any

from torch import nn
from torch.distributed.fsdp import fully_shard

from flatpool.integrations.hsdp.fsdp2 import fuse_fully_sharded, lazy_init


def _collections_during_fusion(groups: int, mesh: Any) -> int:
    """How many collections start inside ``fuse_fully_sharded`` of ``groups`` one-Linear
    groups, with a pass due every other tracked allocation whenever the gc is not paused."""
    model = nn.Module()
    model.leaves = nn.ModuleList([nn.Linear(4, 4) for _ in range(groups)])
    for leaf in model.leaves:
        fully_shard(leaf, mesh=mesh)
    fully_shard(model, mesh=mesh)
    lazy_init(model)
    started: list[int] = []

    def note(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(info["generation"])

    saved = gc.get_threshold()
    gc.set_threshold(1, *saved[1:])
    gc.callbacks.append(note)
    try:
        fused = fuse_fully_sharded(model, keep_valid=False)
    finally:
        gc.callbacks.remove(note)
        gc.set_threshold(*saved)
    # One group a Linear (the root holds no parameter). On one rank each is skipped (nothing
    # is all-gathered), but the layer makes its records for every group all the same.
    assert len(fused.groups) == groups
    assert all(b.skipped is not None and b.skipped.startswith("shard world size is 1")
               for b in fused.buffers)
    return len(started)


def test_a_fusion_sets_off_no_collection_per_group(single_rank_mesh: Any) -> None:
    few = _collections_during_fusion(20, single_rank_mesh)
    many = _collections_during_fusion(200, single_rank_mesh)
    # What is left runs outside the pause, the same for any number of groups (taking and
    # letting go of the signal guard around it); before the pause covered the whole fusion,
    # the records made ahead of it set off one pass every other allocation: ~13 a group.
    assert many <= few + 5, f"{few} collections for 20 groups, {many} for 200"
