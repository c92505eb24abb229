"""2-rank scenarios for test_hp_hook.py: the drop-in lines of docs/integration.md, executed as
written, inside the HyperParallel simulation's groups (V1 and newest), eager and after deferred
init, fp32 and ``param_dtype=bf16``; plus the demo's rows at a small size.

Every scenario returns plain data: a snapshot after the group is built, after lazy init, and
after every training step, with everything the tests assert (pool bytes vs capacity, where
each member's data, local tensor and Parameter wrapper sit, live storages, surviving
originals, the group's validity verdict and flatpool's diagnosis), and digests of the trained
shards. One spawned job runs them all; a scenario that raises is reported, not re-raised.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
from attrs import evolve

from flatpool import _torch_compat as tc
from examples import demo_hyperparallel
from flatpool.integrations.hsdp.validity import problems
from examples.hyperparallel_sim import (
    Config,
    FullyShardUnit,
    Originals,
    digest,
    live_storages,
    wrapper_local_geometry,
    wrapper_storage_key,
)

import hp_doc_lines

SMALL = Config(rows=64, cols=32)  # V1 group, routed setter, even members: as shipped
NEWEST = evolve(SMALL, group="bucketed", setter="rebind", flavor="padded")
REPORT = Config()  # two 2048x1024 fp32 weights


def _buffers(unit: FullyShardUnit) -> list[tuple[Any, list[Any]]]:
    """(GroupBuffers, its members) per flat buffer the doc lines made."""
    g = unit.group
    if hasattr(g, "all_gather_buckets"):
        return [(b._flatpool, b.hsdp_params) for b in g.all_gather_buckets
                if getattr(b, "_flatpool", None) is not None]
    fp = getattr(g, "_flatpool", None)
    return [] if fp is None else [(fp, unit.hsdp_params)]


def _geometry(t: torch.Tensor) -> tuple[int | None, tuple[int, ...], tuple[int, ...], int]:
    with tc.no_torch_function():
        key = None if tc.impl_is_meta(t) else tc.storage_address(t)
        return key, tuple(tc.impl_size(t)), tuple(tc.impl_stride(t)), tc.impl_storage_offset(t)


def snapshot(unit: FullyShardUnit, originals: Originals | None = None) -> dict[str, Any]:
    bufs = _buffers(unit)
    pools = [p for b, _ in bufs if b.adopted for p in b.pools()]
    keys = {p.storage_key for p in pools}
    members = []
    for p in unit.hsdp_params:
        data, local = _geometry(p._sharded_param_data), _geometry(p._sharded_local_tensor)
        wkey = wrapper_storage_key(p.sharded_param)
        wgeom = None if wkey is None else wrapper_local_geometry(p.sharded_param)
        members.append({
            "data_in_pool": data[0] in keys, "local_in_pool": local[0] in keys,
            "wrapper_in_pool": wkey in keys,
            "wrapper_has_local_geometry": wgeom == (local[1], local[2], local[3]),
            "wrapper_python_shape": tuple(p.sharded_param.shape), "local_shape": local[1],
        })
    cast = getattr(unit.group, "_flat_cast_buffer", None)
    cast_key = None if cast is None else tc.storage_address(cast)
    live = [r for r in live_storages(unit) if r.key != cast_key]  # shard storages only
    flats = unit.flat_buffers()
    out: dict[str, Any] = {
        "adopted": [b.adopted for b, _ in bufs],
        "skipped": [b.skipped for b, _ in bufs],
        "pool_bytes": [(p.storage.nbytes(), p.capacity) for p in pools],
        "valid": unit.is_valid(),
        "problems": [problems(b, ps) for b, ps in bufs if b.adopted],
        "members": members,
        "live": len(live), "live_bytes": sum(r.nbytes for r in live),
        "live_in_pool": all(r.key in keys for r in live),
        "flats_in_pool": [tc.storage_address(f) in keys for f in flats if f is not cast],
        "cast": None if cast is None else (cast.dtype, cast.numel(), flats[0].numel()),
    }
    if originals is not None:
        out["originals_alive"] = len(originals.alive())
    return out


def _move_member_1(unit: FullyShardUnit) -> None:
    """What ``load_state_dict`` + ``reset_sharded_param`` do to a later member: new values on a
    new storage for its data and local tensor (HyperParallel's check looks at member 0 only)."""
    p = unit.hsdp_params[1]
    with torch.no_grad():
        fresh = p._sharded_local_tensor.detach().clone() + 0.5
    fresh.requires_grad_(p.sharded_param.requires_grad)
    p.sharded_param._local_tensor = fresh  # type: ignore[attr-defined]
    p.reset_sharded_param()


def scenario(cfg: Config, hooks: dict[str, Any], steps: int = 2,
             move_after: int | None = None) -> dict[str, Any]:
    res: dict[str, Any] = {"error": None, "steps": []}
    try:
        unit = FullyShardUnit(cfg, **hooks)
        res["after_init"] = snapshot(unit)
        originals = unit.originals
        if cfg.materialize != "eager":
            unit.materialize()
            unit.lazy_init()
            originals = Originals.of(unit)
            res["after_lazy_init"] = snapshot(unit)
        opt = unit.make_optimizer()
        ids = [id(q) for q in unit.module.parameters()]
        for s in range(steps):
            if move_after is not None and s == move_after:
                _move_member_1(unit)
                res["after_move"] = snapshot(unit)
                # The moved member's new storages must die too (the pool itself stays).
                pools = {p.storage_key for b, _ in _buffers(unit) if b.adopted for p in b.pools()}
                originals = Originals.of(unit)
                originals.refs = [r for r in originals.refs if r[2] not in pools]
            loss = unit.train_step(s, opt)
            res["steps"].append(dict(loss=loss, **snapshot(unit, originals)))
        res["same_parameter_objects"] = ids == [id(q) for q in unit.module.parameters()] and \
            ids == [id(p.sharded_param) for p in unit.hsdp_params]
        res["digests"] = [digest(t) for t in unit.local_values()]
        res["calls"] = list(getattr(unit.group, "calls", []))
    except Exception:
        res["error"] = traceback.format_exc()
    return res


def cases() -> dict[str, tuple[Config, str, int | None]]:
    """name -> (config, doc shape, step before which member 1 is moved)."""
    out: dict[str, tuple[Config, str, int | None]] = {}
    for mat in ("eager", "to_empty", "local_assign"):
        for dtype in (None, torch.bfloat16):
            tag = "bf16" if dtype else "fp32"
            out[f"v1/{mat}/{tag}"] = (evolve(SMALL, materialize=mat, param_dtype=dtype), "v1", None)
            out[f"newest/{mat}/{tag}"] = (evolve(NEWEST, materialize=mat, param_dtype=dtype),
                                          "newest", None)
    out["zero_copy/eager/fp32"] = (evolve(SMALL, group="zero_copy"), "v1", None)
    out["v1_newest_dtensor/local_assign/fp32"] = (
        evolve(SMALL, setter="rebind", flavor="padded", materialize="local_assign"), "v1", None)
    out["newest/uneven/fp32"] = (evolve(NEWEST, rows=63), "newest", None)
    out["newest_even_members/eager/fp32"] = (evolve(NEWEST, flavor="even"), "newest", None)
    out["v1/empty_shard/fp32"] = (evolve(SMALL, rows=1, flavor="padded"), "v1", None)
    out["newest/empty_shard/fp32"] = (evolve(NEWEST, rows=1), "newest", None)
    out["v1/member_1_moved/fp32"] = (evolve(SMALL, flavor="padded", rows=63), "v1", 1)
    out["newest/member_1_moved/fp32"] = (NEWEST, "newest", 1)
    return out


def run_all() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (cfg, shape, move) in cases().items():
        out[name] = scenario(cfg, hp_doc_lines.hooks(shape), move_after=move)
        out[name]["reference"] = scenario(evolve(cfg, group="none"), {}, move_after=move)
    out["report/v1"] = scenario(REPORT, hp_doc_lines.hooks("v1"), steps=3)
    out["report/v1"]["reference"] = scenario(evolve(REPORT, group="none"), {}, steps=3)
    try:
        out["demo_rows"] = demo_hyperparallel.rank_rows(64, 32, 2)
    except Exception:
        out["demo_rows"] = traceback.format_exc()
    return out


__all__ = ["REPORT", "cases", "run_all", "scenario", "snapshot"]
