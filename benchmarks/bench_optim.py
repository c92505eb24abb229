"""Optimizer step: flatpool's flat step vs torch's per-parameter ``foreach=True`` and
``fused=True`` steps, and vs a bare AdamW step over one tensor of the same bytes (CPU), in one
process; then the same on a real 2-rank FSDP2 job (:mod:`benchmarks.bench_optim_fsdp2`).

Parameters are mixed small shapes (16 to 512 elements, 1-D and 2-D, float32), every one with a
gradient, AdamW with weight decay. The flat case adopts them into one pool (``alignment=1``,
the HSDP layer's packing) and steps through ``optimizer.step()`` with a
:class:`flatpool.optim.FlatOptimizer` set up on it (every step re-reads the optimizer's state,
param groups and gradients). Cases run round-robin in one process; ratios are medians of
per-round ratios. Peak memory is the largest sum of live bytes the CPU allocator reports to
torch's profiler during one warm step (state already made), temporaries included. Every case
runs with one intra-op thread.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from ._common import Case, Result, fmt_bytes, fmt_s, interleaved, median, median_ratio, timed


def _shapes(n: int, seed: int = 0) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    out: list[tuple[int, ...]] = []
    for _ in range(n):
        numel = rng.randint(16, 512)
        if rng.random() < 0.5:
            out.append((numel,))
        else:
            rows = rng.choice([2, 4, 8])
            out.append((rows, max(1, numel // rows)))
    return out


def _cases(n: int, shapes: list[tuple[int, ...]] | None = None
           ) -> tuple[dict[str, Callable[[], None]], int]:
    import torch

    from flatpool.optim import FlatOptimizer

    shapes = _shapes(n) if shapes is None else shapes
    g = torch.Generator().manual_seed(0)

    def params() -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]

    steps: dict[str, Callable[[], None]] = {}
    kw = dict(lr=1e-3, weight_decay=0.01)
    for name, extra in (("foreach", dict(foreach=True)), ("fused", dict(fused=True))):
        ps = params()
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt = torch.optim.AdamW(ps, **kw, **extra)  # type: ignore[arg-type]
        opt.step()  # state made: every timed step is a warm one
        steps[name] = opt.step
    ps = params()
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)  # the user's: copied in at every step
    opt = torch.optim.AdamW(ps, foreach=True, **kw)  # type: ignore[arg-type]
    FlatOptimizer(opt, [_adopted(ps, "bench")])
    opt.step()
    steps["flat"] = opt.step
    ps = params()  # gradients flatpool installed (module= hook; FSDP2's reduce-scatter alike)

    class Sum(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ps = torch.nn.ParameterList(ps)

        def forward(self) -> torch.Tensor:
            return torch.stack([p.sum() for p in self.ps]).sum()

    module = Sum()
    opt = torch.optim.AdamW(ps, foreach=True, **kw)  # type: ignore[arg-type]
    FlatOptimizer(opt, [_adopted(ps, "bench")], module=module)
    module().backward()  # the hook installs the pooled views; they stay the .grads
    opt.step()
    steps["flat pooled"] = opt.step
    total = sum(p.numel() for p in ps)
    one = torch.nn.Parameter(torch.randn(total, generator=g))
    one.grad = torch.randn(total, generator=g)
    bare = torch.optim.AdamW([one], foreach=True, **kw)  # type: ignore[arg-type]
    bare.step()
    steps["bare"] = bare.step
    return steps, total


def _adopted(ps: list[Any], name: str) -> Any:
    from flatpool import FlatPool

    pool = FlatPool(alignment=1, name=name)
    pool.adopt(ps)
    return pool


def peak_bytes(step: Callable[[], object]) -> int:
    """Largest live-bytes excess over the start seen by torch's profiler during one call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events()  # type: ignore[union-attr]
                     if e.name() == "[memory]"), key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


def run(quick: bool) -> list[Result]:
    import torch

    from . import bench_optim_fsdp2

    sizes = (200, 1000) if quick else (1000, 10000)
    results: list[Result] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one rank's share; threads would only fight on a shared machine
    try:
        for n in sizes:
            results.extend(_size(n, quick))
        for n in sizes:
            results.extend(_host(n, quick))
    finally:
        torch.set_num_threads(threads)
    return results + bench_optim_fsdp2.run(quick)


def _size(n: int, quick: bool) -> list[Result]:
    import torch

    results: list[Result] = []
    if True:
        steps, total = _cases(n)
        cases: dict[str, Case] = {k: (lambda f=f: timed(f)) for k, f in steps.items()}
        reps = 3 if quick else (30 if n <= 1000 else 12)
        with torch.no_grad():
            t = interleaved(cases, reps=reps, warmup=1)
        flat = t["flat"]
        side = "  ".join(f"{k} {fmt_s(median(v))}" for k, v in t.items())
        print(f"  [optim] {n} params ({total} elements): {side}", flush=True)
        vs_foreach = median_ratio(flat, t["foreach"])
        big = n >= 10000
        results.append(Result(
            "optim", f"AdamW step, {n} params: flat vs foreach=True", fmt_s(median(flat)),
            fmt_s(median(t["foreach"])), vs_foreach,
            "<= 0.25 (4x faster)" if big else "<= 1.0 (never slower)",
            None if quick else (vs_foreach <= (0.25 if big else 1.0)),
            note=f"{1 / vs_foreach:.1f}x faster"))
        results.append(Result(
            "optim", f"AdamW step, {n} params: flat vs fused=True", fmt_s(median(flat)),
            fmt_s(median(t["fused"])), median_ratio(flat, t["fused"]), "reported", None,
            note=f"{median(t['fused']) / median(flat):.1f}x faster"))
        vs_bare = median_ratio(flat, t["bare"])
        results.append(Result(
            "optim", f"AdamW step, {n} params: flat vs bare AdamW on one tensor of the same bytes",
            fmt_s(median(flat)), fmt_s(median(t["bare"])), vs_bare,
            "reported", None,
            note="the flat step checks every member's gradient and state entries each step"))
        with torch.no_grad():
            peaks = {k: peak_bytes(steps[k]) for k in ("flat", "foreach")}
        results.append(Result(
            "optim", f"AdamW step, {n} params: peak memory, flat vs foreach=True",
            fmt_bytes(peaks["flat"]), fmt_bytes(peaks["foreach"]),
            peaks["flat"] / max(1, peaks["foreach"]), "<= 1.0",
            None if quick else peaks["flat"] <= peaks["foreach"]))
    return results


HOST_FLOOR_S = 0.5e-6
"""The flat step's host time a member (issue 40): 5 ms at 10,000 members."""


def _host(n: int, quick: bool) -> list[Result]:
    """The host's share of a step: 4-element parameters, so the arithmetic is negligible and the
    time is what a GPU or NPU host would spend (Python, dispatch, one launch a kernel)."""
    import torch

    steps, _ = _cases(n, [(4,)] * n)
    steps["passes"] = _passes(n)
    cases: dict[str, Case] = {k: (lambda f=f: timed(f)) for k, f in steps.items()}
    with torch.no_grad():
        t = interleaved(cases, reps=3 if quick else 15, warmup=1)
    flat, user = median(t["flat pooled"]), median(t["flat"])
    print(f"  [optim host] {n} params of 4 elements: "
          + "  ".join(f"{k} {fmt_s(median(v))}" for k, v in t.items()), flush=True)
    big = n >= 10000
    return [Result(
        "optim", f"AdamW step host time, {n} 4-element params, pooled .grads: flat vs one "
        "tensor of the same elements", fmt_s(flat), fmt_s(median(t["bare"])),
        median_ratio(t["flat pooled"], t["bare"]),
        f"flat <= {fmt_s(HOST_FLOOR_S * n)}" if big else "reported",
        None if quick or not big else flat <= HOST_FLOOR_S * n,
        note=f"{flat / n * 1e6:.2f} us a member; the user's own .grads (copied in): "
             f"{fmt_s(user)}; fused=True {fmt_s(median(t['fused']))}, "
             f"foreach=True {fmt_s(median(t['foreach']))}"),
        Result("optim", f"AdamW step host time, {n} 4-element params: the per-member passes "
               "its checks make alone, vs the flat step", fmt_s(median(t["passes"])), fmt_s(flat),
               median_ratio(t["passes"], t["flat pooled"]), "reported", None,
               note=f"{median(t['passes']) / n * 1e6:.2f} us a member: reading each .grad, the "
                    "data pointers of parameters, gradients and 3 state entries, identities "
                    "(groups, .grads, optimizer.state, 3 entries), the version bump")]


def _passes(n: int) -> Callable[[], None]:
    """The C-level passes over the members that a torch-exact steady flat AdamW step makes
    (docs/optim.md "torch decides every step"), alone, over a replica of the benchmark's
    parameters: the floor of any step that checks at every step what torch's step reads."""
    import operator

    import torch
    from torch.autograd.graph import increment_version

    ptr, grad_of, is_ = torch.Tensor.data_ptr, operator.attrgetter("grad"), operator.is_
    ps = [torch.nn.Parameter(torch.zeros(4)) for _ in range(n)]
    pbuf, gbuf = torch.zeros(4 * n), torch.zeros(4 * n)
    bufs = {k: torch.zeros(4 * n) for k in ("exp_avg", "exp_avg_sq")}
    steps = torch.zeros(n)
    state: dict[Any, dict[str, torch.Tensor]] = {}
    for i, p in enumerate(ps):
        p.data = pbuf[4 * i:4 * i + 4]
        p.grad = gbuf[4 * i:4 * i + 4]
        state[p] = {"step": steps[i], **{k: b[4 * i:4 * i + 4] for k, b in bufs.items()}}
    group = list(ps)
    grads = [g for p in ps if (g := p.grad) is not None]
    keys, dicts = list(state), list(state.values())
    entries = {k: [d[k] for d in dicts] for k in ("step", "exp_avg", "exp_avg_sq")}
    addrs = {k: list(map(ptr, v)) for k, v in entries.items()}
    paddrs, gaddrs = list(map(ptr, ps)), list(map(ptr, grads))

    def passes() -> None:
        ok = (all(map(is_, group, ps)) and list(map(ptr, ps)) == paddrs
              and all(map(is_, state.keys(), keys)) and all(map(is_, state.values(), dicts))
              and all(map(is_, map(grad_of, ps), grads)) and list(map(ptr, grads)) == gaddrs)
        for k, v in entries.items():
            ok = ok and all(map(is_, map(operator.itemgetter(k), dicts), v)) and list(
                map(ptr, v)) == addrs[k]
        assert ok
        increment_version(ps)

    return passes


__all__ = ["peak_bytes", "run"]
