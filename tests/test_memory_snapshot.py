"""Reading allocator snapshots: the real format, its older variants, and every way a snapshot
can be malformed (a typed error naming the field, never a crash further down)."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import pytest

from flatpool import FlatPoolError, InvalidRequestError
from flatpool.memory import SnapshotError, load_snapshot, parse_snapshot
from memory_snapshots import blk, seg, snapshot

GOOD = snapshot(
    seg(0x2000, 0x1000, [blk(0x2000, 0x400), blk(0x2400, 0xC00, "inactive")]),
    seg(0x1000, 0x800, [blk(0x1000, 0x200, "active_pending_free", frames=[
        {"filename": "/x/site-packages/torch/nn/modules/linear.py", "line": 3, "name": "f"},
        {"filename": "/home/me/train.py", "line": 42, "name": "step"}]),
        blk(0x1200, 0x600, "inactive")]),
)


def test_a_good_snapshot_is_typed_and_sorted() -> None:
    s = parse_snapshot(GOOD)
    assert [seg.address for seg in s.segments] == [0x1000, 0x2000]
    assert s.active_bytes == 0x600 and s.reserved_bytes == 0x1800 and s.block_count == 4
    first = s.segments[0].blocks[0]
    assert (first.state, first.active, first.where) == (
        "active_pending_free", True, "train.py:42 (step)")
    assert s.source == "allocator"


def test_a_pickle_written_like_dump_snapshot_loads(tmp_path: Path) -> None:
    path = tmp_path / "snap.pickle"
    with open(path, "wb") as f:
        pickle.dump(GOOD, f)  # what torch.cuda.memory._dump_snapshot() does
    assert load_snapshot(path) == parse_snapshot(GOOD)
    assert load_snapshot(str(path)).active_bytes == 0x600


def broken(path: str, value: Any) -> dict[str, Any]:
    """GOOD with the entry at ``path`` (e.g. ``segments.0.blocks.1.size``) set, or deleted
    when ``value`` is ``...``."""
    out = copy.deepcopy(GOOD)
    *parents, last = path.split(".")
    node: Any = out
    for p in parents:
        node = node[int(p)] if p.isdigit() else node[p]
    key: Any = int(last) if last.isdigit() else last
    if value is ...:
        del node[key]
    else:
        node[key] = value
    return out


@pytest.mark.parametrize("path, value, field, words", [
    ("segments", ..., "segments", "missing"),
    ("segments", "abc", "segments", "expected a list"),
    ("segments.0", 7, "segments[0]", "expected a dict"),
    ("segments.0.address", ..., "segments[0].address", "missing"),
    ("segments.0.address", "0x10", "segments[0].address", "expected an int, got str"),
    ("segments.0.total_size", -1, "segments[0].total_size", "must be >= 0"),
    ("segments.0.total_size", True, "segments[0].total_size", "expected an int, got bool"),
    ("segments.0.blocks", None, "segments[0].blocks", "expected a list, got NoneType"),
    ("segments.0.device", 1.5, "segments[0].device", "expected an int"),
    ("segments.1.blocks.0.size", "4", "segments[1].blocks[0].size", "expected an int"),
    ("segments.1.blocks.0.size", ..., "segments[1].blocks[0].size", "missing"),
    ("segments.1.blocks.0.state", "allocated", "segments[1].blocks[0].state", "expected one of"),
    ("segments.1.blocks.0.state", ..., "segments[1].blocks[0].state", "missing"),
    ("segments.1.blocks.0.address", 0x5000, "segments[1].blocks[0]", "outside its segment"),
    ("segments.1.blocks.0.requested_size", [], "segments[1].blocks[0].requested_size",
     "expected an int"),
    ("segments.1.blocks.0.frames", "train.py", "segments[1].blocks[0].frames", "expected a list"),
    ("segments.1.blocks.1.address", 0x1100, "segments[1].blocks", "overlap"),
    ("segments.1.total_size", 0x1800, "segments", "overlap on one device"),
])
def test_malformed_snapshots_name_the_field(path: str, value: Any, field: str, words: str) -> None:
    data = broken(path, value)
    with pytest.raises(SnapshotError) as info:
        parse_snapshot(data)
    assert info.value.field == field
    assert words in str(info.value) and str(info.value).startswith(field)
    assert isinstance(info.value, InvalidRequestError) and isinstance(info.value, FlatPoolError)


def test_segments_of_two_devices_may_share_addresses() -> None:
    two = snapshot(seg(0x1000, 0x100, [blk(0x1000, 0x100)], device=0),
                   seg(0x1000, 0x100, [blk(0x1000, 0x100)], device=1))
    assert parse_snapshot(two).active_bytes == 0x200


@pytest.mark.parametrize("data", [42, "segments", b"x", None])
def test_something_else_is_not_a_snapshot(data: object) -> None:
    with pytest.raises(SnapshotError, match="expected a snapshot dict"):
        parse_snapshot(data)


def test_a_dict_without_segments_lists_its_keys() -> None:
    with pytest.raises(SnapshotError, match=r"segments: missing.*keys found: a, b"):
        parse_snapshot({"a": 1, "b": 2})


class Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("PWNED-by-a-snapshot",))


def test_pickle_files_that_are_not_snapshots(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                             ) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("this is not a pickle\n")
    with pytest.raises(SnapshotError, match="not a pickled allocator snapshot"):
        load_snapshot(text)
    empty = tmp_path / "empty.pickle"
    empty.write_bytes(b"")
    with pytest.raises(SnapshotError, match="not a pickled allocator snapshot"):
        load_snapshot(empty)
    listing = tmp_path / "list.pickle"
    listing.write_bytes(pickle.dumps([1, 2, 3]))
    with pytest.raises(SnapshotError, match=r"segments\[0\]: expected a dict"):
        load_snapshot(listing)
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps({"segments": [], "x": Evil()}))
    with pytest.raises(SnapshotError, match="refers to builtins.print"):
        load_snapshot(evil)
    assert "PWNED" not in capsys.readouterr().out  # refused before anything ran
    with pytest.raises(SnapshotError, match="cannot read snapshot file"):
        load_snapshot(tmp_path / "missing.pickle")
