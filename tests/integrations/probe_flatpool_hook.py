"""Probe: plug the *current* docs/integration.md hook into the faithful HyperParallel double.

Not a test (pytest does not collect it; it runs only as a script). It runs 2 gloo ranks and
prints, per scenario and rank: errors, live storages and MiB, pool storage bytes vs capacity,
the Parameter wrapper's own geometry and storage, the hook's validity verdict next to the
truth at every step, and whether training matches the unfused run.

    .venv/bin/python tests/integrations/probe_flatpool_hook.py [--rows 64 --cols 32 --steps 3]

Scenarios: group shape (V1 one-buffer, newest bucketed) x DTensor generation (routed setter,
rebinding setter with ``__tensor_flatten__``) x materialization (eager, ``to_empty``,
``_local_tensor`` assignment), plus bf16 ``param_dtype`` and uneven rows.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from flatpool.integrations.hsdp.hyperparallel_sim import (  # noqa: E402
    Config,
    FullyShardUnit,
    HSDPParamGroupV1,
    MiB,
    Originals,
    census,
    digest,
)
from flatpool.integrations.hsdp.hyperparallel_sim.dtensor import wrapper_local_geometry, wrapper_storage_key  # noqa: E402
from flatpool.integrations.hsdp.hyperparallel_sim.group import agreed  # noqa: E402


# ---- the hook, as docs/integration.md writes it (V1 group: methods of the group) -----------
def doc_init_flat_param_buffer(self: Any) -> None:
    from flatpool.integrations.hsdp.group import adopt_group
    from flatpool.integrations.hsdp.validity import readopt_group

    if self._flat_buffers is not None and self._flat_buffers.adopted:   # lazy re-validation
        readopt_group(self._flat_buffers, self.hsdp_params)
    else:
        self._flat_buffers = adopt_group(self.hsdp_params, device=self.device,
                                         world_size=self.shard_world_size, name="hsdp")
    self._flat_param_buffer = (self._flat_buffers.flats()[0]      # one bucket: uniform dtype
                               if self._flat_buffers.adopted else None)


def doc_is_flat_buffer_valid(self: Any) -> bool:
    from flatpool.integrations.hsdp.validity import is_valid

    return self._flat_buffers is not None and is_valid(self._flat_buffers, self.hsdp_params)


def disabled_is_flat_buffer_valid(self: Any) -> bool:
    """The doc's validity line, run under DisableTorchFunctionSubclass (a probe-only patch)."""
    with torch._C.DisableTorchFunctionSubclass():
        return doc_is_flat_buffer_valid(self)


def disabled_bucket_is_flat_buffer_valid(self: Any) -> bool:
    with torch._C.DisableTorchFunctionSubclass():
        return bucket_is_flat_buffer_valid(self)


class V1WithBuffersAttr(HSDPParamGroupV1):
    """The doc lines read ``self._flat_buffers`` before anything set it: give it a None first."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._flat_buffers = None
        super().__init__(*args, **kwargs)


# ---- the same lines adapted to the newest shape (methods of an AllGatherBucket) -------------
def bucket_init_flat_param_buffer(self: Any, device: Any) -> None:
    from flatpool.integrations.hsdp.group import adopt_group
    from flatpool.integrations.hsdp.validity import readopt_group

    buffers = self.extra.get("buffers")
    if buffers is not None and buffers.adopted:
        readopt_group(buffers, self.hsdp_params)
    else:
        buffers = self.extra["buffers"] = adopt_group(
            self.hsdp_params, device=device, world_size=self.shard_world_size, name="hsdp")
    self.flat_param_buffer = buffers.flats()[0] if buffers.adopted else None


def bucket_is_flat_buffer_valid(self: Any) -> bool:
    from flatpool.integrations.hsdp.validity import is_valid

    buffers = self.extra.get("buffers")
    return buffers is not None and is_valid(buffers, self.hsdp_params)


# ---- measuring ------------------------------------------------------------------------------
def _group_buffers(unit: FullyShardUnit) -> list[Any]:
    g = unit.group
    if hasattr(g, "all_gather_buckets"):
        return [b.extra.get("buffers") for b in g.all_gather_buckets if b.extra.get("buffers")]
    fb = getattr(g, "_flat_buffers", None)
    return [fb] if fb is not None else []


def _truth(unit: FullyShardUnit) -> dict[str, Any]:
    """Do data, local tensor and wrapper of every member sit on a pool's storage?"""
    pools = [b.pool for gb in _group_buffers(unit) if gb.adopted for b in gb.buckets]
    keys = {int(p.storage._cdata) for p in pools if p.is_materialized}
    rows = []
    for p in unit.hsdp_params:
        with torch._C.DisableTorchFunctionSubclass():
            data = int(p._sharded_param_data.untyped_storage()._cdata) in keys
            local = int(p.sharded_param._local_tensor.untyped_storage()._cdata) in keys
        wkey = wrapper_storage_key(p.sharded_param)
        geom = None if wkey is None else wrapper_local_geometry(p.sharded_param)
        rows.append({"data": data, "local": local,
                     "wrapper": "meta" if wkey is None else wkey in keys, "wrapper_geom": geom})
    pool_rows = [{"name": p.name, "storage_nbytes": p.storage.nbytes() if p.is_materialized else None,
                  "capacity": p.capacity} for p in pools]
    return {"members": rows, "pools": pool_rows}


def _safe(fn: Any) -> Any:
    try:
        return fn()
    except Exception as e:
        return f"!{type(e).__name__}: {e}"


def scenario(cfg: Config, steps: int, **unit_kwargs: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"steps": [], "error": None}
    unit: FullyShardUnit | None = None
    try:
        unit = agreed("construct", lambda: FullyShardUnit(cfg, **unit_kwargs))
        assert unit is not None
        originals = unit.originals
        if cfg.materialize != "eager":
            agreed("materialize", unit.materialize)
            agreed("lazy_init", unit.lazy_init)
            originals = Originals.of(unit)
        opt = unit.make_optimizer()
        for s in range(steps):
            loss = unit.train_step(s, opt)
            c = census(unit, originals)
            out["steps"].append({
                "loss": loss, "hook_valid": _safe(unit.is_valid), "truth": _safe(lambda: _truth(unit)),
                "live": c["live"], "live_mib": c["live_mib"], "originals_alive": c["originals_alive"],
                "stale_wrappers": c["stale_wrappers"]})
        out["locals"] = [digest(t) for t in unit.local_values()]
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
        frames = [f for f in traceback.extract_tb(e.__traceback__)
                  if not f.filename.endswith(("hyperparallel_sim/dtensor.py", "hyperparallel_sim/group.py"))
                  or f.name not in ("__torch_function__", "agreed")]
        out["where"] = [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}: {f.line}"
                        for f in frames[-2:]]
    if unit is not None:
        out["calls"] = list(getattr(unit.group, "calls", []))
        out["final"] = _safe(lambda: census(unit))
        out["skipped"] = [gb.skipped for gb in _group_buffers(unit)]
    return out


V1_HOOK = {"init_flat": doc_init_flat_param_buffer, "is_valid": doc_is_flat_buffer_valid}
B_HOOK = {"init_flat": bucket_init_flat_param_buffer, "is_valid": bucket_is_flat_buffer_valid}


def scenarios(rows: int, cols: int) -> list[tuple[str, Config, dict[str, Any]]]:
    s = {"rows": rows, "cols": cols}
    out: list[tuple[str, Config, dict[str, Any]]] = []
    out.append(("v1/routed/eager verbatim doc lines", Config(**s), dict(V1_HOOK)))
    out.append(("v1/routed/eager (even-only members)", Config(**s),
                dict(V1_HOOK, group_cls=V1WithBuffersAttr)))
    for setter in ("routed", "rebind"):
        for mat in ("eager", "to_empty", "local_assign"):
            out.append((f"v1/{setter}/{mat} padded members",
                        Config(setter=setter, materialize=mat, flavor="padded", **s),
                        dict(V1_HOOK, group_cls=V1WithBuffersAttr)))
    out.append(("v1/routed/eager bf16 padded members",
                Config(param_dtype=torch.bfloat16, flavor="padded", **s),
                dict(V1_HOOK, group_cls=V1WithBuffersAttr)))
    for setter in ("rebind", "routed"):
        for mat in ("eager", "to_empty", "local_assign"):
            out.append((f"bucketed/{setter}/{mat}",
                        Config(group="bucketed", setter=setter, flavor="padded", materialize=mat,
                               **s), dict(B_HOOK)))
    pv1 = dict(V1_HOOK, group_cls=V1WithBuffersAttr, is_valid=disabled_is_flat_buffer_valid)
    pb = dict(B_HOOK, is_valid=disabled_bucket_is_flat_buffer_valid)
    patched = " [PATCH: validity under DisableTorchFunctionSubclass]"
    out.append(("v1/routed/eager padded members" + patched, Config(flavor="padded", **s), pv1))
    out.append(("v1/routed/to_empty padded members" + patched,
                Config(flavor="padded", materialize="to_empty", **s), pv1))
    out.append(("v1/routed/eager bf16 padded members" + patched,
                Config(flavor="padded", param_dtype=torch.bfloat16, **s), pv1))
    for mat in ("eager", "to_empty"):
        out.append((f"bucketed/routed/{mat}" + patched,
                    Config(group="bucketed", flavor="padded", materialize=mat, **s), pb))
    out.append(("bucketed/routed/eager uneven rows" + patched,
                Config(group="bucketed", flavor="padded", rows=rows - 1, cols=cols), pb))
    out.append(("bucketed/routed/eager bf16" + patched,
                Config(group="bucketed", flavor="padded", param_dtype=torch.bfloat16, **s), pb))
    out.append(("bucketed/rebind/eager uneven rows",
                Config(group="bucketed", setter="rebind", flavor="padded", rows=rows - 1, cols=cols),
                dict(B_HOOK)))
    out.append(("bucketed/rebind/eager bf16",
                Config(group="bucketed", setter="rebind", flavor="padded",
                       param_dtype=torch.bfloat16, **s), dict(B_HOOK)))
    return out


def worker(rows: int, cols: int, steps: int, only: str = "") -> dict[str, Any]:
    res: dict[str, Any] = {}
    for name, cfg, kw in scenarios(rows, cols):
        if only not in name:
            continue
        res[name] = scenario(cfg, steps, **kw)
        ref = scenario(_reference(cfg), steps)
        got = res[name]
        if got.get("locals") is not None and ref.get("locals") is not None:
            got["matches_unfused"] = (
                [x["loss"] for x in got["steps"]] == [x["loss"] for x in ref["steps"]]
                and got["locals"] == ref["locals"])
        got.pop("locals", None)
    return res


def _reference(cfg: Config) -> Config:
    from attrs import evolve

    return evolve(cfg, group="none")


def _fmt_rank(rank: int, r: dict[str, Any]) -> str:
    err = r["error"].splitlines()[0] if r["error"] else None
    lines = [f"  rank {rank}: " + (f"ERROR {err}" if err else "ok")
             + f"  matches_unfused={r.get('matches_unfused')}"]
    if r.get("where"):
        lines.append("    raised at: " + " <- ".join(reversed(r["where"])))
    lines.append(f"    calls={r.get('calls')}  adopt_group.skipped={r.get('skipped')}")
    steps = r["steps"]
    if steps:
        lines.append("    per step: hook_valid=" + str([st["hook_valid"] for st in steps])
                     + " live=" + str([st["live"] for st in steps])
                     + " MiB=" + str([round(st["live_mib"], 4) for st in steps])
                     + " originals_alive=" + str([st["originals_alive"] for st in steps])
                     + " stale_wrappers=" + str([st["stale_wrappers"] for st in steps]))
        truth = steps[-1]["truth"]
        if isinstance(truth, dict):
            mem = "; ".join(f"data={m['data']} local={m['local']} wrapper={m['wrapper']} "
                            f"wrapper_impl={m['wrapper_geom']}" for m in truth["members"])
            pools = ", ".join(f"{p['name']} storage {p['storage_nbytes']} B / capacity "
                              f"{p['capacity']} B" for p in truth["pools"])
            lines.append(f"    last step, on a pool storage: {mem}")
            lines.append(f"    pools: {pools}")
        else:
            lines.append(f"    truth: {truth}")
    fin = r.get("final")
    if isinstance(fin, dict):
        lines.append(f"    final live={fin['live']} ({fin['live_mib']:.4f} MiB): {fin['rows']}")
    elif fin is not None:
        lines.append(f"    final: {fin}")
    return "\n".join(lines)


def main() -> None:
    from flatpool.integrations.hsdp.launch import launch

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--cols", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--only", default="", help="run the scenarios whose name contains this")
    a = ap.parse_args()
    per_rank = launch(worker, a.rows, a.cols, a.steps, a.only, world_size=2, timeout_s=900)
    print(f"rows={a.rows} cols={a.cols} fp32, 2 ranks: shard {a.rows // 2}x{a.cols} = "
          f"{a.rows // 2 * a.cols * 4} B per weight per rank")
    for name, _, _ in scenarios(a.rows, a.cols):
        if a.only not in name:
            continue
        print(f"\n=== {name}")
        for rank, res in enumerate(per_rank):
            print(_fmt_rank(rank, res[name]))


if __name__ == "__main__":
    main()
