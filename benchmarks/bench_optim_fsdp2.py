"""The optimizer step of a real FSDP2 job on 2 gloo ranks: flat vs ``foreach=True`` vs
``fused=True``, and what the flat optimizer costs to set up and to hold.

Each rank builds a model of identical blocks (20 small parameters each, 16-512 elements, rows
even so shards need no padding), ``fully_shard`` per block and on the root; N parameters in all
(N/20 blocks, N DTensor parameters a rank). Three copies of it, one per case:

* **flat**: ``fuse_fully_sharded`` then ``flat_optimizer`` over an AdamW (foreach);
* **foreach**: FSDP2 alone, ``AdamW(foreach=True)``;
* **fused**: FSDP2 alone, ``AdamW(fused=True)``.

Every optimizer has one param group per block. DTensor's first sharding propagation of a list op
grows with the square of the list's length (``_propagate_use_strided_shard_flag`` over every
argument, for every element): one group of 1,000 parameters costs 80-90 s at the first
``foreach`` step, one of 10,000 would cost hours. Identical blocks hit its cache after the first,
so per-block groups keep every case's first step bounded; the warm-up (one full step, untimed,
with the gc paused: at 10,000 parameters the first ``foreach`` step took 513 s with it running,
each collection walking the objects it makes) is reported for each.

Timed, interleaved, medians of per-round ratios, a round's time being the slower rank's: the
optimizer step, i.e. ``clip_grad_norm_`` (the flat optimizer's, or torch's over the parameters),
``optimizer.step()`` and ``optimizer.zero_grad()`` (``set_to_none=True``), after an untimed
forward and backward. Also: ``fuse_fully_sharded`` and ``flat_optimizer`` setup time, and the
bytes of every storage the model and optimizer reach between steps (census), flat vs plain
FSDP2 with ``foreach=True``; and the ``zero_``/``add_``/``copy_``/``fill_`` calls of one steady
profiled step (forward, backward, clip, step, zero_grad) beyond plain FSDP2's, per group.
"""

from __future__ import annotations

import time
from typing import Any

from ._common import Result, fmt_bytes, fmt_s, median, median_ratio

BLOCK = [(8, 64), (64,), (16, 32), (32,), (4, 128), (128,), (2, 8), (8,), (32, 16), (16,),
         (2, 256), (256,), (6, 20), (20,), (10, 50), (50,), (12, 12), (12,), (4, 4), (4,)]
"""One block's parameter shapes (dim 0 even: 2 ranks shard without padding)."""
OPS = ("aten::zero_", "aten::add_", "aten::copy_", "aten::fill_")
"""The ops a gradient path can add per parameter or per pool (counted, flat vs plain FSDP2)."""


def _rank(n: int, reps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from flatpool import census
    from flatpool.integrations.hsdp.fsdp2 import fuse_fully_sharded
    from flatpool.integrations.hsdp import flat_optimizer

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ps = nn.ParameterList([nn.Parameter(torch.randn(s) * 0.1) for s in BLOCK])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * (1 + sum(p.mean() for p in self.ps) * 1e-3)

    def model() -> nn.Module:
        torch.manual_seed(0)
        m = nn.Sequential(*[Block() for _ in range(max(1, n // len(BLOCK)))])
        for b in m:
            fully_shard(b, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m

    def clock() -> float:
        dist.barrier()
        return time.perf_counter()

    out: dict[str, Any] = {}
    cases: dict[str, tuple[nn.Module, torch.optim.Optimizer, Any]] = {}
    for name in ("flat", "foreach", "fused"):
        m = model()
        groups = [{"params": list(b.parameters())} for b in m]
        kw = {"fused": True} if name == "fused" else {"foreach": True}
        opt = torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.01, **kw)  # type: ignore[arg-type]
        fo = None
        if name == "flat":
            t = clock()
            fused = fuse_fully_sharded(m)
            out["fuse s"] = time.perf_counter() - t
            t = clock()
            fo = flat_optimizer(fused, opt)
            out["setup s"] = time.perf_counter() - t
        cases[name] = (m, opt, fo)
    x = torch.randn(4, 8)

    def backward(name: str) -> None:
        m = cases[name][0]
        m(x).square().mean().backward()

    def step(name: str) -> float:
        m, opt, fo = cases[name]
        t = clock()
        if fo is not None:
            fo.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad()
        dist.barrier()
        return time.perf_counter() - t

    import gc

    gc.disable()  # the warm-up makes a great many objects: bound it (each gc pass walks them all)
    try:
        for name in cases:  # warm-up: the first step (DTensor's sharding propagation, state made)
            backward(name)
            out[f"warmup {name}"] = step(name)
    finally:
        gc.enable()
    names = list(cases)
    for r in range(reps):
        for name in names[r % 3:] + names[:r % 3]:
            backward(name)
            out.setdefault(name, []).append(step(name))
    for name in ("flat", "foreach"):
        m, opt, _ = cases[name]
        out[f"bytes {name}"] = sum(rec.nbytes for rec in census(m, opt).records)
    for name in ("flat", "foreach"):  # one steady step profiled: the gradient path's aten ops
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            backward(name)
            step(name)
        counts = dict.fromkeys(OPS, 0)
        for e in prof.events():
            if e.name in counts:
                counts[e.name] += 1
        out[f"ops {name}"] = counts
    from flatpool.integrations.hsdp.fsdp2 import fsdp_param_groups

    out["groups"] = sum(1 for g in fsdp_param_groups(cases["flat"][0]) if g.fsdp_params)
    fo = cases["flat"][2]
    out["segments"] = len(fo.segments)
    out["fallback"] = len(fo.fallback)
    return out


def run(quick: bool, sizes: tuple[int, ...] | None = None) -> list[Result]:
    from examples.launch import launch

    results: list[Result] = []
    for n in sizes or ((40,) if quick else (1000, 10000)):
        reps = 1 if quick else 5
        per_rank = launch(_rank, n, reps, world_size=2, timeout_s=3600.0)
        t = {k: [max(v) for v in zip(*(r[k] for r in per_rank))] for k in ("flat", "foreach", "fused")}
        one = {k: max(r[k] for r in per_rank) for k in per_rank[0]
               if not isinstance(per_rank[0][k], (list, dict))}
        warm = ", ".join(f"{k} {fmt_s(one[f'warmup {k}'])}" for k in ("flat", "foreach", "fused"))
        print(f"  [optim fsdp2] {n} DTensor params a rank: first step (warm-up, untimed): {warm}; "
              f"fuse_fully_sharded {fmt_s(one['fuse s'])}, flat_optimizer {fmt_s(one['setup s'])}; "
              f"{one['segments']} segments, {one['fallback']} groups not flat", flush=True)
        size = f"FSDP2, 2 ranks, {n} DTensor params a rank"
        for base, target in (("foreach", 1 / 3), ("fused", 1.0)):
            ratio = median_ratio(t["flat"], t[base])
            results.append(Result(
                "optim", f"clip + step + zero_grad, {size}: flat vs {base}=True",
                fmt_s(median(t["flat"])), fmt_s(median(t[base])), ratio,
                f"<= {target:.2f}" if base == "fused" else "<= 0.33 (3x faster)",
                None if quick else ratio <= target + 1e-9, rounds=reps,
                note=f"{median(t[base]) / median(t['flat']):.1f}x faster; first step: {warm}"))
        ratio = one["setup s"] / one["fuse s"]
        results.append(Result(
            "optim", f"flat_optimizer setup vs fuse_fully_sharded, {size}",
            fmt_s(one["setup s"]), fmt_s(one["fuse s"]), ratio, "<= 1.0",
            None if quick or n < 10000 else ratio <= 1.0, ratio_kind="of medians",
            note="one measurement each, the slower rank's"))
        ops_f, ops_p = per_rank[0]["ops flat"], per_rank[0]["ops foreach"]
        extra = {k: ops_f[k] - ops_p[k] for k in OPS}
        more = sum(max(0, v) for v in extra.values())
        groups = one["groups"]
        results.append(Result(
            "optim", f"aten zero_/add_/copy_/fill_ beyond plain FSDP2 in one steady step, {size}",
            f"{more} more", f"{groups} groups", more / max(1, groups), "<= 1 per group",
            more <= groups, ratio_kind="per group",
            note="profiled forward + backward + clip + step + zero_grad, rank 0: "
                 + ", ".join(f"{k.split('::')[1]} {ops_f[k]} vs {ops_p[k]}" for k in OPS)
                 + " (the backward reduce-scatters into the gradient pools: was one add_ per "
                   "member and one zero_ per pool)"))
        flat_b, plain_b = one["bytes flat"], one["bytes foreach"]
        results.append(Result(
            "optim", f"bytes held between steps (zero_grad set_to_none), {size}: flat vs plain FSDP2",
            fmt_bytes(flat_b), fmt_bytes(plain_b), flat_b / max(1, plain_b), "<= 1.0 + one allocation",
            None if quick else flat_b <= plain_b + 4096, ratio_kind="bytes",
            note="every storage the model and optimizer reach (census), the larger rank"))
    return results


__all__ = ["run"]
