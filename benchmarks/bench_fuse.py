"""Fusion of a real FSDP2 group on 2 gloo ranks: ``fuse_fully_sharded`` and ``adopt_group`` of
N DTensor members against the plain ``FlatPool.adopt`` of N tensors of the same sizes.

Each rank builds a module of N small parameters (``rows x cols`` fp32, sharded on dim 0 by
``fully_shard``, lazily initialized, so each member is FSDP2's padded data, a DTensor
``nn.Parameter`` and its local tensor). Timed, interleaved, a fresh model or fresh tensors each
round, behind a barrier, a round's time being the slower rank's:

* **fuse**: ``fuse_fully_sharded(model)`` (adoption of the group with every holder, the
  release proof, the validity hooks installed);
* **adopt_group**: ``adopt_group(group.fsdp_params, world_size=2)`` on another fresh model;
* **plain adopt** (the baseline): ``FlatPool("cpu", alignment=1).adopt(tensors)`` of N fresh
  tensors shaped like the padded shards (same count, same bytes).

Wall and CPU time (``time.process_time``) are both reported. Then, on the fused model, the
per-step checks against a raw ``data_ptr()`` loop over the members' padded data:
``FusedModule.revalidate()`` (what the forward pre-hook runs) and ``is_valid`` of the group.
"""

from __future__ import annotations

import time
from typing import Any

from ._common import Result, fmt_s, median, median_ratio

FUSE_TARGET = 3.0
CHECK_TARGET = 2.0


def _rank(n: int, rows: int, cols: int, reps: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from flatpool import FlatPool
    from flatpool.integrations.hsdp import adopt_group, is_valid
    from flatpool.integrations.hsdp.fsdp2 import fsdp_param_groups, fuse_fully_sharded, lazy_init

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def model() -> Any:
        torch.manual_seed(0)
        m = nn.Module()
        m.ps = nn.ParameterList([nn.Parameter(torch.randn(rows, cols)) for _ in range(n)])
        fully_shard(m, mesh=mesh)
        lazy_init(m)
        return m

    def clock() -> tuple[float, float]:
        dist.barrier()
        return time.perf_counter(), time.process_time()

    def since(t: tuple[float, float]) -> tuple[float, float]:
        return time.perf_counter() - t[0], time.process_time() - t[1]

    def fuse() -> tuple[float, float]:
        m = model()
        t = clock()
        f = fuse_fully_sharded(m)
        out = since(t)
        assert f.is_valid()
        return out

    def group() -> tuple[float, float]:
        m = model()
        params = next(iter(fsdp_param_groups(m))).fsdp_params
        t = clock()
        b = adopt_group(params, world_size=dist.get_world_size())
        out = since(t)
        assert b.adopted and is_valid(b, params)
        return out

    def plain() -> tuple[float, float]:
        m = model()  # the same shapes, and the same heap as the other cases
        shapes = [p._sharded_param_data.shape for p in next(iter(fsdp_param_groups(m))).fsdp_params]
        ts = [torch.empty(s).fill_(1.0) for s in shapes]
        t = clock()
        report = FlatPool("cpu", alignment=1).adopt(ts)
        out = since(t)
        assert report.all_released
        return out

    times: dict[str, list[float]] = {}
    cases = {"fuse": fuse, "adopt_group": group, "plain": plain}
    names = list(cases)
    for r in range(reps + 1):  # one warm-up round
        for name in names[r % 3:] + names[:r % 3]:
            wall, cpu = cases[name]()
            if r:
                times.setdefault(name, []).append(wall)
                times.setdefault(name + " cpu", []).append(cpu)

    fused_model = model()
    fused = fuse_fully_sharded(fused_model)
    params = fused.groups[0].fsdp_params
    buffers = fused.buffers[0]
    inner = 5

    def loop(fn: Any) -> Any:
        def case() -> float:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            return (time.perf_counter() - t0) / inner
        return case

    def pointer_loop() -> None:
        for p in params:
            p._sharded_param_data.data_ptr()

    checks = {"revalidate": loop(fused.revalidate),
              "is_valid": loop(lambda: is_valid(buffers, params)),
              "data_ptr loop": loop(pointer_loop)}
    for r in range(2 * reps + 1):
        for name in list(checks)[r % 3:] + list(checks)[:r % 3]:
            dt = checks[name]()
            if r:
                times.setdefault(name, []).append(dt)
    assert fused.is_valid() and fused.readoptions == 0
    return times


def run(quick: bool) -> list[Result]:
    from flatpool.integrations.hsdp.launch import launch

    n, rows, cols, reps = (64, 8, 8, 1) if quick else (10000, 8, 8, 5)
    per_rank = launch(_rank, n, rows, cols, reps, world_size=2, backend="gloo",
                      timeout_s=1800.0)
    t = {k: [max(vals) for vals in zip(*(r[k] for r in per_rank))] for k in per_rank[0]}
    size = f"{n} DTensor members ({rows}x{cols} fp32 on 2 ranks)"
    out = []
    for name in ("fuse", "adopt_group"):
        what = "fuse_fully_sharded" if name == "fuse" else "adopt_group"
        for suffix, kind in (("", "per-round"), (" cpu", "per-round, CPU")):
            ratio = median_ratio(t[name + suffix], t["plain" + suffix])
            out.append(Result(
                "fuse", f"{what}, {size} vs plain adopt of {n} tensors"
                + (" (CPU time)" if suffix else ""),
                fmt_s(median(t[name + suffix])), fmt_s(median(t["plain" + suffix])), ratio,
                f"<= {FUSE_TARGET:.2f}", None if quick else ratio <= FUSE_TARGET,
                ratio_kind=kind, rounds=reps,
                note=f"{median(t[name + suffix]) / n * 1e6:.0f} us per member"))
    base = t["data_ptr loop"]
    for name in ("revalidate", "is_valid"):
        ratio = median_ratio(t[name], base)
        out.append(Result(
            "validity", f"healthy FusedModule.{name}() per member, {n} FSDP2 members"
            if name == "revalidate" else f"hsdp is_valid per member, {n} FSDP2 members",
            f"{median(t[name]) / n * 1e9:.0f} ns", f"{median(base) / n * 1e9:.0f} ns (data_ptr)",
            ratio, f"<= {CHECK_TARGET:.2f}", None if quick else ratio <= CHECK_TARGET,
            rounds=2 * reps))
    return out
