"""Attribution over real CPU storages: snapshots built from real tensors' addresses, and the
census record (``cpu_snapshot``) that stands in for an allocator on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from flatpool import AdoptSpec, FlatPool
from flatpool.memory import (
    WatchedStorages,
    attribute,
    build_manifest,
    capture,
    cpu_snapshot,
    load_snapshot,
)
from memory_snapshots import blk, seg, snapshot


def address(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def test_real_storages_laid_out_in_one_arena() -> None:
    """Storages at addresses we choose (torch.from_numpy over slices of one numpy arena): a
    block holding two of them plus slack, a pending-free block, inactive gaps around them."""
    arena = np.zeros(64 * 1024, dtype=np.uint8)
    base = int(arena.ctypes.data)
    t1 = torch.from_numpy(arena[4096:8192])     # 4 KiB storage at base + 4096
    t2 = torch.from_numpy(arena[8192:10240])    # 2 KiB storage at base + 8192
    assert (address(t1), address(t2)) == (base + 4096, base + 8192)
    m = build_manifest({"t1": t1, "t2": t2}, pools=[])
    snap = {"segments": [seg(base, 64 * 1024, [
        blk(base, 4096, "inactive"),
        blk(base + 4096, 8192),                          # t1, t2 and 2 KiB of slack
        blk(base + 12288, 4096, "active_pending_free"),  # nothing known: unattributed
        blk(base + 16384, 48 * 1024, "inactive"),
    ], device=None)], "flatpool_source": "cpu census"}
    a = attribute(snap, manifest=m)
    assert [b.kind for b in a.blocks] == [None, "tensor", "unattributed", None]
    items = {i.label: i for i in a.items}
    assert (items["t1"].attributed_bytes, items["t2"].attributed_bytes) == (4096 + 2048, 2048)
    assert a.bytes_of("tensor") == 8192 and a.bytes_of("unattributed") == 4096
    assert sum(t.nbytes for t in a.totals) == a.active_bytes == 12288


def test_a_real_storage_split_across_two_segments_is_one_item() -> None:
    t = torch.empty(4096, dtype=torch.uint8)
    start = address(t)
    snap = {"segments": [
        seg(start, 1000, [blk(start, 1000)], device=None),
        seg(start + 1000, 3096, [blk(start + 1000, 3096)], device=None),
    ], "flatpool_source": "cpu census"}
    a = attribute(snap, {"t": t}, pools=[])
    (item,) = a.items
    assert (item.label, item.kind, item.blocks, item.attributed_bytes) == ("t", "tensor", 2, 4096)


def test_the_census_record_has_one_segment_per_live_storage() -> None:
    pool = FlatPool("cpu", capacity=4096, name="bucket")
    pool.materialize()
    t = torch.randn(100)
    view = t[10:20]
    m = build_manifest({"t": t, "view": view}, pools=[pool])
    snap = load_snapshot(cpu_snapshot(m, scan=False))
    assert snap.source == "cpu census"
    assert sorted((s.address, s.total_size) for s in snap.segments) == sorted(
        [(address(t), 400), (pool.storage.data_ptr(), 4096)])
    assert all(len(s.blocks) == 1 and s.blocks[0].state == "active_allocated"
               for s in snap.segments)


def naive_case() -> tuple[nn.Module, FlatPool, WatchedStorages]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    pool = FlatPool("cpu", capacity=1 << 15, name="bucket")
    watch = WatchedStorages(dict(model.named_parameters()))
    for p in model.parameters():
        pool.allocate(tuple(p.shape), p.dtype).tensor().copy_(p.detach())
    return model, pool, watch


def test_naive_copy_then_adoption_on_cpu() -> None:
    model, pool, watch = naive_case()
    orphan = torch.empty(12345, dtype=torch.uint8)  # reachable from no root
    before = capture(roots={"model": model}, pools=[pool], watch=watch)
    stale = {i.label: (i.attributed_bytes, i.referrers) for i in before.stale}
    assert stale == {
        "0.weight": (64 * 32 * 4, ("model.0.weight",)), "0.bias": (64 * 4, ("model.0.bias",)),
        "2.weight": (16 * 64 * 4, ("model.2.weight",)), "2.bias": (16 * 4, ("model.2.bias",)),
    }
    (pool_item,) = before.items_of("pool")
    assert (pool_item.label, pool_item.attributed_bytes) == ("bucket", 1 << 15)
    lost = [i for i in before.items_of("unattributed") if i.address == address(orphan)]
    assert [i.attributed_bytes for i in lost] == [12345]
    assert sum(t.nbytes for t in before.totals) == before.active_bytes

    specs = [AdoptSpec(p, slice=s) for p, s in zip(model.parameters(), pool.slices())]
    assert pool.adopt(specs).all_released
    after = capture(roots={"model": model}, pools=[pool], watch=watch)
    assert after.stale == () and after.bytes_of("stale") == 0
    assert after.manifest.pools[0].adopted_bytes == sum(
        p.numel() * 4 for p in model.parameters())
    assert [b.kind for b in after.blocks if b.address == pool.storage.data_ptr()] == ["pool"]
    assert sum(t.nbytes for t in after.totals) == after.active_bytes


def test_census_stale_copies_without_a_watch_list() -> None:
    model, pool, _ = naive_case()
    a = capture(roots=model, pools=[pool], scan=False)
    assert sorted((i.label, i.reason) for i in a.stale) == [
        ("0.bias", "copy of bucket:1"), ("0.weight", "copy of bucket:0"),
        ("2.bias", "copy of bucket:3"), ("2.weight", "copy of bucket:2")]
    assert a.bytes_of("unattributed") == 0  # scan=False: only what the manifest names


@pytest.mark.parametrize("scan", [False, True])
def test_flat_buffers_count_as_pool_memory(scan: bool) -> None:
    flat = torch.zeros(1 << 12)
    a = capture(roots={"w": flat[:10]}, flats=[flat], pools=[], scan=scan)
    (item,) = a.items_of("pool")
    assert (item.label, item.reason, item.attributed_bytes) == (
        "flat[0]", "flat buffer (not a flatpool pool)", 1 << 14)
    assert item.referrers == ("w",)
