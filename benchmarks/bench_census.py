"""Census over a model of N parameters with an Adam optimizer (state populated).

Figure: ``flatpool.census(model, optimizer)``. Baseline: a bare walk that visits the same
tensors (parameters, grads, optimizer state) and reads each one's storage identity: the
unavoidable part of any census. Target: the census under 1 s at 10,000 parameters.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from flatpool import census

from ._common import Result, fmt_s, interleaved, median, median_ratio


class Many(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(16)) for _ in range(n)])


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
    )]
