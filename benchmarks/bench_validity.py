"""Validity check on the per-step path: ``flatpool.integrations.hsdp.validity.is_valid`` per member.

A group of N members (FSDP2-shaped: padded data, a Parameter sharing its storage) is adopted
with ``adopt_group``; then the check a group runs before each all-gather is timed, interleaved
with the cheapest conceivable per-member check (one ``data_ptr()`` read per member, what a
pointer-based check such as HyperParallel's would cost per member). The target is absolute:
<= 1 us per member at 10,000 members. ``FlatPool.is_valid()`` (the registry walk) is reported
too. The check's share of a training step is measured in ``bench_step``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from flatpool.integrations.hsdp.group import adopt_group
from flatpool.integrations.hsdp.validity import is_valid

from ._common import Result, interleaved, median, median_ratio


class Member:
    """The ShardedParam protocol, as FSDP2 lays a member out (even shards, no padding)."""

    def __init__(self, numel: int) -> None:
        self._sharded_param_data = torch.randn(numel)
        self.sharded_param = nn.Parameter(self._sharded_param_data)
        self.sharded_size = torch.Size([numel])
        self.padded_sharded_param_size = torch.Size([numel])
        self.offload_to_cpu = False


def _loop(fn: Callable[[], object], inner: int) -> Callable[[], float]:
    def case() -> float:
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - t0) / inner

    return case


def run(quick: bool) -> list[Result]:
    n = 1000 if quick else 10000
    params = [Member(64) for _ in range(n)]
    buffers = adopt_group(params, world_size=2)  # type: ignore[arg-type]
    assert buffers.adopted and is_valid(buffers, params)  # type: ignore[arg-type]
    pool = buffers.buckets[0].pool

    def pointer_loop() -> None:
        for p in params:
            p._sharded_param_data.data_ptr()

    inner, reps = (2, 3) if quick else (5, 7)
    times = interleaved({
        "is_valid": _loop(lambda: is_valid(buffers, params), inner),  # type: ignore[arg-type]
        "pool.is_valid": _loop(pool.is_valid, inner),
        "data_ptr loop": _loop(pointer_loop, inner),
    }, reps=reps)
    out = []
    base = times["data_ptr loop"]
    for name in ("is_valid", "pool.is_valid"):
        per = median(times[name]) / n
        out.append(Result(
            "validity", f"{name} per member, {n} members", f"{per * 1e6:.2f} us",
            f"{median(base) / n * 1e6:.2f} us (data_ptr)", median_ratio(times[name], base),
            "<= 1 us/member" if name == "is_valid" else "-",
            (per <= 1e-6) if name == "is_valid" and not quick else None, rounds=reps,
        ))
    return out
