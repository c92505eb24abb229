"""The drop-in lines of docs/integration.md inside HyperParallel's groups (the simulation).

2-rank tests (one spawned gloo job shared with test_hp_faithful.py, ``hp_jobs.run_all``) run
the lines exactly as the document writes them in the V1 group and the newest bucketed group:
eager, after ``to_empty``,
after a ``_local_tensor`` assigned to a meta wrapper; fp32 and ``param_dtype=bf16``; uneven,
empty and even-only shards; a later member moved by ``reset_sharded_param``; the report's size.
Single-process tests pin the pieces: typed errors, each DTensor generation's wrapper moved with
the local geometry, the validity check past ``__torch_function__``, the mixins = the doc.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from flatpool import FlatPoolError, InvalidRequestError, InvalidTypeError, live_pools
from flatpool.integrations.hsdp import adopt_group, cast_buffer, fuse, is_valid, problems
from flatpool.integrations.hsdp.group import layout_of
from flatpool.integrations.hsdp import BucketLines, V1Lines, flat_buffer
from examples.hyperparallel_sim import (
    HSDPParam,
    ShardMesh,
    dtensor_class,
    wrapper_local_geometry,
    wrapper_storage_key,
)
from flatpool.integrations.hsdp import materialize_group

import hp_doc_lines

MiB = 1 << 20


# ---- single process ---------------------------------------------------------------------------
def test_package_mixins_are_the_documented_lines() -> None:
    assert hp_doc_lines.package_bodies(V1Lines) == hp_doc_lines.doc_bodies("v1")
    assert hp_doc_lines.package_bodies(BucketLines) == hp_doc_lines.doc_bodies("newest")


def _members(setter: str = "routed", flavor: str = "even", rows: int = 8, rank: int = 1,
             n: int = 2, data_ptr: str = "local") -> list[HSDPParam]:
    torch.manual_seed(rows + rank)
    cls = dtensor_class(setter, data_ptr)  # type: ignore[arg-type]
    return [HSDPParam(nn.Linear(3, rows, bias=False), "weight", ShardMesh(None, 2, rank),
                      dtensor_cls=cls, flavor=flavor)  # type: ignore[arg-type]
            for _ in range(n)]


@pytest.mark.parametrize("setter", ["routed", "rebind"])
@pytest.mark.parametrize("flavor,rows", [("even", 8), ("padded", 7), ("padded", 1)])
def test_wrapper_moves_with_the_local_geometry(setter: str, flavor: str, rows: int) -> None:
    """The wrapper's Python shape is global; it is rebound by its TensorImpl (local) geometry,
    and the pool's storage stays exactly its capacity (a global-shape set_ grew it to 12 MiB)."""
    ps = _members(setter, flavor, rows)
    before = [p._sharded_local_tensor.detach().clone() for p in ps]
    wrappers = [p.sharded_param for p in ps]
    buffers = adopt_group(ps, world_size=2)  # type: ignore[arg-type]
    pool = buffers.buckets[0].pool
    assert pool.storage.nbytes() == pool.capacity
    for p, b, w in zip(ps, before, wrappers):
        local = p._sharded_local_tensor
        assert p.sharded_param is w and tuple(w.shape) == (rows, 3)  # global, as before
        assert wrapper_storage_key(w) == pool.storage_key
        assert wrapper_local_geometry(w) == (tuple(local.shape), local.stride(),
                                             local.storage_offset())
        assert torch.equal(local, b)
    assert is_valid(buffers, ps) and not problems(buffers, ps)  # type: ignore[arg-type]


@pytest.mark.parametrize("setter", ["routed", "rebind"])
def test_meta_wrapper_gets_its_local_tensors_place(setter: str) -> None:
    """init_empty_weights + ``_local_tensor`` assignment leaves the wrapper meta; adoption
    gives it its slice (a meta wrapper is never valid)."""
    cls = dtensor_class(setter, "local")  # type: ignore[arg-type]
    with torch.device("meta"):
        modules = [nn.Linear(3, 8, bias=False) for _ in range(2)]
    ps = [HSDPParam(m, "weight", ShardMesh(None, 2, 0), dtensor_cls=cls) for m in modules]
    for p in ps:
        p.sharded_param._local_tensor = torch.randn(4, 3)  # type: ignore[attr-defined]
        p.reset_sharded_param()
    assert all(wrapper_storage_key(p.sharded_param) is None for p in ps)  # meta wrappers
    buffers = adopt_group(ps, world_size=2)  # type: ignore[arg-type]
    pool = buffers.buckets[0].pool
    for p in ps:
        assert wrapper_storage_key(p.sharded_param) == pool.storage_key
        assert wrapper_local_geometry(p.sharded_param)[0] == (4, 3)
    assert is_valid(buffers, ps) and pool.storage.nbytes() == pool.capacity  # type: ignore[arg-type]


def test_validity_never_asks_the_dtensor() -> None:
    """``data_ptr="dispatch"``: every op without a layout rule raises, data_ptr() included."""
    ps = _members(data_ptr="dispatch")
    with pytest.raises(RuntimeError, match="dose not contain"):
        ps[0].sharded_param.data_ptr()
    buffers = adopt_group(ps, world_size=2)  # type: ignore[arg-type]
    assert is_valid(buffers, ps) and not problems(buffers, ps)  # type: ignore[arg-type]


class _Uneven:
    """A member without padded_sharded_param_size whose data is padded (uneven sharding)."""

    def __init__(self) -> None:
        self._sharded_param_data = torch.zeros(12)
        self.sharded_param = nn.Parameter(self._sharded_param_data[:9].view(3, 3))
        self.sharded_size = torch.Size((3, 3))
        self.offload_to_cpu = False


def test_missing_padded_size_is_a_typed_error_when_the_shard_is_padded() -> None:
    m = _Uneven()
    data = m._sharded_param_data
    with pytest.raises(InvalidRequestError, match="padded_sharded_param_size"):
        adopt_group([m], world_size=2)  # type: ignore[list-item]
    assert m._sharded_param_data is data and not any(p.owns(data) for p in live_pools())


def test_even_members_need_no_padded_size() -> None:
    ps = _members("routed", "even")
    assert not hasattr(ps[0], "padded_sharded_param_size")
    assert layout_of(ps[0], 0, 0).padded_size == (4, 3)  # type: ignore[arg-type]


def test_bad_members_are_typed_errors() -> None:
    class NoData:
        sharded_param = nn.Parameter(torch.zeros(2))
        sharded_size = torch.Size((2,))
        offload_to_cpu = False

    with pytest.raises(InvalidTypeError, match="_sharded_param_data"):
        adopt_group([NoData()], world_size=2)  # type: ignore[list-item]
    m = _Uneven()
    m.padded_sharded_param_size = torch.Size((3, 3))  # type: ignore[attr-defined]
    with pytest.raises(InvalidRequestError, match="1-D with 9 elements"):
        layout_of(m, 0, 0)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="not on meta"):
        materialize_group(_members(), device="cpu")  # type: ignore[arg-type]
    with pytest.raises(FlatPoolError, match="no bucket"):
        adopt_group(_members(), world_size=2).bucket(torch.float64)  # type: ignore[arg-type]


def test_hsdp_layer_errors_stay_typed() -> None:
    """Every exception class the layer raises on purpose is flatpool's."""
    import ast
    from pathlib import Path

    import flatpool.integrations.hsdp as hsdp

    root = Path(hsdp.__file__).parent
    bare = []
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                name = getattr(node.exc.func, "id", "")
                if name in {"ValueError", "TypeError", "KeyError", "RuntimeError"}:
                    bare.append(f"{path.name}:{node.lineno} {name}")
    assert not bare, bare


def test_fuse_skips_mixed_dtypes_like_hyperparallel() -> None:
    ps = _members()
    ps[1]._sharded_param_data = ps[1]._sharded_param_data.double()
    got = fuse(ps, None, device="cpu", world_size=2)  # type: ignore[arg-type]
    assert not got.adopted and "dtype" in (got.skipped or "") and flat_buffer(got) is None


def test_cast_buffer_follows_param_dtype_and_is_reused() -> None:
    ps = _members()
    for p in ps:
        p.param_dtype = torch.bfloat16
    flat = torch.zeros(24)
    cast = cast_buffer(ps, flat)  # type: ignore[arg-type]
    assert cast is not None and cast.dtype == torch.bfloat16 and cast.numel() == 24
    assert cast_buffer(ps, flat, cast) is cast  # type: ignore[arg-type]
    assert cast_buffer(ps, None) is None  # type: ignore[arg-type]
    for p in ps:
        p.param_dtype = None
    assert cast_buffer(ps, flat) is None  # type: ignore[arg-type]


# ---- 2 ranks ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results(hp_job: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [per_rank["hook"] for per_rank in hp_job]


def _ok(results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    rows = [r[name] for r in results]
    for rank, r in enumerate(rows):
        assert r["error"] is None, f"rank {rank}: {r['error']}"
        assert r["reference"]["error"] is None, f"rank {rank}: {r['reference']['error']}"
    return rows


def _fused_every_step(r: dict[str, Any], rows: int, cols: int) -> None:
    for i, st in enumerate(r["steps"]):
        where = f"step {i}"
        assert st["valid"] is True, where
        assert st["problems"] and all(not p for p in st["problems"]), (where, st["problems"])
        assert st["pool_bytes"] and all(n == cap for n, cap in st["pool_bytes"]), where
        assert (st["live"], st["live_in_pool"], st["originals_alive"]) == (1, True, 0), (where, st)
        assert st["flats_in_pool"] == [True], where
        for m in st["members"]:
            assert m["data_in_pool"] and m["local_in_pool"] and m["wrapper_in_pool"], (where, m)
            assert m["wrapper_has_local_geometry"], (where, m)
            assert m["wrapper_python_shape"] == (rows, cols)  # the DTensor's global shape


def _trains_like_no_fusion(r: dict[str, Any]) -> None:
    ref = r["reference"]
    assert [s["loss"] for s in r["steps"]] == [s["loss"] for s in ref["steps"]]
    assert r["digests"] == ref["digests"]
    assert r["same_parameter_objects"]


def _inits(r: dict[str, Any]) -> int:
    return sum(1 for c in r["calls"] if c[0] == "init")


CASES = ["v1/eager/fp32", "v1/eager/bf16", "v1/to_empty/fp32", "v1/to_empty/bf16",
         "v1/local_assign/fp32", "v1/local_assign/bf16", "newest/eager/fp32", "newest/eager/bf16",
         "newest/to_empty/fp32", "newest/to_empty/bf16", "newest/local_assign/fp32",
         "newest/local_assign/bf16", "zero_copy/eager/fp32",
         "v1_newest_dtensor/local_assign/fp32", "newest/uneven/fp32",
         "newest_even_members/eager/fp32", "v1/empty_shard/fp32", "newest/empty_shard/fp32",
         "v1/member_1_moved/fp32", "newest/member_1_moved/fp32"]


@pytest.mark.parametrize("name", CASES)
def test_doc_lines_keep_one_pool_and_train_like_no_fusion(
        results: list[dict[str, Any]], name: str) -> None:
    import hp_hook_workers

    cfg, shape, moved = hp_hook_workers.cases()[name]
    for rank, r in enumerate(_ok(results, name)):
        _fused_every_step(r, cfg.rows, cfg.cols)
        _trains_like_no_fusion(r)
        # Built once, after the shards exist (V1 also tried once in __init__ while meta),
        # re-adopting once after a member moved; the validity verdict is true otherwise.
        expected = 1 + (cfg.group != "bucketed" and cfg.materialize != "eager") + (moved is not None)
        assert _inits(r) == expected, r["calls"]
        verdicts = [c[1][-1] for c in r["calls"] if c[0] == "valid"]
        assert verdicts.count(False) == (1 if cfg.group == "bucketed" or cfg.materialize != "eager"
                                         else 0) + (moved is not None), r["calls"]
        if cfg.param_dtype is not None and cfg.group != "bucketed":
            cast_dtype, cast_numel, flat_numel = r["steps"][-1]["cast"]
            assert cast_dtype == torch.bfloat16 and cast_numel == flat_numel
        else:
            assert r["steps"][-1]["cast"] is None
        if cfg.materialize != "eager" and cfg.group != "bucketed":
            assert r["after_init"]["adopted"] == [False] and "meta" in r["after_init"]["skipped"][0]
        if moved is not None:
            assert r["after_move"]["valid"] is False
            assert list(r["after_move"]["problems"][0]) == [1], r["after_move"]["problems"]
        if "empty_shard" in name and rank == 1:
            assert all(m["local_shape"] == (0, cfg.cols) for m in r["steps"][-1]["members"])


def test_report_case_one_8_mib_pool_per_rank(results: list[dict[str, Any]]) -> None:
    """Two 2048x1024 fp32 weights on 2 ranks, HyperParallel as shipped plus the V1 lines."""
    for r in _ok(results, "report/v1"):
        assert r["after_init"]["pool_bytes"] == [(8 * MiB, 8 * MiB)]
        assert (r["after_init"]["live"], r["after_init"]["live_bytes"]) == (1, 8 * MiB)
        _fused_every_step(r, 2048, 1024)
        assert [s["live_bytes"] for s in r["steps"]] == [8 * MiB] * len(r["steps"])
        assert all(m["local_shape"] == (1024, 1024) for m in r["steps"][-1]["members"])
        _trains_like_no_fusion(r)


def test_demo_rows(results: list[dict[str, Any]]) -> None:
    for per_rank in results:
        rows = per_rank["demo_rows"]
        assert not isinstance(rows, str), rows
        by_mode = {r.mode: r for r in rows}
        shipped = by_mode["HyperParallel as shipped"]
        assert (shipped.storages, shipped.stale, shipped.same_training) == (3, 2, True)
        fused = [r for r in rows if r.mode.startswith("flatpool")]
        assert len(fused) == 4
        for r in fused:
            assert r.checks == () and r.storages == 1 and r.stale == 0 and r.same_training, r


def test_demo_client_option() -> None:
    from examples import demo

    assert demo.parse([]).client == "fsdp2"
    assert demo.parse(["--client", "hyperparallel"]).client == "hyperparallel"
    with pytest.raises(SystemExit):
        demo.parse(["--client", "megatron"])
