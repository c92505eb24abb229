"""Census over a model of N parameters with an Adam optimizer (state populated), and over a
fused FSDP2 model with the flat optimizer on 2 gloo ranks.

Figure: ``flatpool.census(model, optimizer)``. Baseline: a bare walk that visits the same
tensors (parameters, grads, optimizer state) and reads each one's storage identity: the
unavoidable part of any census. Target: the census under 1 s at 10,000 parameters.

Fused row (issue 32): each rank builds, as the optimizer demo does, the same model twice, 50
``fully_shard`` groups of 10 ``Linear(16, 16)`` (1,000 members a rank), both fused with
``fuse_fully_sharded``: one steps AdamW per parameter, the other through ``flat_optimizer``
(gradient and state pools). Figure: ``flatpool.census()`` with no root (every tensor of the
process), a round's time being the slower rank's. The per-parameter model's gradients and
3,000 state tensors lie outside the pools, each of a slice's size, so the census compares
each with the slices (the stale check): that search was quadratic (38 s a rank before).
Baseline: a bare scan of the same tensors (``gc.get_objects()``, each tensor's storage
identity). Target: under 2 s a rank.
"""

from __future__ import annotations

import time
import warnings

import torch
from torch import nn

from flatpool import census

from ._common import Result, fmt_s, interleaved, median, median_ratio


class Many(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(16)) for _ in range(n)])


def _fused_rank(blocks: int, reps: int) -> dict[str, list[float]]:
    import gc

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from flatpool.integrations.hsdp.fsdp2 import fuse_fully_sharded
    from flatpool.integrations.hsdp import flat_optimizer

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    width = 16

    def build(flat: bool) -> tuple[object, ...]:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(*[nn.Linear(width, width) for _ in range(10)])
                                for _ in range(blocks)])
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        fused = fuse_fully_sharded(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        fo = flat_optimizer(fused, opt) if flat else None
        x = torch.randn(4, width, generator=torch.Generator().manual_seed(int(flat)))
        model(x).square().mean().backward()
        (opt if fo is None else fo).step()
        return model, opt, fo, fused

    kept = (build(False), build(True))
    members = sum(1 for _ in kept[1][0].parameters())  # type: ignore[attr-defined]

    def census_case() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        records = census().records
        dt = time.perf_counter() - t0
        assert len(records) > 3 * members  # the twin's state storages, one each
        return dt

    def walk_case() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        keys = set()
        with warnings.catch_warnings():  # isinstance() on deprecated torch aliases warns
            warnings.simplefilter("ignore")
            for obj in gc.get_objects():
                if isinstance(obj, torch.Tensor):
                    local = obj._local_tensor if isinstance(obj, DTensor) else obj
                    keys.add(local.untyped_storage()._cdata)
        return time.perf_counter() - t0

    times = interleaved({"census": census_case, "walk": walk_case}, reps=reps)
    times["members"] = [float(members)]
    del kept
    return times


def _fused(quick: bool) -> Result:
    from examples.launch import launch

    blocks, reps = (2, 1) if quick else (50, 3)
    per_rank = launch(_fused_rank, blocks, reps, world_size=2, backend="gloo", timeout_s=900)
    t = {k: [max(v) for v in zip(*(r[k] for r in per_rank))] for k in ("census", "walk")}
    fig = median(t["census"])
    return Result(
        "census", f"census() on 2 FSDP2 ranks, {int(per_rank[0]['members'][0])} members a rank, "
        "flat optimizer + a per-parameter twin", fmt_s(fig),
        fmt_s(median(t["walk"])) + " (bare scan)", median_ratio(t["census"], t["walk"]),
        "< 2 s a rank", (fig < 2.0) if not quick else None, rounds=reps,
    )


def run(quick: bool) -> list[Result]:
    n = 1000 if quick else 10000
    model = Many(n)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()

    def census_case() -> float:
        t0 = time.perf_counter()
        c = census(model, opt)
        dt = time.perf_counter() - t0
        assert len(c.records) >= 3 * n
        return dt

    def walk_case() -> float:
        t0 = time.perf_counter()
        keys = set()
        for p in model.parameters():
            keys.add(p.untyped_storage()._cdata)
            if p.grad is not None:
                keys.add(p.grad.untyped_storage()._cdata)
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    keys.add(v.untyped_storage()._cdata)
        return time.perf_counter() - t0

    reps = 2 if quick else 5
    times = interleaved({"census": census_case, "walk": walk_case}, reps=reps)
    fig = median(times["census"])
    return [Result(
        "census", f"census(model, Adam), {n} params", fmt_s(fig),
        fmt_s(median(times["walk"])) + " (bare walk)",
        median_ratio(times["census"], times["walk"]), "< 1 s",
        (fig < 1.0) if not quick else None, rounds=reps,
    ), _fused(quick)]
