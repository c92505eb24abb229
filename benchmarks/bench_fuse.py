"""Fusion of real FSDP2 groups on 2 gloo ranks: ``fuse_fully_sharded`` against ``fully_shard``.

Each rank builds a model of N parameter modules (``rows x cols`` fp32 each) and shards it the
way FSDP2 is used: ``fully_shard`` on every module, then on the root (timed: FSDP2's own cost
of turning N parameters into DTensor members of N groups). FSDP2's lazy init runs (untimed: it
runs at the first forward either way), then ``fuse_fully_sharded`` adopts every group's members
into its pool with every holder, proves the originals died and installs the validity hooks
(timed). A fresh model each round, behind a barrier; a round's time is the slower rank's. The
target (issue 31): the fusion costs at most a quarter of ``fully_shard``.

Reported beside it: the same N parameters in *one* group (one ``fully_shard`` call over a
module holding them all, so ``fully_shard`` pays its per-call cost once), and the per-step
check ``FusedModule.revalidate()`` (what the forward pre-hook runs) per member; its share of a
training step is judged in ``bench_step``.
"""

from __future__ import annotations

import time
from typing import Any

from ._common import Result, fmt_s, median, median_ratio

FUSE_TARGET = 0.25
"""``fuse_fully_sharded`` time over ``fully_shard`` time, at most (one group per module)."""


def _rank(n: int, rows: int, cols: int, reps: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from flatpool.integrations.hsdp.fsdp2 import fuse_fully_sharded, lazy_init

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    class Leaf(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(rows, cols))

    def model(groups: str) -> Any:
        torch.manual_seed(0)
        m = nn.Module()
        if groups == "modules":
            m.leaves = nn.ModuleList([Leaf() for _ in range(n)])
        else:
            m.ps = nn.ParameterList([nn.Parameter(torch.randn(rows, cols)) for _ in range(n)])
        return m

    def shard(m: Any, groups: str) -> None:
        if groups == "modules":
            for leaf in m.leaves:
                fully_shard(leaf, mesh=mesh)
        fully_shard(m, mesh=mesh)

    times: dict[str, list[float]] = {}
    fused = None
    for groups in ("modules", "one group"):
        for r in range(reps + 1):  # one warm-up round
            m = model(groups)
            dist.barrier()
            t0 = time.perf_counter()
            shard(m, groups)
            sharded = time.perf_counter() - t0
            lazy_init(m)
            dist.barrier()
            t0 = time.perf_counter()
            fused = fuse_fully_sharded(m)
            fuse = time.perf_counter() - t0
            assert fused.is_valid() and all(b.adopted for b in fused.buffers)
            if r:
                times.setdefault(f"{groups}: fully_shard", []).append(sharded)
                times.setdefault(f"{groups}: fuse", []).append(fuse)
    assert fused is not None  # the one-group model: its check per member
    inner = 5
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fused.revalidate()
        times.setdefault("revalidate", []).append((time.perf_counter() - t0) / inner)
    assert fused.readoptions == 0
    return times


def run(quick: bool) -> list[Result]:
    from examples.launch import launch

    rows, cols = 8, 8
    out = []
    for n, reps in ((64, 1),) if quick else ((1000, 3), (10000, 2)):
        per_rank = launch(_rank, n, rows, cols, reps, world_size=2, backend="gloo",
                          timeout_s=3600.0)
        t = {k: [max(vals) for vals in zip(*(r[k] for r in per_rank))] for k in per_rank[0]}
        for groups in ("modules", "one group"):
            fuse, shard = t[f"{groups}: fuse"], t[f"{groups}: fully_shard"]
            ratio = median_ratio(fuse, shard)
            judged = groups == "modules"
            out.append(Result(
                "fuse", f"fuse_fully_sharded vs fully_shard, {n} members ({rows}x{cols} fp32) "
                + ("one group a module" if judged else "in one group") + ", 2 ranks",
                fmt_s(median(fuse)), fmt_s(median(shard)), ratio,
                f"<= {FUSE_TARGET:.2f}" if judged else "-",
                None if quick or not judged else ratio <= FUSE_TARGET, rounds=reps,
                note=f"{median(fuse) / n * 1e6:.0f} us per member"))
        out.append(Result(
            "validity", f"healthy FusedModule.revalidate() per member, {n} members in one group",
            f"{median(t['revalidate']) / n * 1e9:.0f} ns", "-", None, "-", None, rounds=reps,
            note="its share of a step is judged in bench_step"))
    return out
