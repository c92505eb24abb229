"""``python -m flatpool.memory``: a pickled snapshot and a manifest JSON in, the table (and a
picture) out; progress on stderr for large snapshots; bad inputs exit 2 naming the field."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

from flatpool.memory.__main__ import LARGE, main
from memory_snapshots import blk, seg, snapshot
from test_memory_attribute import MANIFEST, SNAPSHOT


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    snap = tmp_path / "snap.pickle"
    snap.write_bytes(pickle.dumps(SNAPSHOT))  # as torch.cuda.memory._dump_snapshot() writes
    manifest = tmp_path / "m.json"
    MANIFEST.write(manifest)
    return snap, manifest


def test_table_from_files(files: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    snap, manifest = files
    assert main([str(snap), "--manifest", str(manifest), "--top", "3"]) == 0
    out, err = capsys.readouterr()
    assert "pool               2  20.50 KiB (20992 B)" in out
    assert "stale              2  12.50 KiB (12800 B)" in out
    assert "total             10  57 KiB (58368 B) = active bytes" in out
    assert "largest items (3 of 11):" in out
    assert err == ""  # small snapshot: no progress line


def test_without_a_manifest_everything_is_unattributed(
        files: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(files[0])]) == 0
    assert "unattributed      10  57 KiB (58368 B)" in capsys.readouterr().out


def test_picture_from_files(files: tuple[Path, Path], tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "out.png"
    assert main([str(files[0]), "--manifest", str(files[1]), "--png", str(png),
                 "--pool", "bucket", "--progress"]) == 0
    out, err = capsys.readouterr()
    assert f"picture: {png}" in out and png.read_bytes()[:4] == b"\x89PNG"
    assert "flatpool.memory: attributed 18/18 blocks\n" in err
    assert main([str(files[0]), "--png", str(tmp_path / "no" / "such" / "dir.png")]) == 2
    assert "No such file or directory" in capsys.readouterr().err


def test_large_snapshots_report_progress(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    n = LARGE + 5
    blocks = [blk(0x100000 + 512 * i, 512, "active_allocated" if i % 3 else "inactive")
              for i in range(n)]
    path = tmp_path / "big.pickle"
    path.write_bytes(pickle.dumps(snapshot(seg(0x100000, 512 * n, blocks))))
    assert main([str(path)]) == 0
    out, err = capsys.readouterr()
    assert f"flatpool.memory: attributed {n}/{n} blocks\n" in err
    assert re.search(r"flatpool.memory: done in \d+\.\d s", err)
    active = sum(1 for i in range(n) if i % 3)
    assert f"unattributed  {active:>6}  " in out


def test_bad_inputs_exit_2_naming_the_problem(files: tuple[Path, Path], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    snap, manifest = files
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(pickle.dumps({"segments": [{"address": 1, "total_size": "x", "blocks": []}]}))
    assert main([str(bad)]) == 2
    assert "SnapshotError: segments[0].total_size: expected an int" in capsys.readouterr().err
    assert main([str(manifest)]) == 2  # a JSON file given as the snapshot
    assert "not a pickled allocator snapshot" in capsys.readouterr().err
    assert main([str(snap), "--manifest", str(snap)]) == 2
    assert "ManifestError" in capsys.readouterr().err
