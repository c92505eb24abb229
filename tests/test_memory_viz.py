"""Pictures: the PNG is written atomically, opens, has the expected size and shows the stale
blocks in the stale colour; without matplotlib a typed error names the extra."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from flatpool import AdoptSpec, FlatPool
from flatpool.memory import (
    ManifestError,
    MemoryAttribution,
    MissingExtraError,
    WatchedStorages,
    attribute,
    capture,
    draw,
    draw_comparison,
)
from flatpool.memory.viz import COLOURS
from test_memory_attribute import MANIFEST, SNAPSHOT


def pixels_of(path: Path, colour: str) -> int:
    """How many pixels of ``path`` have ``colour`` (#rrggbb), decoding the PNG for real."""
    image = pytest.importorskip("matplotlib.image").imread(str(path))
    rgb = torch.tensor(image[..., :3])
    want = torch.tensor([int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int(((rgb - want).abs().max(dim=-1).values < 0.01).sum())


def shape_of(path: Path) -> tuple[int, int]:
    image = pytest.importorskip("matplotlib.image").imread(str(path))
    return int(image.shape[0]), int(image.shape[1])


def naive_then_adopted() -> tuple[MemoryAttribution, MemoryAttribution]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64))
    pool = FlatPool("cpu", capacity=1 << 17, name="bucket")
    watch = WatchedStorages(dict(model.named_parameters()))
    for p in model.parameters():
        pool.allocate(tuple(p.shape), p.dtype).tensor().copy_(p.detach())
    before = capture(roots={"model": model}, pools=[pool], watch=watch, scan=False)
    pool.adopt([AdoptSpec(p, slice=s) for p, s in zip(model.parameters(), pool.slices())])
    after = capture(roots={"model": model}, pools=[pool], watch=watch, scan=False)
    return before, after


def test_pictures_show_stale_blocks_only_before_adoption(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    before, after = naive_then_adopted()
    assert len(before.stale) == 4 and after.stale == ()
    paths = {name: tmp_path / f"{name}.png" for name in ("before", "after")}
    draw(before, paths["before"], title="naive copy")
    draw(after, paths["after"], title="adopted")
    for path in paths.values():
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 20_000
    # 9 in wide at 100 dpi; 1.55 in + 0.34 in per segment row (pool + 4 originals) + 2.4 in
    assert shape_of(paths["before"]) == (565, 900)
    # the legend shows each colour once; stale bars are thousands of pixels more
    stale_before = pixels_of(paths["before"], COLOURS["stale"])
    stale_after = pixels_of(paths["after"], COLOURS["stale"])
    assert stale_before > stale_after + 5_000
    assert pixels_of(paths["after"], COLOURS["adopted"]) > pixels_of(
        paths["before"], COLOURS["adopted"]) + 5_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["after.png", "before.png"]


def test_odd_snapshot_side_by_side_draws_every_class(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    a = attribute(SNAPSHOT, manifest=MANIFEST)
    with pytest.raises(ManifestError, match="no pool named 'nope'"):
        draw(a, tmp_path / "x.png", pool="nope")
    with pytest.raises(ManifestError, match="at least one"):
        draw_comparison(tmp_path / "x.png", [])
    assert not (tmp_path / "x.png").exists()
    out = tmp_path / "odd.png"
    draw_comparison(out, [("odd shapes", a), ("again", a)], pool="bucket", max_segments=4)
    assert shape_of(out) == (531, 1800)  # two 9 in columns; 1.55 + 4 x 0.34 + 2.4 in high
    for kind in ("pool", "stale", "unattributed", "free", "adopted"):
        assert pixels_of(out, COLOURS[kind]) > 200, kind


def test_a_failed_write_leaves_the_old_picture(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    a = attribute(SNAPSHOT, manifest=MANIFEST)
    out = tmp_path / "pic.png"
    out.write_bytes(b"old picture")

    def refuse(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        draw(a, out)
    assert out.read_bytes() == b"old picture"
    assert [p.name for p in tmp_path.iterdir()] == ["pic.png"]  # no temporary file left


def test_without_matplotlib_a_typed_error_names_the_extra(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("matplotlib", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, name, None)  # what a missing install looks like
    a = attribute(SNAPSHOT, manifest=MANIFEST)
    with pytest.raises(MissingExtraError) as info:
        draw(a, tmp_path / "pic.png")
    assert info.value.extra == "viz" and "pip install 'flatpool[viz]'" in str(info.value)
    assert isinstance(info.value, ImportError)
    with pytest.raises(MissingExtraError):  # capture checks first, before any work
        capture(tmp_path / "cap.png", roots={"t": torch.ones(3)})
    assert list(tmp_path.iterdir()) == []
