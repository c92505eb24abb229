"""Probe: plug the docs/integration.md drop-in lines into the HyperParallel simulation.

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

from examples.hyperparallel_sim import (  # noqa: E402
    Config,
    FullyShardUnit,
    Originals,
    census,
    digest,
)
from examples.hyperparallel_sim.dtensor import (  # noqa: E402
    wrapper_local_geometry,
    wrapper_storage_key,
)
from examples.hyperparallel_sim.group import agreed  # noqa: E402

# ---- the hook: the drop-in lines of docs/integration.md, executed as written -----------------
import hp_doc_lines  # noqa: E402

V1_HOOK = hp_doc_lines.hooks("v1")
B_HOOK = hp_doc_lines.hooks("newest")


# ---- measuring ------------------------------------------------------------------------------
def _group_buffers(unit: FullyShardUnit) -> list[Any]:
    g = unit.group
    if hasattr(g, "all_gather_buckets"):
        return [b._flatpool for b in g.all_gather_buckets if getattr(b, "_flatpool", None)]
    fb = getattr(g, "_flatpool", None)
    return [fb] if fb is not None else []


def _truth(unit: FullyShardUnit) -> dict[str, Any]:
    """Do data, local tensor and wrapper of every member sit on a pool's storage?"""
    pools = [b.pool for gb in _group_buffers(unit) if gb.adopted for b in gb.buckets]
    keys = {p.storage_key for p in pools if p.is_materialized}
    rows = []
    for p in unit.hsdp_params:
        data = wrapper_storage_key(p._sharded_param_data) in keys
        local = wrapper_storage_key(p._sharded_local_tensor) in keys
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


def scenarios(rows: int, cols: int) -> list[tuple[str, Config, dict[str, Any]]]:
    s = {"rows": rows, "cols": cols}
    out: list[tuple[str, Config, dict[str, Any]]] = []
    for group, hook in (("v1", V1_HOOK), ("bucketed", B_HOOK)):
        for setter, flavor in (("routed", "even"), ("routed", "padded"), ("rebind", "padded")):
            for mat in ("eager", "to_empty", "local_assign"):
                out.append((f"{group}/{setter}/{flavor}/{mat}",
                            Config(group=group, setter=setter, flavor=flavor, materialize=mat,
                                   **s), dict(hook)))
        out.append((f"{group}/routed/padded/eager bf16",
                    Config(group=group, flavor="padded", param_dtype=torch.bfloat16, **s),
                    dict(hook)))
        out.append((f"{group}/rebind/padded/eager uneven rows",
                    Config(group=group, setter="rebind", flavor="padded", rows=rows - 1,
                           cols=cols), dict(hook)))
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
    from examples.launch import launch

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
