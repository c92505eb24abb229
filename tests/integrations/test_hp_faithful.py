"""The HyperParallel simulation (examples.hyperparallel_sim): it is hostile where HyperParallel is, and it reproduces
HyperParallel as shipped (the bug report) and its newest upstream behaviour, eager and meta.

Single-process tests exercise the DTensor and the member; the 2-rank tests share one spawned
gloo job (``hp_jobs.run_all``, with test_hp_hook.py) and check each scenario on both ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from examples.hyperparallel_sim.dtensor import (
    HPDTensorRebind,
    HPDTensorRouted,
    LayoutInferError,
    ShardLayout,
    dtensor_class,
    skip_dtensor_dispatch,
    wrapper_local_geometry,
    wrapper_own_values,
    wrapper_storage_key,
)
from examples.hyperparallel_sim.param import HSDPParam, ShardMesh

LAYOUT = ShardLayout(world=2, shard_dim=0, global_shape=(8, 3))
NO_RULE = "dose not contain parallel layout infer func"


def _key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


def _param(cls: type = HPDTensorRouted) -> nn.Parameter:
    return nn.Parameter(cls(torch.arange(12.0).view(4, 3), LAYOUT))


# ---- the DTensor ---------------------------------------------------------------------------
def test_python_shape_is_global_while_the_tensorimpl_is_local() -> None:
    p = _param()
    assert tuple(p.shape) == (8, 3) and tuple(p.size()) == (8, 3) and p.size(0) == 8
    assert p.numel() == 24 and tuple(p.local_shape) == (4, 3)
    assert wrapper_local_geometry(p) == ((4, 3), (3, 1), 0)


@pytest.mark.parametrize("op", [
    lambda w: torch.Tensor.data_ptr(w),
    lambda w: torch._C.TensorBase.data_ptr(w),
    lambda w: w.untyped_storage(),
    lambda w: torch._C.TensorBase.size(w),
    lambda w: torch._C.TensorBase.stride(w),
    lambda w: w.sum(),
    lambda w: w @ w.T,
], ids=["Tensor.data_ptr", "TensorBase.data_ptr", "untyped_storage", "TensorBase.size",
        "TensorBase.stride", "sum", "matmul"])
@pytest.mark.parametrize("cls", [HPDTensorRouted, HPDTensorRebind], ids=["routed", "rebind"])
def test_ops_without_a_layout_rule_raise(cls: type, op: Any) -> None:
    with pytest.raises(LayoutInferError, match=NO_RULE):
        op(_param(cls))


def test_data_ptr_override_answers_for_the_local_tensor_not_the_wrapper() -> None:
    p = _param()
    new = torch.zeros(4, 3)
    p._local_tensor = new
    p.data = new  # routed: lands on the local tensor
    assert p.data_ptr() == new.data_ptr()  # what HyperParallel's override says ...
    with torch._C.DisableTorchFunctionSubclass():
        assert p.untyped_storage().data_ptr() != new.data_ptr()  # ... and where the wrapper is
    strict = nn.Parameter(dtensor_class("routed", "dispatch")(torch.ones(4, 3), LAYOUT))
    with pytest.raises(LayoutInferError, match="Operator data_ptr " + NO_RULE):
        strict.data_ptr()


def test_skip_dispatch_makes_storage_queries_answer_for_the_local_tensor() -> None:
    p = _param()
    other = torch.zeros(4, 3)
    p._local_tensor = other  # wrapper and local now on different storages
    with skip_dtensor_dispatch():
        assert _key(p) == _key(other)
        assert torch.Tensor.data_ptr(p) == other.data_ptr()
    assert wrapper_storage_key(p) != _key(other)


def test_getters_route_to_the_local_tensor() -> None:
    meta_wrapper = nn.Parameter(HPDTensorRouted(torch.empty(4, 3, device="meta"), LAYOUT))
    meta_wrapper._local_tensor = torch.zeros(4, 3, requires_grad=True)
    assert meta_wrapper.is_meta is False and meta_wrapper.device.type == "cpu"  # the local's
    assert wrapper_storage_key(meta_wrapper) is None  # the wrapper itself is still meta


def test_rule_ops_run_on_the_local_tensor_and_rewrap() -> None:
    p = _param()
    before = wrapper_own_values(p).clone()
    with torch.no_grad():
        out = p.add_(torch.ones(4, 3))
    assert out is p and torch.equal(p._local_tensor, before + 1)
    assert torch.equal(wrapper_own_values(p), before + 1)  # shared storage: wrapper sees it
    e = torch.empty_like(p)
    assert type(e) is type(p) and tuple(e.shape) == (8, 3) and tuple(e.local_shape) == (4, 3)
    assert p.requires_grad_(False) is p and not p._local_tensor.requires_grad


def test_routed_data_setter_leaves_the_wrapper_on_its_old_storage() -> None:
    p = _param(HPDTensorRouted)
    old = wrapper_storage_key(p)
    new = torch.full((4, 3), 7.0)
    p._local_tensor = new
    p.data = new
    assert wrapper_storage_key(p) == old != _key(new)
    assert torch.equal(wrapper_own_values(p), torch.arange(12.0).view(4, 3))  # stale


def test_rebinding_data_setter_moves_wrapper_and_local() -> None:
    p = _param(HPDTensorRebind)
    flat = torch.arange(24.0)
    view = flat.narrow(0, 12, 12).view(4, 3)
    p._local_tensor = view
    p.data = view
    assert wrapper_storage_key(p) == _key(flat)
    assert wrapper_local_geometry(p) == ((4, 3), (3, 1), 12)


def test_rebinding_setter_refuses_a_meta_wrapper() -> None:
    p = nn.Parameter(HPDTensorRebind(torch.empty(4, 3, device="meta"), LAYOUT))
    with pytest.raises(RuntimeError, match="incompatible tensor type"):
        p.data = torch.zeros(4, 3)


def test_storage_less_wrapper_branch_swaps_only_the_local() -> None:
    local = torch.zeros(4, 3)
    w = HPDTensorRebind.storage_less(local, LAYOUT)
    new = torch.ones(4, 3)
    w.data = new
    assert w._local_tensor is new and wrapper_storage_key(w) is None
    with pytest.raises(ValueError, match="dtype"):
        w.data = torch.ones(4, 3, dtype=torch.float64)


def test_parameter_of_a_dtensor_is_a_detached_wrapper_on_the_same_storage() -> None:
    local = torch.zeros(4, 3)
    p = nn.Parameter(HPDTensorRouted(local, LAYOUT))
    assert type(p) is HPDTensorRouted and isinstance(p, nn.Parameter)
    assert p._local_tensor is not local and p._local_tensor._base is None
    assert wrapper_storage_key(p) == _key(local) == _key(p._local_tensor)


def test_only_the_newest_generation_is_a_traceable_wrapper() -> None:
    assert not is_traceable_wrapper_subclass(_param(HPDTensorRouted))
    assert is_traceable_wrapper_subclass(_param(HPDTensorRebind))


# ---- the member ----------------------------------------------------------------------------
def _member(rows: int, rank: int, flavor: str) -> HSDPParam:
    module = nn.Linear(3, rows, bias=False)
    return HSDPParam(module, "weight", ShardMesh(None, 2, rank), dtensor_cls=HPDTensorRouted,
                     flavor=flavor)  # type: ignore[arg-type]


def test_even_member_rejects_uneven_rows_and_has_no_padded_size() -> None:
    with pytest.raises(NotImplementedError, match="Uneven sharding"):
        _member(7, 0, "even")
    m = _member(8, 1, "even")
    assert not hasattr(m, "padded_sharded_param_size") and m.sharded_size == (4, 3)
    assert m.module.weight is m.sharded_param and tuple(m.sharded_param.shape) == (8, 3)
    assert _key(m._sharded_param_data) == wrapper_storage_key(m.sharded_param)


def test_padded_member_on_a_trailing_rank() -> None:
    m = _member(7, 1, "padded")
    assert m.sharded_size == (3, 3) and m.padded_sharded_param_size == (4, 3)
    assert m._sharded_param_data.numel() == 12
    local = m.sharded_param._local_tensor
    assert tuple(local.shape) == (3, 3) and _key(local) == _key(m._sharded_param_data)
    assert wrapper_local_geometry(m.sharded_param) == ((3, 3), (3, 1), 0)


# ---- 2 ranks -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results(hp_job: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [per_rank["faithful"] for per_rank in hp_job]


def _each(results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    rows = [r[name] for r in results]
    for rank, r in enumerate(rows):
        assert "Traceback" not in str(r.get("error")), f"rank {rank}: {r['error']}"
    return rows


SHARD = 32 * 32 * 4  # bytes of one small shard
MiB = 1 << 20


def test_as_shipped_report_case_keeps_both_old_shards_alive(results: list[dict[str, Any]]) -> None:
    for r, ref in zip(_each(results, "report/as_shipped"), _each(results, "report/unfused")):
        assert r["error"] is None
        c = r["after_fully_shard"]
        assert (c["live"], c["live_mib"], c["valid"]) == (3, 16.0, True)
        assert (c["originals_alive"], c["originals_held_by_wrappers"]) == (2, 2)
        assert [row[0] for row in c["rows"]] == [8.0, 4.0, 4.0]
        assert c["rows"][1][1] == ("w1.wrapper",) and c["rows"][2][1] == ("w2.wrapper",)
        t = r["after_training"]
        assert (t["live"], t["live_mib"], t["valid"]) == (3, 16.0, True)
        assert t["stale_wrappers"] == [True, True]  # the Parameter reads pre-training values
        assert [w["shape"] for w in t["wrappers"]] == [(2048, 1024)] * 2
        assert [w["impl_geometry"][0] for w in t["wrappers"]] == [(1024, 1024)] * 2
        assert r["upstream_alias_assert"] is False
        # Training itself is right: the optimizer steps the local tensors (in the flat buffer).
        assert r["losses"] == ref["losses"] and r["locals_sha256"] == ref["locals_sha256"]


def test_newest_upstream_frees_the_old_shards(results: list[dict[str, Any]]) -> None:
    for r, ref in zip(_each(results, "report/newest"), _each(results, "report/unfused")):
        assert r["error"] is None
        t = r["after_training"]
        assert (t["live"], t["live_mib"], t["originals_alive"]) == (1, 8.0, 0)
        assert t["stale_wrappers"] == [False, False] and r["upstream_alias_assert"] is True
        assert t["wrappers"][1]["impl_geometry"] == ((1024, 1024), (1024, 1), 1024 * 1024)
        assert r["losses"] == ref["losses"] and r["locals_sha256"] == ref["locals_sha256"]


def test_meta_to_empty_as_shipped_pins_the_materialized_storages(
        results: list[dict[str, Any]]) -> None:
    for r, ref in zip(_each(results, "meta_to_empty/as_shipped"),
                      _each(results, "meta_to_empty/unfused")):
        assert r["error"] is None
        assert r["after_fully_shard"]["live"] == 0  # all meta: the group skipped its buffer
        assert r["calls"] == [("init", "__init__"), ("valid", ("foreach_all_gather", False)),
                              ("init", "foreach_all_gather"),
                              ("valid", ("foreach_all_gather", True))]
        t = r["after_training"]
        assert (t["live"], t["originals_alive"], t["originals_held_by_wrappers"]) == (3, 2, 2)
        assert t["live_mib"] * MiB == 4 * SHARD and t["stale_wrappers"] == [True, True]
        assert r["upstream_alias_assert"] is False
        assert r["locals_sha256"] == ref["locals_sha256"]


def test_meta_local_assign_as_shipped_leaves_a_storageless_wrapper(
        results: list[dict[str, Any]]) -> None:
    for r, ref in zip(_each(results, "meta_local_assign/as_shipped"),
                      _each(results, "meta_to_empty/unfused")):
        assert r["error"] is None
        t = r["after_training"]
        assert (t["live"], t["originals_alive"]) == (1, 0) and t["live_mib"] * MiB == 2 * SHARD
        assert [w["meta"] for w in t["wrappers"]] == [True, True]
        assert r["upstream_alias_assert"] is False  # the wrapper has no storage to alias
        assert r["locals_sha256"] == ref["locals_sha256"]


def test_meta_newest(results: list[dict[str, Any]]) -> None:
    for r in _each(results, "meta_to_empty/newest"):
        assert r["error"] is None and r["upstream_alias_assert"] is True
        assert r["after_training"]["live"] == 1
    for r in _each(results, "meta_local_assign/newest"):
        # The rebinding setter cannot rebind a meta wrapper: it raises half-way, after member 0
        # was moved into a flat buffer the bucket never recorded; member 1 is untouched.
        assert "incompatible tensor type" in r["error"]
        e = r["at_error"]
        assert e["live"] == 2 and e["live_mib"] * MiB == 3 * SHARD
        assert sorted(e["rows"])[1] == (2 * SHARD / MiB, ("w1.data", "w1.local"))
        assert r["calls"] == [("valid", (0, "before_init", False)), ("init", 0)]


def test_bf16_param_dtype(results: list[dict[str, Any]]) -> None:
    for old, new in zip(_each(results, "bf16/as_shipped"), _each(results, "bf16/newest")):
        assert old["error"] is None and new["error"] is None
        assert old["cast_buffer"] == (torch.bfloat16, old["flat_numel"])  # V1 keeps one
        assert new["cast_buffer"] is None  # the newest casts per all-gather
        assert old["after_fully_shard"]["live"] == 4  # 2 old shards + flat + cast buffer
        assert old["locals_sha256"] == new["locals_sha256"]


def test_uneven_rows_newest_matches_unfused(results: list[dict[str, Any]]) -> None:
    for r, ref in zip(_each(results, "uneven/newest"), _each(results, "uneven/unfused")):
        assert r["error"] is None and r["upstream_alias_assert"] is True
        assert r["locals_sha256"] == ref["locals_sha256"] and r["losses"] == ref["losses"]


def test_bucketed_group_needs_padded_sharded_param_size(results: list[dict[str, Any]]) -> None:
    for r in _each(results, "even_members/bucketed"):
        assert "padded_sharded_param_size" in r["error"]


def test_layout_rules_train_like_skip_dispatch(results: list[dict[str, Any]]) -> None:
    for a, b in zip(_each(results, "rules_sgd/as_shipped"), _each(results, "skip_sgd/as_shipped")):
        assert a["error"] is None and a["locals_sha256"] == b["locals_sha256"]
    for a, b in zip(_each(results, "rules_adam/as_shipped"), _each(results, "small/unfused")):
        assert a["error"] is None and a["locals_sha256"] == b["locals_sha256"]


def test_zero_copy_flag_shape_behaves_like_v1(results: list[dict[str, Any]]) -> None:
    for zc, v1 in zip(_each(results, "zero_copy/as_shipped"), _each(results, "small/unfused")):
        assert zc["error"] is None and zc["after_training"]["live"] == 3
        assert zc["calls"][0] == ("init", "__init__")
        assert zc["locals_sha256"] == v1["locals_sha256"]


def test_hooks_replace_the_flat_buffer_methods(results: list[dict[str, Any]]) -> None:
    for r in _each(results, "hook_calls"):
        seen, calls, err = r["v1"]
        assert err is None and seen[0] == "v1.init" and seen.count("v1.init") == 1
        assert seen.count("v1.valid") >= sum(1 for c in calls if c[0] == "valid")
        seen, calls, err = r["bucketed"]
        assert err is None and seen[:2] == ["bucket.valid", "bucket.init"]
        assert calls[:3] == [("valid", (0, "before_init", False)), ("init", 0),
                             ("valid", (0, "before_use", True))]
