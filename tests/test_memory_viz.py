"""Pictures: the PNG is written atomically, opens, has the expected size and shows the stale
blocks in the stale colour; bar lengths are bytes on one scale per picture (read from the drawn
artists' geometry), tiny slices stay visible and named, no label leaves the picture, no empty
panel, dtype colours are not class colours; without matplotlib a typed error names the extra."""

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
from flatpool.memory import _viz as viz
from flatpool.memory._viz import COLOURS, DTYPE_COLOURS, MIN_FRACTION
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
    # 9 in wide at 100 dpi; 0.75 + 0.34 in per row (the total, the pool, 4 originals) + 0.9
    # + 2.5 in for the pool's layout
    assert shape_of(paths["before"]) == (619, 900)
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
    assert shape_of(out) == (585, 1800)  # two 9 in columns; 0.75 + 5 x 0.34 + 0.9 + 2.5 in
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


def bars(ax: object, prefix: str) -> dict[str, list[tuple[float, float]]]:
    """``gid -> [(x, width), ...]`` of the bars drawn in ``ax`` whose gid starts so (data
    coordinates: bytes)."""
    out: dict[str, list[tuple[float, float]]] = {}
    for c in ax.collections:  # type: ignore[attr-defined]
        gid = c.get_gid() or ""
        if gid.startswith(prefix):
            for path in c.get_paths():
                xs = path.vertices[:, 0]
                out.setdefault(gid, []).append((float(xs.min()), float(xs.max() - xs.min())))
    return out


def covered(runs: list[tuple[float, float]]) -> float:
    """The length of the union of ``[x, x + w)`` runs."""
    total, end = 0.0, float("-inf")
    for x, w in sorted(runs):
        lo, hi = max(x, end), x + w
        if hi > lo:
            total += hi - lo
        end = max(end, hi)
    return total


def pixels(ax: object, x: float, width: float) -> float:
    """The on-screen length of ``[x, x + width)`` in ``ax``."""
    (x0, _), (x1, _) = ax.transData.transform([(x, 0.0), (x + width, 0.0)])  # type: ignore[attr-defined]
    return float(x1 - x0)


def texts(ax: object) -> list[str]:
    return [t.get_text() for t in ax.texts]  # type: ignore[attr-defined]


def test_bar_lengths_are_bytes_on_one_scale(tmp_path: Path) -> None:
    """Every bar is as long as its bytes, on the same linear scale in both columns: 32 KiB is
    a quarter of the 128 KiB pool, the naive column's active total 192.75/128 of the
    adopted one; a 256 B bias is drawn MIN_FRACTION of the axis long and named with its size."""
    pytest.importorskip("matplotlib")
    before, after = naive_then_adopted()
    fig = viz.figure([("naive copy", before), ("adopted", after)])
    segs_before, segs_after, layout_before, layout_after = fig.axes  # type: ignore[attr-defined]
    axis_px = pixels(segs_before, 0.0, segs_before.get_xlim()[1])
    for ax, a in ((segs_before, before), (segs_after, after)):
        totals = bars(ax, "total:")
        # the total row: each class as long as its bytes (adopted apart from the pool's rest)
        assert sum(w for runs in totals.values() for _, w in runs) == a.active_bytes
        assert sum(w for _, w in totals.get("total:stale", [])) == a.bytes_of("stale")
        for seg in a.segments:
            runs = [r for gid, rs in bars(ax, f"segment:{seg.address:#x}:").items() for r in rs]
            drawn = covered(runs)
            if seg.total_size >= MIN_FRACTION * ax.get_xlim()[1]:
                # a row covers exactly its bytes (a tiny run inside is widened over its
                # neighbour, never past the row's end)
                assert drawn == seg.total_size, (seg, runs)
            else:  # too short to see: drawn at the minimum, named with its true size
                assert drawn == pytest.approx(MIN_FRACTION * ax.get_xlim()[1])
                assert pixels(ax, 0.0, drawn) >= 3.0
    # one scale for both columns: the same bytes are the same pixels
    assert pixels(segs_before, 0.0, 1.0) == pytest.approx(pixels(segs_after, 0.0, 1.0))
    pool_px = pixels(segs_before, 0.0, 128 * 1024)
    weight_px = pixels(segs_before, 0.0, 32 * 1024)
    assert weight_px / pool_px == pytest.approx(0.25)
    total_px = [pixels(ax, 0.0, sum(w for rs in bars(ax, "total:").values() for _, w in rs))
                for ax in (segs_before, segs_after)]
    assert total_px[0] / total_px[1] == pytest.approx(before.active_bytes / after.active_bytes)
    assert pool_px < axis_px  # the 128 KiB pool is not full width: the naive total is longer
    assert "STALE 1.bias (256 B)" in " ".join(texts(segs_before))
    # the pool's layout: each slice as long as its bytes (the biases at the minimum), named
    (pool,) = after.manifest.pools
    slices = bars(layout_after, "slice:")
    for s in pool.slices:
        ((x, w),) = slices[f"slice:{s.slice_id}"]
        assert x == s.offset and w == pytest.approx(max(s.nbytes, MIN_FRACTION * pool.capacity)), s
        assert any(s.tensors[0] in t and viz.fmt_bytes(s.nbytes) in t
                   for t in texts(layout_after)), (s, texts(layout_after))


def test_no_label_leaves_the_picture_and_no_empty_panel(tmp_path: Path) -> None:
    """A column without a pool gets no layout box; with one pool in two columns the layout
    spans the picture; every text lies inside the figure."""
    pytest.importorskip("matplotlib")
    agg = pytest.importorskip("matplotlib.backends.backend_agg")
    before, after = naive_then_adopted()
    plain = capture(roots={"t": torch.ones(1000), "tiny": torch.ones(2)}, pools=[], scan=False)
    assert plain.manifest.pools == ()
    alone = viz.figure([("tensors only", plain)])
    assert len(alone.axes) == 1  # type: ignore[attr-defined]
    assert not any("no flatpool pool" in t for ax in alone.axes for t in texts(ax))  # type: ignore[attr-defined]
    mixed = viz.figure([("tensors only", plain), ("adopted", after)])
    assert len(mixed.axes) == 3  # type: ignore[attr-defined]
    layout = mixed.axes[2]  # type: ignore[attr-defined]
    assert layout.get_position().width > 0.8  # one layout across both columns
    torch.manual_seed(0)
    bf16 = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)]).to(torch.bfloat16)
    fp32 = nn.Linear(128, 32)
    crowded = FlatPool("cpu", name="mixed")
    crowded.adopt([*bf16.parameters(), *fp32.parameters()])
    many = capture(roots={"model": bf16, "extra": fp32}, pools=[crowded], scan=False)
    many_fig = viz.figure([("14 slices, 2 dtypes", many)])
    named = " ".join(texts(many_fig.axes[1]))  # type: ignore[attr-defined]
    for s in many.manifest.pools[0].slices:  # every slice named, the 128 B biases too
        assert s.tensors[0] in named, (s, named)
    for fig in (alone, mixed, many_fig, viz.figure([("naive copy", before), ("adopted", after)])):
        canvas = agg.FigureCanvasAgg(fig)
        canvas.draw()
        renderer = canvas.get_renderer()
        box = fig.bbox  # type: ignore[attr-defined]
        for ax in fig.axes:  # type: ignore[attr-defined]
            for t in [*ax.texts, ax.title, ax._left_title, *ax.get_yticklabels(),
                      *ax.get_xticklabels()]:
                if not t.get_text():
                    continue
                e = t.get_window_extent(renderer)
                assert e.x0 >= box.x0 - 0.5 and e.x1 <= box.x1 + 0.5, t.get_text()
                assert e.y0 >= box.y0 - 0.5 and e.y1 <= box.y1 + 0.5, t.get_text()
    assert "tiny" in " ".join(texts(alone.axes[0]))  # type: ignore[attr-defined]


def test_dtype_colours_are_not_class_colours(tmp_path: Path) -> None:
    """float32 in the layout is not the pool's blue: a slice's colour says its dtype only."""
    pytest.importorskip("matplotlib")
    assert set(DTYPE_COLOURS).isdisjoint(COLOURS.values())
    _, after = naive_then_adopted()
    out = tmp_path / "after.png"
    draw(after, out, title="adopted")
    assert pixels_of(out, DTYPE_COLOURS[0]) > 5_000  # the float32 slices


def test_names_like_tex_math_are_drawn_as_written(tmp_path: Path) -> None:
    """``draw`` called from Python (not only the CLI) must not parse ``$...$`` names as
    mathtext: ``$\\frac{a$`` is a mathtext parse error that aborted the picture."""
    pytest.importorskip("matplotlib")
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    pool = FlatPool("cpu", name=r"$\frac{a$")
    pool.adopt(list(model.parameters()))
    after = capture(roots={"model": model}, pools=[pool], scan=False)
    out = tmp_path / "tex.png"
    draw(after, out, title=r"rank $0$ of \frac{a$", pool=r"$\frac{a$")
    assert out.read_bytes()[:4] == b"\x89PNG"
