"""Training step with the hsdp layer, on 2 gloo ranks (CPU), FSDP2 ``fully_shard``.

Each rank builds the demo's two-layer model three times, sharded alike: plain FSDP2 twice, and
FSDP2 with ``fuse_fully_sharded`` (shards adopted into one pool per group, validity hooks
installed). Steps (forward, backward, Adam) of the three alternate. The target (issue 31): the
fused step is within noise of the plain one, the noise being what the second plain model's
per-round ratios to the first show: how far their median lies from 1, plus half their
interquartile range (never less than 2 %). Also: the fused all-gather from the flat buffer against FSDP2's own per-group
all-gather (``FSDPParamGroup.unshard`` + ``wait_for_unshard`` + ``reshard``) on the same
parameters, and the share of a step spent in the layer's per-step validity check
(``FusedModule.revalidate``, what its forward pre-hook runs).
"""

from __future__ import annotations

import statistics
import time

from ._common import Result, fmt_s, median, median_ratio


def _rank(hidden: int, ffn: int, batch: int, reps: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from flatpool.integrations.hsdp import fused_all_gather
    from examples.demo import ZeroThreeCase
    from flatpool.integrations.hsdp.fsdp2 import fsdp_param_groups, fuse_fully_sharded, lazy_init

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def make(fused: bool):  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = ZeroThreeCase(hidden, ffn)
        fully_shard(model, mesh=mesh)
        lazy_init(model)
        f = fuse_fully_sharded(model) if fused else None
        return model, torch.optim.Adam(model.parameters(), lr=1e-3), f

    plain, plain2, fused = make(False), make(False), make(True)
    assert fused[2] is not None and fused[2].is_valid()
    g = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(batch, hidden, generator=g), torch.randn(batch, hidden, generator=g)

    def step(m: tuple) -> float:  # type: ignore[type-arg]
        model, opt, _ = m
        dist.barrier()
        t0 = time.perf_counter()
        nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    group = next(iter(fsdp_param_groups(plain[0])))
    bucket = fused[2].buffers[0].buckets[0]

    def fsdp_ag() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        group.unshard()
        group.wait_for_unshard()
        dt = time.perf_counter() - t0
        group.reshard()
        return dt

    def fused_ag() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fused_all_gather(bucket)
        return time.perf_counter() - t0

    def check() -> float:
        t0 = time.perf_counter()
        for _ in range(10):
            fused[2].revalidate()
        return (time.perf_counter() - t0) / 10

    out: dict[str, list[float]] = {k: [] for k in ("plain", "plain2", "fused", "fsdp_ag",
                                                   "fused_ag", "check")}
    for r in range(reps + 2):  # two warm-up rounds
        steps = [("plain", lambda: step(plain)), ("plain2", lambda: step(plain2)),
                 ("fused", lambda: step(fused))]
        steps = steps[r % 3:] + steps[:r % 3]
        gathers = [("fsdp_ag", fsdp_ag), ("fused_ag", fused_ag)]
        order = steps + (gathers[::-1] if r % 2 else gathers) + [("check", check)]
        for name, fn in order:
            t = fn()
            if r >= 2:
                out[name].append(t)
    assert fused[2].is_valid()
    return out


def run(quick: bool) -> list[Result]:
    from examples.launch import launch

    hidden, ffn, batch, reps = (128, 256, 8, 3) if quick else (1024, 2048, 8, 21)
    per_rank = launch(_rank, hidden, ffn, batch, reps, world_size=2, backend="gloo")
    # A step's time is the slower rank's: take the max over ranks, round by round.
    t = {k: [max(vals) for vals in zip(*(r[k] for r in per_rank))] for k in per_rank[0]}
    size = f"{ffn}x{hidden} x2 fp32, batch {batch}"
    step_ratio = median_ratio(t["fused"], t["plain"])
    spread = [a / b for a, b in zip(t["plain2"], t["plain"])]
    q1, _, q3 = statistics.quantiles(spread, n=4) if len(spread) > 1 else (1.0, 1.0, 1.0)
    # (a plain model against another: how far their median lies from 1, and half the spread of
    # the middle half of the rounds)
    noise = max(0.02, abs(median(spread) - 1.0) + (q3 - q1) / 2)
    ag_ratio = median_ratio(t["fused_ag"], t["fsdp_ag"])
    share = median(t["check"]) / median(t["fused"])
    full = not quick
    return [
        Result("step", f"2-rank gloo FSDP2 step, {size}: hsdp layer vs plain",
               fmt_s(median(t["fused"])), fmt_s(median(t["plain"])), step_ratio,
               f"within noise (+-{noise:.3f})", abs(step_ratio - 1.0) <= noise if full else None,
               rounds=reps, note=f"plain vs plain: median {median(spread):.3f}, per round "
               f"{min(spread):.3f}..{max(spread):.3f}"),
        Result("step", "fused all-gather vs FSDP2 group unshard", fmt_s(median(t["fused_ag"])),
               fmt_s(median(t["fsdp_ag"])), ag_ratio, "<= 1.00", ag_ratio <= 1.0 if full else None,
               rounds=reps),
        Result("validity", "per-step check (revalidate) share of the demo step",
               fmt_s(median(t["check"])), fmt_s(median(t["fused"])) + " (step)", share, "< 0.01",
               share < 0.01 if full else None, ratio_kind="of medians", rounds=reps),
    ]
