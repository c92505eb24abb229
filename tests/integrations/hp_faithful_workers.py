"""2-rank scenarios for test_hp_faithful.py: HyperParallel as shipped, newest, and under meta.

Every scenario returns plain data (picklable) that the tests assert on; one spawned job runs
them all. A scenario that raises is reported, not re-raised, so the others still run (the
simulation raises on every rank together, see ``hyperparallel_sim.group.agreed``).
"""

from __future__ import annotations

import time
import traceback
from typing import Any

import torch
from attrs import evolve

from examples.hyperparallel_sim import Config, FullyShardUnit, measure
from examples.hyperparallel_sim.dtensor import wrapper_storage_key

REPORT = Config()  # two 2048x1024 fp32 weights: HyperParallel as shipped before the fix
NEWEST = Config(group="bucketed", setter="rebind", flavor="padded")
SMALL = Config(rows=64, cols=32)  # as shipped, small


def _upstream_alias_assert(unit: FullyShardUnit) -> bool:
    """The newest defer-init test's check: data, local tensor *and* wrapper alias the flat buffer."""
    flats = unit.flat_buffers()
    if not flats:
        return False
    key = int(flats[0].untyped_storage()._cdata)
    for p in unit.hsdp_params:
        if int(p._sharded_param_data.untyped_storage()._cdata) != key:
            return False
        if int(p.sharded_param._local_tensor.untyped_storage()._cdata) != key:  # type: ignore[attr-defined]
            return False
        if wrapper_storage_key(p.sharded_param) != key:
            return False
    return True


def _scenario(cfg: Config, steps: int = 2, **kw: Any) -> dict[str, Any]:
    """``hyperparallel_sim.measure`` plus the upstream alias assertion and the cast buffer, if any."""
    unit = FullyShardUnit(cfg, **kw)
    res = measure(unit, steps)
    res["upstream_alias_assert"] = _upstream_alias_assert(unit)
    cast = getattr(unit.group, "_flat_cast_buffer", None)
    res["cast_buffer"] = None if cast is None else (cast.dtype, cast.numel())
    flats = unit.flat_buffers()
    res["flat_numel"] = flats[0].numel() if flats else None
    return res


def _hook_calls() -> dict[str, Any]:
    """A hook plugged in through the constructor sees the calls at HyperParallel's points."""
    from examples.hyperparallel_sim.group import AllGatherBucket, HSDPParamGroupV1

    seen: list[str] = []

    def v1_init(group: Any) -> None:
        seen.append("v1.init")
        HSDPParamGroupV1._init_flat_param_buffer(group)

    def v1_valid(group: Any) -> bool:
        seen.append("v1.valid")
        return HSDPParamGroupV1._is_flat_buffer_valid(group)

    def b_init(bucket: Any, device: Any) -> None:
        seen.append("bucket.init")
        AllGatherBucket.init_flat_param_buffer(bucket, device)

    def b_valid(bucket: Any) -> bool:
        seen.append("bucket.valid")
        return AllGatherBucket.is_flat_buffer_valid(bucket)

    out: dict[str, Any] = {}
    r = _scenario(SMALL, init_flat=v1_init, is_valid=v1_valid)
    out["v1"] = (list(seen), r["calls"], r["error"])
    seen.clear()
    r = _scenario(evolve(NEWEST, rows=64, cols=32), init_flat=b_init, is_valid=b_valid)
    out["bucketed"] = (list(seen), r["calls"], r["error"])
    return out


def run_all() -> dict[str, Any]:
    scenarios: dict[str, tuple[Config, dict[str, Any]]] = {
        "report/as_shipped": (REPORT, {}),
        "report/unfused": (evolve(REPORT, group="none"), {}),
        "report/newest": (NEWEST, {}),
        "meta_to_empty/as_shipped": (evolve(SMALL, materialize="to_empty"), {}),
        "meta_to_empty/unfused": (evolve(SMALL, group="none", materialize="to_empty"), {}),
        "meta_local_assign/as_shipped": (evolve(SMALL, materialize="local_assign"), {}),
        "meta_to_empty/newest": (evolve(NEWEST, materialize="to_empty", rows=64, cols=32), {}),
        "meta_local_assign/newest": (evolve(NEWEST, materialize="local_assign", rows=64, cols=32), {}),
        "bf16/as_shipped": (evolve(SMALL, param_dtype=torch.bfloat16), {}),
        "bf16/newest": (evolve(NEWEST, param_dtype=torch.bfloat16, rows=64, cols=32), {}),
        "uneven/newest": (evolve(NEWEST, rows=63, cols=32), {}),
        "uneven/unfused": (Config(group="none", flavor="padded", rows=63, cols=32), {}),
        "even_members/bucketed": (evolve(SMALL, group="bucketed", setter="rebind"), {}),
        "rules_sgd/as_shipped": (evolve(SMALL, dispatch="rules", optimizer="sgd"), {}),
        "skip_sgd/as_shipped": (evolve(SMALL, optimizer="sgd"), {}),
        "rules_adam/as_shipped": (evolve(SMALL, dispatch="rules"), {}),
        "zero_copy/as_shipped": (evolve(SMALL, group="zero_copy"), {}),
        "small/unfused": (evolve(SMALL, group="none"), {}),
    }
    out: dict[str, Any] = {}
    for name, (cfg, kw) in scenarios.items():
        t0 = time.perf_counter()
        try:
            out[name] = _scenario(cfg, **kw)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
        out[name]["seconds"] = time.perf_counter() - t0
    try:
        out["hook_calls"] = _hook_calls()
    except Exception:
        out["hook_calls"] = {"error": traceback.format_exc()}
    return out


__all__ = ["NEWEST", "REPORT", "SMALL", "run_all"]
