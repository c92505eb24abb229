"""2-rank scenarios: a reference the user holds never breaks the HyperParallel simulation's step.

The docs' drop-in lines (V1 ``HSDPParamGroup`` and the newest ``AllGatherBucket``) run inside
the simulation with a reference to an original shard kept by the caller between deferred init
and the first step: a ``state_dict()`` taken before the loop, a ``detach()`` alias, shards that
are views of a full checkpoint, and a ``to_local()`` handle (the simulation's ``to_local``
returns the local tensor itself, which flatpool moves: no original is pinned, and nothing is
reported); on both ranks or on rank 0 only. Every step must train bit-identically to the same
unit without a flat buffer, the flat buffer must exist on both ranks, each kept original must
be reported once, and after the reference is dropped the next step must leave no original
alive.
"""

from __future__ import annotations

import gc
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
from attrs import evolve

from flatpool import OriginalKeptAliveWarning
from examples.hyperparallel_sim import Config, FullyShardUnit, Originals, digest
from examples.hyperparallel_sim.unit import full_weights

import hp_doc_lines
from hp_hook_workers import NEWEST, SMALL, _buffers

KINDS = ("to_local", "state_dict", "detach", "view_of_full")
SHAPES = {"v1": SMALL, "newest": NEWEST}


def _materialize(unit: FullyShardUnit, kind: str, holds: bool, box: list[Any]) -> None:
    if kind == "view_of_full":
        world, rank = unit.mesh.shard_mesh_size, unit.mesh.shard_mesh_rank
        fulls = full_weights(unit.cfg)
        for name, full in zip(("w1", "w2"), fulls):
            per = full.size(0) // world
            view = full.narrow(0, rank * per, per)
            p = unit.module._parameters[name]
            local = view if holds else view.clone()
            local.requires_grad_(p._local_tensor.requires_grad)  # type: ignore[union-attr]
            p._local_tensor = local  # type: ignore[union-attr]
        if holds:
            box.append(fulls)
        return
    unit.materialize()
    if not holds:
        return
    if kind == "to_local":
        for p in unit.module.parameters():
            keep = p.to_local()  # type: ignore[operator]
        box.append(keep)
    elif kind == "state_dict":
        box.append(unit.module.state_dict())
    elif kind == "detach":
        box.append(unit.module.w2.detach())


def _run(cfg: Config, kind: str, holds: bool, hooks: dict[str, Any], steps: int = 3,
         ) -> dict[str, Any]:
    unit = FullyShardUnit(evolve(cfg, materialize="to_empty"), **hooks)
    box: list[Any] = []
    _materialize(unit, kind, holds, box)
    unit.lazy_init()
    originals = Originals.of(unit)
    opt = unit.make_optimizer()
    out: dict[str, Any] = {"losses": [], "kept": [], "flat": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(steps):
            if s == 1:
                out["kept"].append(sum(b.kept_alive for b, _ in _buffers(unit)))
                box.clear()  # the user drops the reference
                gc.collect()
            out["losses"].append(unit.train_step(s, opt))
            out["flat"].append(len(unit.flat_buffers()))
    out["warnings"] = [str(w.message) for w in caught
                       if issubclass(w.category, OriginalKeptAliveWarning)]
    out["kept"].append(sum(b.kept_alive for b, _ in _buffers(unit)))
    out["digests"] = [digest(t) for t in unit.local_values()]
    out["originals_alive"] = len(originals.alive())
    out["valid"] = unit.is_valid()
    return out


def scenario(shape: str, kind: str, ranks: str) -> dict[str, Any]:
    holds = ranks == "all" or dist.get_rank() == 0
    cfg = SHAPES[shape]
    res: dict[str, Any] = {"error": None, "holds": holds}
    try:
        res["fused"] = _run(cfg, kind, holds, hp_doc_lines.hooks(shape))
        res["reference"] = _run(evolve(cfg, group="none"), kind, holds, {})
    except Exception:
        res["error"] = traceback.format_exc()
    return res


def run_all() -> dict[str, Any]:
    return {f"{shape}/{kind}/{ranks}": scenario(shape, kind, ranks)
            for shape in SHAPES for kind in KINDS for ranks in ("all", "rank0")}


__all__ = ["KINDS", "SHAPES", "run_all", "scenario"]
