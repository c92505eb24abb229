"""Attribution of hand-written snapshots of odd shapes against hand-written manifests.

Every expected number below is written out by hand from the layout, not computed by the code
under test: block classes, per-item bytes, per-class totals, and that the totals add up to the
snapshot's active bytes.
"""

from __future__ import annotations

import pytest

from flatpool import InvalidRequestError
from flatpool.memory import (
    Manifest,
    OriginalEntry,
    PoolEntry,
    SliceEntry,
    StorageEntry,
    attribute,
    attribute_manifest,
    load_snapshot,
)
from memory_snapshots import blk, seg, snapshot

K = 1024

POOL = PoolEntry("bucket", "cuda:0", 0x10000, 16 * K, 512, (
    SliceEntry(0, 0, 8 * K, "float32", (2048,), 512, ("model.w",)),
    SliceEntry(1, 8 * K, 4 * K, "bfloat16", (2048,), 512, ()),
))
MANIFEST = Manifest(
    pools=(POOL,),
    flats=(StorageEntry("flat[0]", "cuda:0", 0x60000, 4 * K, (), ("flat buffer",)),),
    tensors=(
        StorageEntry("model.big", "cuda:0", 0x20000, 12 * K, ("model.big",), ("parameter",)),
        StorageEntry("model.layer.weight", "cuda:0", 0x30000, 4 * K, ("model.layer.weight",),
                     ("parameter",)),
        StorageEntry("x", "cuda:0", 0x50000, 0x400, ("x",), ("tensor",)),
        StorageEntry("y", "cuda:0", 0x50400, 0x300, ("y",), ("tensor",)),
        StorageEntry("copy", "cuda:0", 0x70000, 8 * K, ("copy",), ("parameter",), "bucket:0"),
        StorageEntry("z", "cuda:0", 0x80000, 0x100, ("z",), ("buffer",)),
        StorageEntry("other.gpu", "cuda:1", 0x90000, 0x1000, ("other.gpu",), ("tensor",)),
    ),
    originals=(OriginalEntry("old.w", 0x30000, 4 * K, None, "watch", "cuda:0"),),
)
SNAPSHOT = snapshot(
    # a pool spanning a whole segment
    seg(0x10000, 16 * K, [blk(0x10000, 16 * K)]),
    # one storage (model.big) split across two segments; the last block is unknown
    seg(0x1F000, 8 * K, [blk(0x1F000, 4 * K, "inactive"), blk(0x20000, 4 * K)]),
    seg(0x21000, 12 * K, [blk(0x21000, 8 * K), blk(0x23000, 4 * K)]),
    # a watched original (and a parameter still on it), rounded up by 512 B
    seg(0x30000, 8 * K, [blk(0x30000, 0x1200, requested=4 * K), blk(0x31200, 0xE00, "inactive")]),
    # a block freed but still used by a stream
    seg(0x40000, 4 * K, [blk(0x40000, 0x800, "active_pending_free"),
                         blk(0x40800, 0x800, "inactive")]),
    # two storages in one block, 0x100 B of slack
    seg(0x50000, 4 * K, [blk(0x50000, 0x800), blk(0x50800, 0x800, "inactive")]),
    # a block reaching past a flat buffer on both sides
    seg(0x5F000, 16 * K, [blk(0x5F000, 0xF00, "inactive"), blk(0x5FF00, 0x1200),
                          blk(0x61100, 0x1F00, "inactive")]),
    # a stale copy of bucket:0 (census's rule), and a tensor whose block is already free
    seg(0x70000, 8 * K, [blk(0x70000, 8 * K)]),
    seg(0x80000, 4 * K, [blk(0x80000, 0x200, "inactive"), blk(0x80200, 0xE00, "inactive")]),
    # device 1: a block at an address a device-0 object would match must not match it
    seg(0x90000, 4 * K, [blk(0x90000, 0x1000)], device=1),
)


def classes(a: object) -> dict[int, str | None]:
    from flatpool.memory import MemoryAttribution

    assert isinstance(a, MemoryAttribution)
    return {b.address: b.kind for b in a.blocks}


def test_every_block_of_odd_shapes_gets_its_class() -> None:
    a = attribute(SNAPSHOT, manifest=MANIFEST)
    assert classes(a) == {
        0x10000: "pool",
        0x1F000: None, 0x20000: "tensor",
        0x21000: "tensor", 0x23000: "unattributed",
        0x30000: "stale", 0x31200: None,
        0x40000: "unattributed", 0x40800: None,
        0x50000: "tensor", 0x50800: None,
        0x5F000: None, 0x5FF00: "pool", 0x61100: None,
        0x70000: "stale",
        0x80000: None, 0x80200: None,
        0x90000: "tensor",
    }


def test_per_class_bytes_add_up_to_active_bytes() -> None:
    a = attribute(SNAPSHOT, manifest=MANIFEST)
    active = (16 * K + 4 * K + 8 * K + 4 * K + 0x1200 + 0x800 + 0x800 + 0x1200 + 8 * K + 0x1000)
    assert a.active_bytes == active
    assert {t.kind: (t.blocks, t.nbytes) for t in a.totals} == {
        "pool": (2, 16 * K + 0x1200),
        "tensor": (4, 12 * K + 0x800 + 0x1000),
        "stale": (2, 0x1200 + 8 * K),
        "unattributed": (2, 4 * K + 0x800),
    }
    assert sum(t.nbytes for t in a.totals) == a.active_bytes
    for b in a.blocks:  # pieces tile each active block exactly, in order
        if b.active:
            assert sum(p.nbytes for p in b.pieces) == b.size
            assert b.pieces[0].address == b.address
            for p, q in zip(b.pieces, b.pieces[1:]):
                assert p.address + p.nbytes == q.address
        else:
            assert b.pieces == ()


def test_items_name_what_holds_the_bytes() -> None:
    a = attribute(SNAPSHOT, manifest=MANIFEST)
    by_label = {i.label: i for i in a.items}
    assert by_label["bucket"].attributed_bytes == 16 * K and by_label["bucket"].pool == POOL
    big = by_label["model.big"]
    assert (big.kind, big.blocks, big.attributed_bytes) == ("tensor", 2, 12 * K)
    old = by_label["old.w"]  # the stale original wins over the parameter still on it
    assert (old.kind, old.attributed_bytes, old.reason) == (
        "stale", 0x1200, "watched original, still alive")
    assert old.referrers == ("model.layer.weight",)
    assert "model.layer.weight" not in by_label
    assert (by_label["x"].attributed_bytes, by_label["y"].attributed_bytes) == (0x500, 0x300)
    assert by_label["flat[0]"].kind == "pool" and by_label["flat[0]"].attributed_bytes == 0x1200
    assert by_label["copy"].reason == "copy of bucket:0"
    assert by_label["z"].attributed_bytes == 0
    assert any("'z'" in n and "no active block" in n for n in a.notes)
    assert by_label["other.gpu"].attributed_bytes == 0x1000  # on device 1, where it lives
    unknown = {i.address: i for i in a.items_of("unattributed")}
    assert sorted(unknown) == [0x23000, 0x40000]
    assert unknown[0x40000].reason == "pending free"


def test_slack_and_the_split_block() -> None:
    a = attribute(SNAPSHOT, manifest=MANIFEST)
    block = next(b for b in a.blocks if b.address == 0x50000)
    labels = [(a.items[p.item].label, p.address, p.nbytes, p.slack) for p in block.pieces]
    assert labels == [("x", 0x50000, 0x400, False), ("y", 0x50400, 0x300, False),
                      ("x", 0x50700, 0x100, True)]
    flat = next(b for b in a.blocks if b.address == 0x5FF00)
    assert [(p.address, p.nbytes, p.slack) for p in flat.pieces] == [
        (0x5FF00, 0x100, True), (0x60000, 0x1000, False), (0x61000, 0x100, True)]


def test_device_index_keeps_objects_on_their_device() -> None:
    # the same address on device 0 is not other.gpu's (it lives on cuda:1)
    snap = snapshot(seg(0x90000, 4 * K, [blk(0x90000, 0x1000)], device=0))
    a = attribute(snap, manifest=MANIFEST)
    assert [b.kind for b in a.blocks] == ["unattributed"]


def test_cpu_objects_never_match_a_device_snapshot() -> None:
    m = Manifest(tensors=(StorageEntry("cpu.t", "cpu", 0x1000, 0x100, ("cpu.t",)),))
    a = attribute(snapshot(seg(0x1000, 0x100, [blk(0x1000, 0x100)])), manifest=m)
    assert [b.kind for b in a.blocks] == ["unattributed"]


def test_blocks_without_addresses_tile_their_segment() -> None:
    # older snapshots give no block address: blocks follow each other from the segment start
    snap = {"segments": [seg(0x10000, 16 * K, [blk(None, 4 * K, "inactive"), blk(None, 12 * K)])]}
    m = Manifest(pools=(PoolEntry("p", "cuda:0", 0x11000, 12 * K, 512),))
    a = attribute(snap, manifest=m)
    assert [(b.address, b.kind) for b in a.blocks] == [(0x10000, None), (0x11000, "pool")]
    assert a.bytes_of("pool") == a.active_bytes == 12 * K


def test_a_bare_segment_list_is_a_snapshot() -> None:
    segments = [seg(0x10000, 16 * K, [blk(0x10000, 16 * K)])]
    a = attribute(segments, manifest=Manifest(pools=(POOL,)))
    assert a.bytes_of("pool") == 16 * K


def test_no_manifest_leaves_everything_unattributed() -> None:
    a = attribute_manifest(load_snapshot(SNAPSHOT), Manifest())
    assert a.bytes_of("unattributed") == a.active_bytes
    assert {b.kind for b in a.blocks if b.active} == {"unattributed"}


def test_manifest_and_live_roots_are_exclusive() -> None:
    with pytest.raises(InvalidRequestError, match="not both"):
        attribute(SNAPSHOT, {"a": 1}, manifest=MANIFEST)


def test_render_lists_classes_items_and_pools() -> None:
    text = attribute(SNAPSHOT, manifest=MANIFEST).render(top=4)
    lines = text.splitlines()
    assert lines[0].startswith("memory attribution (allocator): 10 segment(s), 18 block(s)")
    row = {ln.split()[0]: ln.split() for ln in lines[1:7]}
    assert row["pool"][1:4] == ["2", "20.50", "KiB"] and row["stale"][1] == "2"
    assert row["total"][1] == "10" and text.count("= active bytes") == 1
    assert "largest items (4 of 11):" in text
    assert "STALE" in text and "watched original, still alive; referenced as " \
        "model.layer.weight" in text
    assert "bucket  cuda:0  16 KiB    2       12 KiB     8 KiB" in text
