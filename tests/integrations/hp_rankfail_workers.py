"""2-rank scenarios: fusion that fails on one rank (or on every rank) never breaks a HyperParallel
step.

The docs' drop-in lines run inside the simulation while a fault hook makes every flatpool
operation of the failing rank(s) raise a typed error (what a rank-local problem looks like to
the layer) during the group's construction and the first step; then the fault is cleared.
Every step must train bit-identically to the same unit without a flat buffer; the failing rank
trains unfused at the first step while the others fuse, and from the second step on every rank
has its flat buffer (the layer tries again at each validity check). Eager and after deferred
init (``to_empty``); V1 and the newest group.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch.distributed as dist
from attrs import evolve

from examples.hyperparallel_sim import Config, FullyShardUnit, digest

import hp_doc_lines
from hp_hook_workers import NEWEST, SMALL
from scenario_runs import FailingOps

SHAPES = {"v1": SMALL, "newest": NEWEST}
MODES = ("eager", "to_empty")
FAILING = ("rank0", "all")
STEPS = 3


def _run(cfg: Config, hooks: dict[str, Any], fails_here: bool) -> dict[str, Any]:
    with FailingOps(fails_here) as fault:
        unit = FullyShardUnit(cfg, **hooks)
        if cfg.materialize != "eager":
            unit.materialize()
            unit.lazy_init()
        opt = unit.make_optimizer()
        out: dict[str, Any] = {"losses": [], "flat": []}
        for s in range(STEPS):
            out["losses"].append(unit.train_step(s, opt))
            out["flat"].append(len(unit.flat_buffers()))
            fault.on = False  # the rank-local problem goes away after the first step
    out["raised"] = fault.raised
    out["digests"] = [digest(t) for t in unit.local_values()]
    out["valid"] = unit.is_valid()
    return out


def scenario(shape: str, mode: str, failing: str) -> dict[str, Any]:
    fails_here = failing == "all" or dist.get_rank() == 0
    cfg = evolve(SHAPES[shape], materialize=mode)
    res: dict[str, Any] = {"error": None, "fails_here": fails_here}
    try:
        res["fused"] = _run(cfg, hp_doc_lines.hooks(shape), fails_here)
        res["reference"] = _run(evolve(cfg, group="none"), {}, False)
    except Exception:
        res["error"] = traceback.format_exc()
    return res


def run_all() -> dict[str, Any]:
    return {f"{shape}/{mode}/{failing}": scenario(shape, mode, failing)
            for shape in SHAPES for mode in MODES for failing in FAILING}


__all__ = ["FAILING", "MODES", "SHAPES", "run_all", "scenario"]
