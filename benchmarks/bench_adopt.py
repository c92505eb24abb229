"""Adoption throughput: ``FlatPool().adopt(tensors)`` against one fresh 256 MiB copy.

Figure: adopt N fresh tensors totalling ``total`` bytes into a fresh pool (allocation, copy,
rebinding and the release proof included; the originals die inside the timed region).
Baseline: ``torch.empty`` + ``copy_`` of one tensor of the same total size (memory-bandwidth
limit; both pay first-touch page faults). Also compared with a naive per-tensor loop (narrow +
``copy_`` + rebind of ``.data``), the way hand-written fusion groups do it.
"""

from __future__ import annotations

import time

import torch

from flatpool import FlatPool

from ._common import Result, fmt_s, interleaved, median, median_ratio

MiB = 1 << 20
TARGETS = {16: 1.10, 1000: 1.25, 10000: 1.5}


def _tensors(n: int, total: int) -> list[torch.Tensor]:
    numel = total // 4 // n
    return [torch.empty(numel).fill_(float(i % 7)) for i in range(n)]  # touched, like real shards


def cases(n: int, total: int) -> dict[str, object]:
    def flatpool_case() -> float:
        ts = _tensors(n, total)
        t0 = time.perf_counter()
        report = FlatPool("cpu").adopt(ts)
        dt = time.perf_counter() - t0
        if not report.all_released:
            raise AssertionError("adoption did not release every original")
        return dt

    def baseline_case() -> float:
        src = torch.empty(total // 4).fill_(1.0)
        t0 = time.perf_counter()
        dst = torch.empty_like(src)
        dst.copy_(src)
        dt = time.perf_counter() - t0
        del dst
        return dt

    def naive_case() -> float:
        ts = _tensors(n, total)
        t0 = time.perf_counter()
        flat = torch.empty(sum(t.numel() for t in ts))
        off = 0
        with torch.no_grad():
            for t in ts:
                k = t.numel()
                piece = flat.narrow(0, off, k)
                piece.copy_(t.view(-1))
                t.data = piece.view_as(t)
                off += k
        return time.perf_counter() - t0

    return {"flatpool": flatpool_case, "baseline": baseline_case, "naive": naive_case}


def run(quick: bool) -> list[Result]:
    total = 8 * MiB if quick else 256 * MiB
    counts = (16, 100, 1000) if quick else (16, 1000, 10000)
    reps = 2 if quick else 7
    out: list[Result] = []
    for n in counts:
        times = interleaved(cases(n, total), reps)  # type: ignore[arg-type]
        f, b, nv = times["flatpool"], times["baseline"], times["naive"]
        target = TARGETS.get(n)
        ratio = median_ratio(f, b)
        size = f"{n} tensors, {total // MiB} MiB"
        out.append(Result(
            "adopt", f"{size} vs one fresh copy", fmt_s(median(f)), fmt_s(median(b)), ratio,
            f"<= {target:.2f}" if target and not quick else "-",
            (ratio <= target) if target and not quick else None,
        ))
        rn = median_ratio(f, nv)
        must_win = n >= 1000 and not quick
        out.append(Result(
            "adopt", f"{size} vs naive loop", fmt_s(median(f)), fmt_s(median(nv)), rn,
            "< 1.00" if must_win else "-", (rn < 1.0) if must_win else None,
        ))
    return out
