"""``python -m flatpool.memory``: a pickled snapshot and a manifest JSON in, the table (and a
picture) out; progress on stderr for large snapshots; bad inputs exit 2 naming the field."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flatpool.memory import SnapshotError, parse_snapshot
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
    out, err = capsys.readouterr()
    assert f"the folder '{tmp_path / 'no' / 'such'}' does not exist; create it first" in err
    assert out == "" and ".tmp" not in err  # checked before the work, no temporary file named


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


# -- the CLI's promise on hostile files (issue 18.14, 18.13, 19), each in a subprocess --------
ROOT = Path(__file__).resolve().parents[1]
DEEP = 200_000  # far past Python's recursion limit


def cli(*args: object, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -m flatpool.memory ARGS`` in a fresh interpreter (a RecursionError or a crash
    there cannot take the test run down)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "flatpool.memory", *map(str, args)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


def typed_exit_2(proc: subprocess.CompletedProcess[str], error: str, text: str) -> None:
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr
    assert f"error: {error}: " in proc.stderr and text in proc.stderr, proc.stderr


def _with_deep_list(data: object) -> bytes:
    """``data`` pickled with the string "DEEP" replaced by a list nested DEEP levels (written
    as pickle opcodes: pickling such a list would itself recurse too deep)."""
    raw = pickle.dumps(data, protocol=4)
    at = raw.index(b"\x8c\x04DEEP")
    return raw[:at] + b"(" * DEEP + b"]" + b"l" * DEEP + raw[at + 6:]


@pytest.mark.parametrize("where", ["frame", "total_size", "line"])
def test_deeply_nested_snapshot_entry_exits_2(tmp_path: Path, where: str) -> None:
    """A frame (or size) nested past the recursion limit, or a 5,000-digit line number."""
    frames = [{"filename": "DEEP" if where == "frame" else "/home/u/train.py",
               "line": 10**5000 if where == "line" else 3, "name": "step"}]
    segment = seg(0x100000, 4096, [blk(0x100000, 512, frames=frames)])
    if where == "total_size":
        segment["total_size"] = "DEEP"
    path = tmp_path / "deep.pickle"
    path.write_bytes(_with_deep_list(snapshot(segment)) if where != "line"
                     else pickle.dumps(snapshot(segment)))
    field = {"frame": "segments[0].blocks[0].frames[0].filename: expected a string, got list",
             "total_size": "segments[0].total_size: expected an int, got list",
             "line": "segments[0].blocks[0].frames[0].line: expected a line number, got <an int",
             }[where]
    typed_exit_2(cli(path, cwd=tmp_path), "SnapshotError", field)


@pytest.mark.parametrize("value, text", [
    ("[" * DEEP + "]" * DEEP, "JSON nested deeper than Python's recursion limit"),
    ("9" * 5000, "Exceeds the limit (4300 digits)"),
])
def test_hostile_manifest_value_exits_2(files: tuple[Path, Path], tmp_path: Path, value: str,
                                        text: str) -> None:
    snap, manifest = files
    data = json.loads(manifest.read_text())
    data["pools"][0]["address"] = "HOSTILE"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data).replace('"HOSTILE"', value))
    typed_exit_2(cli(snap, "--manifest", bad, cwd=tmp_path), "ManifestError", text)


def test_mathtext_pool_name_is_drawn_as_written(files: tuple[Path, Path], tmp_path: Path) -> None:
    """A pool named like TeX math (matplotlib's mathtext failed on it: exit 1)."""
    pytest.importorskip("matplotlib")
    snap, manifest = files
    data = json.loads(manifest.read_text())
    name = r"$\frac{a$"
    data["pools"][0]["name"] = name
    renamed = tmp_path / "m.json"
    renamed.write_text(json.dumps(data))
    proc = cli(snap, "--manifest", renamed, "--png", "out.png", "--pool", name, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "out.png").read_bytes()[:4] == b"\x89PNG"


def test_memo_amplified_snapshot_is_refused(tmp_path: Path) -> None:
    """2 MB of pickle naming one block dict a million times parsed into a million blocks
    (~360 MB); it is refused before anything is built."""
    n = 1_000_000
    one = {"size": 512, "requested_size": 512, "state": "active_allocated"}
    path = tmp_path / "amplified.pickle"
    path.write_bytes(pickle.dumps({"segments": [
        {"address": 1 << 20, "total_size": 512 * n, "blocks": [one] * n}]}, protocol=4))
    assert path.stat().st_size < 3 << 20
    typed_exit_2(cli(path, cwd=tmp_path), "SnapshotError",
                 "segments[0].blocks[1]: the same block entry is listed more than once")
    seg_twice = {"address": 1 << 20, "total_size": 512, "blocks": [dict(one)]}
    path.write_bytes(pickle.dumps({"segments": [seg_twice] * 3}))
    typed_exit_2(cli(path, cwd=tmp_path), "SnapshotError",
                 "segments[1]: the same segment entry is listed more than once")


def test_block_limit_is_clear_and_can_be_raised(tmp_path: Path) -> None:
    blocks = [blk(0x100000 + 512 * i, 512) for i in range(300)]
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(snapshot(seg(0x100000, 512 * 300, blocks))))
    typed_exit_2(cli(path, "--max-blocks", 299, cwd=tmp_path), "SnapshotError",
                 "segments: more than 299 blocks (the limit")
    assert cli(path, "--max-blocks", 300, cwd=tmp_path).returncode == 0
    with pytest.raises(SnapshotError, match="more than 2,000,000 blocks"):
        parse_snapshot({"segments": [{"address": 0, "total_size": 1, "blocks": [{}] * 2_000_001}]})


def test_without_a_manifest_a_note_says_why_all_is_unattributed(files: tuple[Path, Path],
                                                               tmp_path: Path) -> None:
    proc = cli(files[0], cwd=tmp_path)
    assert proc.returncode == 0 and "unattributed      10  57 KiB (58368 B)" in proc.stdout
    assert "note: no --manifest given, so every active block is unattributed" in proc.stderr
    assert "--manifest" not in proc.stdout  # the table itself stays as it was
    with_manifest = cli(files[0], "--manifest", files[1], cwd=tmp_path)
    assert with_manifest.returncode == 0 and "no --manifest" not in with_manifest.stderr


def test_png_into_a_missing_folder_fails_first(files: tuple[Path, Path], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    proc = cli(files[0], "--png", tmp_path / "missing" / "out.png", cwd=tmp_path)
    typed_exit_2(proc, "PictureError", "does not exist; create it first")
    assert proc.stdout == "" and ".tmp" not in proc.stderr
    typed_exit_2(cli(files[0], "--png", tmp_path, cwd=tmp_path), "PictureError", "is a folder")


class _CountedFrames(list):  # type: ignore[type-arg]
    """A frames list that counts how often it is read."""

    reads = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        _CountedFrames.reads += 1
        return super().__iter__()

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        _CountedFrames.reads += 1
        return super().__getitem__(index)


def test_a_frames_list_shared_by_every_block_is_read_once() -> None:
    """What a memo makes cheap to write (one long frames list named by every block) used to
    cost its length per block; only its first frames are read, once."""
    torch_frame = {"filename": "/x/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"}
    frames = _CountedFrames([torch_frame] * 5_000)
    blocks = [blk(0x100000 + 512 * i, 512, frames=frames) for i in range(2_000)]
    _CountedFrames.reads = 0
    snap = parse_snapshot(snapshot(seg(0x100000, 512 * 2_000, blocks)))
    assert _CountedFrames.reads == 1
    assert {b.where for b in snap.segments[0].blocks} == {"module.py:1 (_call_impl)"}
