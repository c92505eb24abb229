"""Building a manifest from live objects (names, pools, stale copies, watch lists, the pool
hook), its JSON round trip, and malformed manifests."""

from __future__ import annotations

import ast
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch
from torch import nn

from flatpool import AdoptSpec, FlatPool, FlatPoolError, InvalidTypeError
from flatpool.memory import (
    Manifest,
    ManifestError,
    OriginalEntry,
    StorageWatch,
    WatchedStorages,
    build_manifest,
    walk_roots,
)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(8, 16, bias=False)
        self.w2 = nn.Linear(16, 8, bias=False)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()
        self.register_buffer("scale", torch.ones(8))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(4))


def trained() -> tuple[Model, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.Adam(model.parameters())
    loss = sum(layer.mlp.w2(layer.mlp.w1(torch.ones(2, 8))).sum() for layer in model.layers)
    assert isinstance(loss, torch.Tensor)
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()
    return model, opt


def storage_address(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def test_names_follow_module_paths_and_optimizer_state() -> None:
    model, opt = trained()
    m = build_manifest([model, opt])
    names = {n: t for t in m.tensors for n in t.names}
    w1 = model.layers[3].mlp.w1.weight  # type: ignore[union-attr]
    assert names["layers.3.mlp.w1.weight"].address == storage_address(w1)
    assert names["layers.3.mlp.w1.weight"].nbytes == 16 * 8 * 4
    assert names["layers.3.mlp.w1.weight"].roles == ("parameter",)
    exp_avg = names["optimizer.state[layers.3.mlp.w1.weight]['exp_avg']"]
    assert exp_avg.address == storage_address(opt.state[w1]["exp_avg"])
    assert exp_avg.roles == ("optimizer state",)
    assert names["layers.3.mlp.w1.weight.grad"].roles == ("grad",)
    assert names["layers.0.scale"].roles == ("buffer",)
    # one entry per storage: 8 weights, their grads, 2 Adam states, 4 buffers, 8 step counters
    assert len(m.tensors) == 8 + 8 + 16 + 4 + 8
    named = build_manifest({"model": model, "opt": opt})
    assert any("opt.state[model.layers.0.mlp.w1.weight]['exp_avg_sq']" in t.names
               for t in named.tensors)


class Holder:
    """A framework object: tensors and pools behind plain and slotted attributes."""

    def __init__(self, pool: FlatPool, t: torch.Tensor) -> None:
        self.group = Slotted(pool, [t])


class Slotted:
    __slots__ = ("pool", "shards")

    def __init__(self, pool: FlatPool, shards: list[torch.Tensor]) -> None:
        self.pool = pool
        self.shards = shards


def test_objects_are_walked_through_attributes_and_slots() -> None:
    pool = FlatPool("cpu", capacity=4096, name="inner")
    pool.materialize()
    t = torch.arange(10.0)
    walked = walk_roots({"fused": Holder(pool, t)})
    assert [p.name for p in walked.pools] == ["inner"]
    assert [(f.name, f.role) for f in walked.tensors] == [("fused.group.shards.0", "tensor")]
    keyed = walk_roots({"state": {t: {"m": t * 2}, 3: t}})
    assert [f.name for f in keyed.tensors] == ["state.<Tensor #0>.m", "state.3"]
    m = build_manifest({"fused": Holder(pool, t)}, pools=[])
    assert [p.name for p in m.pools] == ["inner"]  # found on the way
    assert "inner" in [p.name for p in build_manifest().pools]  # default: every live pool


def test_tensors_in_a_pool_name_their_slice(hp_wrap: Callable[[torch.Tensor], torch.Tensor],
                                            dtensor_from_local: Callable[[torch.Tensor],
                                                                         torch.Tensor]) -> None:
    lin = nn.Linear(4, 6)
    dt = nn.Parameter(dtensor_from_local(torch.randn(6, 4)))
    pool = FlatPool("cpu", alignment=64, name="bucket")
    report = pool.adopt([lin.weight, lin.bias, dt])
    assert report.all_released
    wrapped = hp_wrap(lin.weight)
    m = build_manifest({"lin": lin, "dt": dt, "wrapped": wrapped}, pools=[pool])
    (entry,) = m.pools
    assert entry.address == pool.storage.data_ptr() and entry.capacity == pool.capacity
    assert [(s.slice_id, s.tensors) for s in entry.slices] == [
        (0, ("lin.weight", "wrapped")), (1, ("lin.bias",)), (2, ("dt",))]
    assert [s.alignment for s in entry.slices] == [64, 64, 64]
    assert m.tensors == ()  # everything lives in the pool
    assert entry.adopted_bytes == entry.used_bytes == (24 + 6 + 24) * 4


def test_gaps_tell_alignment_padding_from_free_ranges() -> None:
    pool = FlatPool("cpu", alignment=512, capacity=8192, name="p")
    pool.materialize()  # a planned pool holds no memory and is not in a manifest
    assert build_manifest(pools=[FlatPool("cpu", capacity=64)]).pools == ()
    a = pool.allocate(100, torch.uint8)       # [0, 100), padding to 512
    b = pool.allocate(512, torch.uint8)       # [512, 1024)
    c = pool.allocate(1024, torch.uint8)      # [1024, 2048)
    pool.free(b)                              # [512, 1024) becomes free
    del a, c
    (entry,) = build_manifest(pools=[pool]).pools
    assert [(g.offset, g.nbytes, g.kind) for g in entry.gaps()] == [
        (100, 924, "free"), (2048, 6144, "free")]
    d = pool.allocate(256, torch.uint8)       # [512, 768); no slice can start in [768, 1024)
    assert d.offset == 512
    (entry,) = build_manifest(pools=[pool]).pools
    assert [(g.offset, g.nbytes, g.kind) for g in entry.gaps()] == [
        (100, 412, "padding"), (768, 256, "padding"), (2048, 6144, "free")]


def test_census_finds_stale_copies_of_slices() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 3))
    model(torch.ones(1, 6)).sum().backward()
    pool = FlatPool("cpu", capacity=1 << 14, name="bucket")
    for p in model.parameters():  # the naive rebase: copies, originals kept
        pool.allocate(tuple(p.shape), p.dtype).tensor().copy_(p.detach())
    m = build_manifest(model, pools=[pool])
    stale = {t.label: t.stale_of for t in m.tensors if t.stale_of}
    assert stale == {"0.weight": "bucket:0", "0.bias": "bucket:1", "1.weight": "bucket:2",
                     "1.bias": "bucket:3"}
    assert all(t.stale_of is None for t in m.tensors if "grad" in t.roles)
    specs = [AdoptSpec(p, slice=s) for p, s in zip(model.parameters(), pool.slices())]
    assert pool.adopt(specs).all_released
    m = build_manifest(model, pools=[pool])
    assert [t.stale_of for t in m.tensors] == [None] * 4  # only the grads are left outside


def test_watched_storages_report_survivors_only() -> None:
    a, b = torch.randn(100), torch.randn(50)
    view = b[10:20]
    w = WatchedStorages({"a": a, "b": [view, b]})
    assert len(w) == 2  # b and its view share one storage
    assert isinstance(w, StorageWatch)
    addr_b = storage_address(b)
    del a
    assert w.alive_storages() == [("b", addr_b, 200)]
    assert w.alive_records() == [("b", addr_b, 200, "cpu")]
    del b
    assert w.alive_storages() == [("b", addr_b, 200)]  # the view still holds it
    del view
    assert w.alive_storages() == [] and w.alive_bytes == 0
    with pytest.raises(InvalidTypeError, match="single tensor"):
        WatchedStorages(torch.ones(2))  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="expected a torch.Tensor"):
        WatchedStorages({"x": [1.0]})  # type: ignore[list-item]


def test_a_resized_watched_storage_is_reported_where_it_is() -> None:
    t = torch.zeros(1000)
    w = WatchedStorages([t])
    t.untyped_storage().resize_(0)  # holds no memory any more
    assert w.alive_storages() == []


class ForeignWatch:
    """Any object with alive_storages() (the HSDP layer's OriginalStorages will be one)."""

    def __init__(self, items: Iterable[object]) -> None:
        self.items = list(items)

    def alive_storages(self) -> Iterable[tuple[str, int, int]]:
        return self.items  # type: ignore[return-value]


def test_watch_lists_become_stale_originals() -> None:
    keep = torch.randn(64)
    mine = WatchedStorages({"mine": keep})
    foreign = ForeignWatch([("up.weight", 0x1000, 4096)])
    m = build_manifest(watch=[mine, foreign])
    assert m.originals == (
        OriginalEntry("mine", storage_address(keep), 256, None, "watch", "cpu"),
        OriginalEntry("up.weight", 0x1000, 4096, None, "watch", None),
    )
    assert build_manifest(watch=foreign).originals[0].label == "up.weight"
    with pytest.raises(InvalidTypeError, match="expected \\(label: str, address: int"):
        build_manifest(watch=ForeignWatch([("x", -1, 3)]))
    with pytest.raises(InvalidTypeError, match=r"watch\[0\] is a int"):
        build_manifest(watch=[3])  # type: ignore[list-item]


def test_a_pools_unreleased_originals_are_stale_with_the_pools_name() -> None:
    """An adoption under on_pinned="warn" whose original something else still holds: the pool
    records it, and the manifest lists it as a stale original of that pool."""
    pool = FlatPool("cpu", capacity=1024, name="bucket")
    w = torch.randn(32)
    stash = {"w": w.detach()}  # pins w's original
    address = storage_address(w)
    with pytest.warns(UserWarning, match="still referenced"):
        pool.adopt(w, on_pinned="warn")
    m = build_manifest(pools=[pool])
    assert m.originals == (
        OriginalEntry("#0 Tensor(32,) float32", address, 128, "bucket", "pool", "cpu"),)
    del stash
    assert build_manifest(pools=[pool]).originals == ()  # it died: nothing stale any more


def test_json_round_trip(tmp_path: Path) -> None:
    model, opt = trained()
    pool = FlatPool("cpu", name="bucket")
    pool.adopt(list(model.layers[0].parameters()))
    keep = torch.ones(3)
    m = build_manifest([model, opt], pools=[pool], flats=[torch.zeros(7)],
                       watch=WatchedStorages([keep]))
    assert m.pools and m.flats and m.tensors and m.originals
    assert Manifest.from_json(m.to_json()) == m
    path = tmp_path / "m.json"
    m.write(path)
    assert Manifest.read(path) == m
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]  # no temporary file left
    umask = os.umask(0o022)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as open() would have made it
    path.chmod(0o600)
    m.write(path)  # replacing a file keeps its permissions
    assert path.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("edit, field, words", [
    (lambda d: d.update(format="other"), "format", "not a flatpool memory manifest"),
    (lambda d: d.update(version=99), "version", "unsupported version"),
    (lambda d: d.update(pools={}), "pools", "expected a list"),
    (lambda d: d["pools"][0].pop("address"), "pools[0].address", "missing"),
    (lambda d: d["pools"][0].update(capacity="1"), "pools[0].capacity", "expected an int"),
    (lambda d: d["pools"][0]["slices"][0].update(offset=10**6), "pools[0].slices[0]",
     "beyond the pool's capacity"),
    (lambda d: d["pools"][0]["slices"][0].update(shape=[2, "x"]), "pools[0].slices[0].shape",
     "list of ints"),
    (lambda d: d["tensors"][0].update(names=[1]), "tensors[0].names[0]", "expected a string"),
    (lambda d: d["tensors"][0].update(label=None), "tensors[0].label", "expected a string"),
    (lambda d: d["originals"][0].update(source="gc"), "originals[0].source", "'watch' or 'pool'"),
])
def test_malformed_manifests_name_the_field(edit: Callable[[dict[str, object]], object],
                                            field: str, words: str) -> None:
    pool = FlatPool("cpu", capacity=4096, name="p")
    pool.allocate(4, torch.float32)
    pool.materialize()
    keep = torch.ones(2)
    data = build_manifest({"t": torch.zeros(3)}, pools=[pool],
                          watch=WatchedStorages([keep])).to_dict()
    edit(data)
    with pytest.raises(ManifestError) as info:
        Manifest.from_dict(data)
    assert info.value.field == field and words in str(info.value)
    with pytest.raises(ManifestError):
        Manifest.from_json(json.dumps(data))


def test_unreadable_manifests(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ManifestError, match="not JSON"):
        Manifest.read(bad)
    with pytest.raises(ManifestError, match="expected an object, got list"):
        Manifest.from_json("[]")
    with pytest.raises(ManifestError, match="cannot read manifest"):
        Manifest.read(tmp_path / "none.json")
    with pytest.raises(FlatPoolError, match="no pool named 'x'"):
        Manifest().pool("x")


def test_the_package_imports_no_upper_layer_and_no_optional_dependency() -> None:
    """flatpool.memory sits below flatpool.integrations and must load without matplotlib or
    torch_npu: no import statement of its modules names them (matplotlib is loaded by name,
    on demand, in _mpl.py only)."""
    import flatpool.memory

    folder = Path(flatpool.memory.__file__).parent
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            for name in names:
                assert not any(bad in name for bad in ("integrations", "matplotlib", "torch_npu")), \
                    f"{path.name} imports {name}"
    assert os.path.exists(folder / "_mpl.py")
