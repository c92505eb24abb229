"""Validity check on the per-step path: ``flatpool.integrations.hsdp.validity.is_valid`` per member.

A group of N members (FSDP2-shaped: padded data, a Parameter sharing its storage; 1,000 and
10,000) is adopted with ``adopt_group``; then the check a group runs before each all-gather is
timed, interleaved with the cheapest conceivable per-member check (one ``data_ptr()`` read per
member, what a pointer-based check such as HyperParallel's would cost per member, and which a
tensor on another storage at the same address fools). ``FlatPool.is_valid()`` (every binding
of the registry) is timed against the same loop. Reported only: issue 20's targets (2x and 3x
the loop) are retired (issue 31: the checks are the rules, storage identity and geometry, with
no faster form to disagree with them); the check's share of a training step is judged in
``bench_step``. CPU time (``time.process_time``) is measured in the same rounds; its ratio is in
each row's note.
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


def _loop(fn: Callable[[], object], inner: int, cpu: list[float]) -> Callable[[], float]:
    def case() -> float:
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(inner):
            fn()
        dt = (time.perf_counter() - t0) / inner
        cpu.append((time.process_time() - c0) / inner)
        return dt

    return case


def _run(n: int, quick: bool) -> list[Result]:
    params = [Member(64) for _ in range(n)]
    buffers = adopt_group(params, world_size=2)  # type: ignore[arg-type]
    assert buffers.adopted and is_valid(buffers, params)  # type: ignore[arg-type]
    pool = buffers.buckets[0].pool
    assert pool.is_valid()

    def pointer_loop() -> None:
        for p in params:
            p._sharded_param_data.data_ptr()

    inner, reps = (2, 3) if quick else (5, 9)
    fns: dict[str, Callable[[], object]] = {
        "is_valid": lambda: is_valid(buffers, params),  # type: ignore[arg-type]
        "pool.is_valid": pool.is_valid,
        "data_ptr loop": pointer_loop,
    }
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    times = interleaved({k: _loop(fn, inner, cpu[k]) for k, fn in fns.items()}, reps=reps)
    cpu = {k: v[1:] for k, v in cpu.items()}  # the warm-up round
    out = []
    base = times["data_ptr loop"]
    for name in ("is_valid", "pool.is_valid"):
        per = median(times[name]) / n
        ratio = median_ratio(times[name], base)
        out.append(Result(
            "validity", f"{name} per member, {n} members", f"{per * 1e9:.0f} ns",
            f"{median(base) / n * 1e9:.0f} ns (data_ptr)", ratio, "-", None, rounds=reps,
            note=f"CPU-time ratio {median_ratio(cpu[name], cpu['data_ptr loop']):.2f}",
        ))
    return out


def run(quick: bool) -> list[Result]:
    return [r for n in ((1000,) if quick else (1000, 10000)) for r in _run(n, quick)]
