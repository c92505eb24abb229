"""Adoption throughput: ``FlatPool().adopt(tensors)`` against the fastest ways to do less.

Figure: adopt N fresh tensors totalling ``total`` bytes into a fresh pool (allocation, copy,
moves, invariant check, release proof included; the originals die inside the timed region).

Baselines, each measured interleaved with the figure in the same process:

* **one fresh copy**: ``torch.empty`` + ``copy_`` of one tensor of the same total size (memory
  bandwidth; both pay first-touch page faults);
* **copy + free**: the same copy, then the originals are freed inside the timed region: the
  true floor of a *move* (a move must free what it moved from);
* **best hand loop**: what a careful hand-written fusion does: one buffer, ``split_with_sizes``
  views shaped like the tensors, one ``torch._foreach_copy_``, then ``t.data = view`` for each
  (no validation, no rollback, no proof that anything died);
* **naive loop**: ``narrow`` + ``copy_`` + ``.data =`` per tensor, as fusion groups often do.

Every case measures wall time and CPU time (``time.process_time``: every thread of the process,
so the threaded copies count) in the same rounds; on a loaded machine the CPU-time ratio is the
steadier one. Full sizes: 16, 1,000 and 10,000 tensors of 256 MiB in all. The target (issue 31):
at 10,000 tensors, at most 1.5x the best hand loop; the other rows are reported.

Growth (issue 41.9): a default pool holding 64 elements adopts a 5,000-element tensor (it
grows), with 2,000,000 extra live Python objects (200,000 quick) against none, interleaved;
the target: at most 3x (growth used to walk the heap, costing every live object).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch

from flatpool import FlatPool

from ._common import Result, fmt_s, interleaved, median, median_ratio

MiB = 1 << 20
HAND_LOOP_TARGET = {10000: 1.5}
"""Adoption over the best hand loop, at most, per tensor count."""


def _tensors(n: int, total: int) -> list[torch.Tensor]:
    numel = total // 4 // n
    return [torch.empty(numel).fill_(float(i % 7)) for i in range(n)]  # touched, like real shards


class Clock:
    """Wall and CPU time of each case's timed region; CPU seconds kept per case, in order."""

    def __init__(self) -> None:
        self.cpu: dict[str, list[float]] = {}

    @staticmethod
    def start() -> tuple[float, float]:
        return time.perf_counter(), time.process_time()

    def stop(self, name: str, t: tuple[float, float]) -> float:
        wall = time.perf_counter() - t[0]
        self.cpu.setdefault(name, []).append(time.process_time() - t[1])
        return wall


def cases(n: int, total: int, clock: Clock) -> dict[str, Callable[[], float]]:
    def flatpool_case() -> float:
        ts = _tensors(n, total)
        t0 = clock.start()
        report = FlatPool("cpu").adopt(ts)
        dt = clock.stop("flatpool", t0)
        if not report.all_released:
            raise AssertionError("adoption did not release every original")
        return dt

    def copy_case() -> float:
        src = torch.empty(total // 4).fill_(1.0)
        t0 = clock.start()
        dst = torch.empty_like(src)
        dst.copy_(src)
        dt = clock.stop("copy", t0)
        del dst
        return dt

    def copy_free_case() -> float:
        ts = _tensors(n, total)
        t0 = clock.start()
        dst = torch.empty(sum(t.numel() for t in ts))
        torch._foreach_copy_(list(dst.split_with_sizes([t.numel() for t in ts])), ts)
        del ts  # the originals die inside the timed region, as adoption's do
        dt = clock.stop("copy+free", t0)
        del dst
        return dt

    def hand_loop_case() -> float:
        ts = _tensors(n, total)
        t0 = clock.start()
        flat = torch.empty(sum(t.numel() for t in ts))
        views = [v.view(t.shape) for v, t in
                 zip(flat.split_with_sizes([t.numel() for t in ts]), ts)]
        with torch.no_grad():
            torch._foreach_copy_(views, ts)
            for t, v in zip(ts, views):
                t.data = v
        del views, ts  # (the originals were freed by .data =)
        return clock.stop("hand loop", t0)

    def naive_case() -> float:
        ts = _tensors(n, total)
        t0 = clock.start()
        flat = torch.empty(sum(t.numel() for t in ts))
        off = 0
        with torch.no_grad():
            for t in ts:
                k = t.numel()
                piece = flat.narrow(0, off, k)
                piece.copy_(t.view(-1))
                t.data = piece.view_as(t)
                off += k
        return clock.stop("naive", t0)

    return {"flatpool": flatpool_case, "copy": copy_case, "copy+free": copy_free_case,
            "hand loop": hand_loop_case, "naive": naive_case}


GROWTH_TARGET = 3.0
"""A growing adopt with many extra live Python objects over one with none, at most."""
GROWTHS = 20
"""Growing adopts timed per round (one takes well under a millisecond)."""


def growth_cases(extra: int) -> dict[str, Callable[[], float]]:
    def grow(objects: int) -> float:
        junk = [[] for _ in range(objects)]  # gc-tracked, like a model's Python objects
        pools = []
        for _ in range(GROWTHS):
            pool = FlatPool("cpu")
            pool.adopt([torch.randn(64)])
            pools.append((pool, torch.randn(5000)))
        gc.collect()  # (the junk settles in the oldest generation: no full collection is due)
        t0 = time.perf_counter()
        for pool, t in pools:
            pool.adopt([t])
        dt = time.perf_counter() - t0
        del junk, pools
        return dt

    return {"heap": lambda: grow(extra), "bare": lambda: grow(0)}


def run_growth(quick: bool) -> Result:
    extra = 200_000 if quick else 2_000_000
    reps = 2 if quick else 9
    times = interleaved(growth_cases(extra), reps)
    ratio = median_ratio(times["heap"], times["bare"])
    return Result(
        "adopt", f"growing adopt (64 + 5,000 elements) x{GROWTHS}, {extra:,} extra live objects "
        "vs none", fmt_s(median(times["heap"])), fmt_s(median(times["bare"])), ratio,
        f"<= {GROWTH_TARGET:.2f}", None if quick else ratio <= GROWTH_TARGET, rounds=reps)


def run(quick: bool) -> list[Result]:
    out = _run_batches(quick)
    out.append(run_growth(quick))
    return out


def _run_batches(quick: bool) -> list[Result]:
    total = 8 * MiB if quick else 256 * MiB
    counts = (16, 100, 1000) if quick else (16, 1000, 10000)
    out: list[Result] = []
    for n in counts:
        reps = 2 if quick else 9
        clock = Clock()
        times = interleaved(cases(n, total, clock), reps)
        cpu = {k: v[-reps:] for k, v in clock.cpu.items()}  # (after the warm-up round)
        f, fc = times["flatpool"], cpu["flatpool"]
        size = f"{n} tensors, {total // MiB} MiB"
        for base, target in (("hand loop", HAND_LOOP_TARGET.get(n)), ("copy+free", None),
                             ("copy", None), ("naive", None)):
            ratio = median_ratio(f, times[base])
            cpu_ratio = median_ratio(fc, cpu[base])
            judged = target is not None and not quick
            out.append(Result(
                "adopt", f"{size} vs {base}", fmt_s(median(f)), fmt_s(median(times[base])),
                ratio, "-" if target is None else f"<= {target:.2f}",
                (ratio <= target) if judged and target is not None else None, rounds=reps,
                note=f"CPU-time ratio {cpu_ratio:.3f}",
            ))
            if target is not None:
                out.append(Result(
                    "adopt", f"{size} vs {base} (CPU time)", fmt_s(median(fc)),
                    fmt_s(median(cpu[base])), cpu_ratio, f"<= {target:.2f}",
                    (cpu_ratio <= target) if judged else None, rounds=reps,
                    ratio_kind="per-round, CPU",
                ))
    return out
