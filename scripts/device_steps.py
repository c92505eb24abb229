"""The steps of ``scripts/device_check.py``: each one checks a claim of flatpool on a device.

Every step is a function ``step(run, ctx)`` that records what it checked in ``run`` (a
:class:`Run`); the orchestrator runs each in its own process, so a CUDA error, a crash or a hang
in one leaves the others alone. ``ctx.dry`` selects the CPU dry run: the same code, ``cpu`` for
``cuda``, ``time.perf_counter`` for CUDA events, the CPU census record for the allocator's
snapshot, and tiny sizes; what CPU has no equivalent for is recorded as a skipped check that
says why, never silently left out.

Kept out of the installed packages (flatpool/, integrations/): it is a tool for a machine with a
GPU, run from a checkout by ``scripts/device_check.sh``.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import pickle
import platform
import random
import statistics
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20


# -- what a step records -----------------------------------------------------------------------


@dataclass
class Check:
    name: str
    ok: bool | None
    """``None``: not checkable here (the detail says why)."""
    detail: str = ""


@dataclass
class Run:
    """What one step found: checks (any ``False`` fails the step), figures (numbers for the
    results file and the docs), markdown tables, notes and the files it wrote under ``out``."""

    name: str
    checks: list[Check] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    tables: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    artifacts: list[str] = field(default_factory=list)
    error: str | None = None

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, bool(ok), detail))
        print(f"  [{'ok' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}", flush=True)
        return bool(ok)

    def skip(self, name: str, why: str) -> None:
        self.checks.append(Check(name, None, why))
        print(f"  [skip] {name}: {why}", flush=True)

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"  note: {text}", flush=True)

    @property
    def status(self) -> str:
        if self.error is not None:
            return "error"
        return "failed" if any(c.ok is False for c in self.checks) else "passed"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["status"] = self.status
        return out


@dataclass(frozen=True)
class Ctx:
    dry: bool
    out: Path
    """The results folder (files written here come back from the device machine)."""
    tmp: Path
    """Scratch space of this run (deleted afterwards)."""

    @property
    def kind(self) -> str:
        return "cpu" if self.dry else "cuda"


def md_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def fmt_ratio(r: float) -> str:
    """``0.25 (4.0x faster)`` / ``2.00 (2.0x slower)``: a time ratio, flat over the other."""
    return f"{r:.3f} ({1 / r:.1f}x faster)" if r <= 1 else f"{r:.3f} ({r:.1f}x slower)"


# -- the device: cuda, or cpu in the dry run ----------------------------------------------------


class Dev:
    """The device a step runs on, and the three things that differ between CUDA and CPU: how
    to wait for queued work, the caching allocator's counters, and the clock."""

    def __init__(self, ctx: Ctx) -> None:
        import torch

        self.torch = torch
        self.dry = ctx.dry
        if ctx.dry:  # one intra-op thread: CI's 2 shared cores, where threads only contend
            torch.set_num_threads(1)
        self.device = torch.device("cpu") if ctx.dry else torch.device("cuda", torch.cuda.current_device())

    def sync(self) -> None:
        if not self.dry:
            self.torch.cuda.synchronize(self.device)

    def counters(self) -> dict[str, int] | None:
        """``{"allocated", "reserved"}`` bytes (``torch.cuda.memory_allocated`` /
        ``memory_reserved``, read through flatpool); ``None`` on CPU, which has no caching
        allocator."""
        from flatpool import allocator_counters

        if self.dry:
            return None
        gc.collect()  # (a dropped tensor waiting in a reference cycle would still count)
        self.sync()
        return allocator_counters(self.device)

    def time(self, fn: Callable[[], object]) -> float:
        """Seconds ``fn`` takes on the device: CUDA events around it (the GPU's own clock,
        launch gaps included), ``perf_counter`` on CPU."""
        torch = self.torch
        if self.dry:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3

    @property
    def timer_name(self) -> str:
        return "time.perf_counter (CPU dry run)" if self.dry else "CUDA events"


def interleaved(dev: Dev, cases: dict[str, Callable[[], object]], rounds: int,
                warmup: int) -> dict[str, list[float]]:
    """Each case once per round, the order rotating every round; the measured rounds' seconds."""
    names = list(cases)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            t = dev.time(cases[n])
            if r >= warmup:
                out[n].append(t)
    return out


def median_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """Median of the per-round ratios (each round's pair ran back to back)."""
    return statistics.median(a / b for a, b in zip(num, den))


# -- environment --------------------------------------------------------------------------------


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                           timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _nvidia_driver() -> str | None:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None


def step_environment(run: Run, ctx: Ctx) -> None:
    """Which Python, torch, CUDA and device this is, and which flatpool it imports."""
    import torch

    import flatpool

    f = run.figures
    f["python"] = f"{platform.python_version()} ({sys.executable})"
    f["torch"] = torch.__version__
    f["cuda_build"] = torch.version.cuda
    import flatpool.integrations.hsdp as hsdp

    f["flatpool_from"] = str(Path(flatpool.__file__).parent)
    f["flatpool_integrations_from"] = str(Path(str(hsdp.__file__)).parent.parent)
    commit = _git("rev-parse", "--short=12", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    # A copy of the working tree without git history (the lent GPU machines get one) names its
    # commit through FLATPOOL_DEVICE_COMMIT.
    f["commit"] = (commit + (" (uncommitted changes)" if dirty else "") if commit is not None
                   else os.environ.get("FLATPOOL_DEVICE_COMMIT"))
    f["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        f["device"] = props.name
        f["device_count"] = torch.cuda.device_count()
        f["capability"] = f"{props.major}.{props.minor}"
        f["device_memory_gib"] = round(props.total_memory / (1 << 30), 1)
        f["driver"] = _nvidia_driver()
        try:
            nccl = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
            f["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        except Exception as exc:  # noqa: BLE001 - reported, not needed
            f["nccl"] = f"unknown ({type(exc).__name__})"
    else:
        f["device"] = "cpu (dry run)" if ctx.dry else None
    try:
        import matplotlib

        f["matplotlib"] = matplotlib.__version__
    except ImportError:
        f["matplotlib"] = None
    for key, value in f.items():
        print(f"  {key}: {value}", flush=True)
    run.check("flatpool is this checkout's flatpool/, flatpool.integrations its integrations/",
              Path(flatpool.__file__).resolve().parent == (REPO / "flatpool").resolve()
              and Path(str(hsdp.__file__)).resolve().parent.parent == (REPO / "integrations").resolve(),
              f"{f['flatpool_from']}, {f['flatpool_integrations_from']}")
    if ctx.dry:
        run.skip("a CUDA device", "dry run: everything runs on CPU")
    else:
        run.check("torch sees a CUDA device", torch.cuda.is_available(),
                  f"{f['device']}" if torch.cuda.is_available() else
                  "torch.cuda.is_available() is False: run with --dry-run on a machine without a GPU")
    if f["matplotlib"] is None:
        run.note("matplotlib is missing: the memory pictures are skipped")


# -- (a) the test suite's device-marked tests ---------------------------------------------------

DEVICE_TEST_FILES = ("tests/test_devices.py", "tests/test_memory_device.py")
"""What the dry run collects (the whole suite costs CI a collection of every module); the full
run collects ``tests/`` and selects by the ``device`` marker."""


def step_tests(run: Run, ctx: Ctx) -> None:
    """``pytest -m device``: the tests that need an accelerator (skipped everywhere else)."""
    paths = [str(REPO / p) for p in DEVICE_TEST_FILES] if ctx.dry else [str(REPO / "tests")]
    junit = ctx.tmp / "device-tests.xml"
    cmd = [sys.executable, "-X", "faulthandler", "-m", "pytest", "-q", "-rs", "-m", "device",
           "-p", "no:cacheprovider", "--rootdir", str(REPO), "--junitxml", str(junit), *paths]
    run.figures["command"] = " ".join(["python", *cmd[1:]]).replace(str(REPO) + "/", "")
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=str(ctx.tmp), capture_output=True, text=True)
    run.figures["seconds"] = round(time.perf_counter() - t0, 1)
    print(r.stdout[-6000:], r.stderr[-3000:], sep="\n", flush=True)
    if not junit.exists():
        run.check("pytest ran", False, f"exit code {r.returncode}, no junit file")
        return
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    tests, failures, errors, skipped = (int(suite.get(k, 0)) for k in
                                        ("tests", "failures", "errors", "skipped"))
    passed = tests - failures - errors - skipped
    run.figures.update(selected=tests, passed=passed, failed=failures, errors=errors,
                       skipped=skipped, exit_code=r.returncode)
    failed_names = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                    if c.find("failure") is not None or c.find("error") is not None]
    summary = f"{tests} selected: {passed} passed, {failures} failed, {errors} errors, {skipped} skipped"
    run.check("device-marked tests were selected", tests > 0, summary)
    run.check("none failed", failures == 0 and errors == 0 and r.returncode in (0, 5),
              ", ".join(failed_names) or f"exit code {r.returncode}")
    if ctx.dry:
        run.check("on CPU every one of them skips (they need an accelerator)", skipped == tests,
                  summary)
    else:
        run.check("on CUDA none is skipped", skipped == 0 and passed > 0, summary)


# -- (b) adopt and release on the caching allocator ---------------------------------------------


def _round_block(nbytes: int) -> int:
    return max(512, -(-nbytes // 512) * 512)


def _block_at(dev: Dev, address: int) -> Any:
    """The allocator block holding ``address`` now (CUDA), from flatpool's snapshot parser."""
    from flatpool.memory import device_snapshot, parse_snapshot

    snap = parse_snapshot(device_snapshot(dev.device))
    for seg in snap.segments:
        for b in seg.blocks:
            if b.address <= address < b.end:
                return b
    return None


def step_adopt(run: Run, ctx: Ctx) -> None:
    """Adopt a module's parameters on ``cuda``: the originals' blocks go back to the caching
    allocator (``memory_allocated`` falls by them, their blocks are inactive and reused), the
    pool's block is the only thing held, and nothing is left once the pool is dropped."""
    import torch
    from torch import nn

    from flatpool import FlatPool
    from flatpool.memory import WatchedStorages

    dev = Dev(ctx)
    layers, width = (3, 32) if ctx.dry else (8, 1024)
    torch.manual_seed(0)
    # cuBLAS keeps its workspace in the caching allocator from the first matmul on: make it
    # before the baseline, or it would count as left over at the end.
    warm = nn.Linear(width, width).to(dev.device)
    warm(torch.randn(4, width, device=dev.device)).sum().backward()
    del warm
    base = dev.counters()
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(dev.device)
    model.register_parameter("scale", nn.Parameter(torch.randn(width * 4, device=dev.device,
                                                                dtype=torch.bfloat16)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=True)
    params = list(model.parameters())
    named = dict(model.named_parameters())
    values = [p.detach().to("cpu", copy=True) for p in params]
    addresses = {n: p.untyped_storage().data_ptr() for n, p in named.items()}
    originals = sum(_round_block(p.untyped_storage().nbytes()) for p in params)
    watch = WatchedStorages(named)
    before = dev.counters()
    if before is not None:  # the originals' blocks as the allocator rounded them
        originals = sum(_block_at(dev, a).size for a in addresses.values())
    if not dev.dry:
        torch.cuda.reset_peak_memory_stats(dev.device)
    pool = FlatPool(dev.device, name="adopt-check")
    t0 = time.perf_counter()
    report = pool.adopt(params)
    dev.sync()
    run.figures["adopt_seconds"] = round(time.perf_counter() - t0, 4)
    after = dev.counters()
    run.figures.update(parameters=len(params), original_bytes=originals, pool_capacity=pool.capacity)
    run.check("report.all_released (the release proof)", report.all_released)
    run.check("every original storage died (weak references)", watch.alive_storages() == [],
              str(watch.alive_storages()[:3]))
    run.check("the parameters are the same objects, in the pool, with their values",
              all(pool.owns(p) for p in params)
              and all(a is b for a, b in zip(opt.param_groups[0]["params"], params))
              and all(torch.equal(p.detach().cpu(), v) for p, v in zip(params, values)))
    if base is None or before is None or after is None:
        why = "CPU has no caching allocator: memory_allocated/memory_reserved are CUDA's"
        run.skip("memory_allocated falls by the originals' blocks", why)
        run.skip("the originals' blocks are inactive (back in the cache) and reused", why)
    else:
        pool_block = _block_at(dev, pool.storage.data_ptr())
        pool_bytes = pool_block.size if pool_block is not None else _round_block(pool.capacity)
        run.figures.update(
            allocated_base=base["allocated"], allocated_before=before["allocated"],
            allocated_after=after["allocated"], reserved_before=before["reserved"],
            reserved_after=after["reserved"], pool_block=pool_bytes,
            peak_during_adopt_above_before=int(torch.cuda.max_memory_allocated(dev.device))
            - before["allocated"])
        held_before = before["allocated"] - base["allocated"]
        held_after = after["allocated"] - base["allocated"]
        run.check("before: memory_allocated held exactly the originals' blocks",
                  held_before == originals, f"{held_before} B held, originals {originals} B")
        run.check("after: memory_allocated holds exactly the pool's block (nothing double-held)",
                  held_after == pool_bytes,
                  f"{held_after} B held, pool block {pool_bytes} B (capacity {pool.capacity} B)")
        lost = [n for n, a in addresses.items()
                if (b := _block_at(dev, a)) is not None and b.active and not
                (pool.storage.data_ptr() <= a < pool.storage.data_ptr() + pool.capacity)]
        run.check("every original's block is inactive: back in the caching allocator",
                  not lost, ", ".join(lost))
        run.check("memory_reserved did not drop (the allocator keeps the blocks for reuse)",
                  after["reserved"] >= before["reserved"],
                  f"{before['reserved']} -> {after['reserved']} B")
        again = [torch.empty_like(v, device=dev.device) for v in values]
        reused = dev.counters()
        assert reused is not None
        run.figures["reserved_after_reuse"] = reused["reserved"]
        run.check("the same sizes again come from the cache (memory_reserved unchanged)",
                  reused["reserved"] == after["reserved"],
                  f"{after['reserved']} -> {reused['reserved']} B")
        del again
    x = torch.randn(4, width, device=dev.device)
    loss = model(x).float().square().mean() + model.get_parameter("scale").float().square().mean()
    loss.backward()
    opt.step()
    dev.sync()
    run.check("a training step on the pooled parameters (forward, backward, Adam)",
              bool(torch.isfinite(loss)) and all(pool.owns(p) for p in params))
    del model, opt, params, named, pool, report, loss, x
    final = dev.counters()
    if base is not None and final is not None:
        run.figures["allocated_final"] = final["allocated"]
        run.check("dropping the model and the pool gives back every byte",
                  final["allocated"] == base["allocated"],
                  f"{final['allocated'] - base['allocated']} B left")
    else:
        run.skip("dropping the model and the pool gives back every byte",
                 "CPU has no caching allocator")
    f = run.figures
    if "allocated_before" in f:
        run.tables.append(md_table(
            ["", "memory_allocated", "memory_reserved"],
            [["before adopt", f["allocated_before"], f["reserved_before"]],
             ["after adopt", f["allocated_after"], f["reserved_after"]],
             ["same sizes allocated again", "", f["reserved_after_reuse"]]]))


# -- (c) the flat optimizer step ------------------------------------------------------------


def flat_stepper(params: list[Any], optimizer: Any, device: Any, name: str) -> Callable[[], object]:
    """Pool ``params`` and return the call that runs one flat step of ``optimizer``.

    The one place this check touches ``flatpool.optim``. Written against the API every version
    has: ``FlatOptimizer(optimizer, [pool])``, then ``flat.step()``. (Where ``optimizer.step()``
    itself runs the flat step, return ``optimizer.step`` instead.)
    """
    from flatpool import FlatPool
    from flatpool.optim import FlatOptimizer

    pool = FlatPool(device, alignment=1, name=name)
    pool.adopt(params)
    flat = FlatOptimizer(optimizer, [pool])
    return flat.step


def _shapes(n: int, seed: int = 0) -> list[tuple[int, ...]]:
    """Mixed small parameters (16 to 512 elements, 1-D and 2-D), as benchmarks/bench_optim."""
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


OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "AdamW": ("AdamW", dict(lr=1e-3, weight_decay=0.1)),
    "SGD": ("SGD", dict(lr=1e-2, momentum=0.9, weight_decay=0.01)),
    "Adam": ("Adam", dict(lr=1e-3, weight_decay=0.01)),
}


class Trio:
    """The same parameters three times: per-parameter ``foreach=True``, per-parameter
    ``fused=True``, and pooled with the flat step; one gradient source for all three."""

    def __init__(self, dev: Dev, opt_name: str, n: int, dtype: Any) -> None:
        import torch
        from torch import nn

        cls_name, kw = OPTIMIZERS[opt_name]
        cls = getattr(torch.optim, cls_name)
        self.dev, self.torch = dev, torch
        shapes = _shapes(n)
        self.numels = [int(torch.Size(s).numel()) for s in shapes]
        self.shapes = shapes
        g = torch.Generator(device=dev.device).manual_seed(1)
        init = torch.randn(sum(self.numels), generator=g, device=dev.device).to(dtype)

        def params() -> list[Any]:
            return [nn.Parameter(t.view(s).clone()) for t, s in
                    zip(torch.split(init, self.numels), shapes)]

        self.gen = g
        self.dtype = dtype
        self.ps = {k: params() for k in ("foreach", "fused", "flat")}
        self.opts = {"foreach": cls(self.ps["foreach"], foreach=True, **kw),
                     "fused": cls(self.ps["fused"], fused=True, **kw),
                     "flat": cls(self.ps["flat"], foreach=True, **kw)}
        self.steps: dict[str, Callable[[], object]] = {
            "foreach": self.opts["foreach"].step, "fused": self.opts["fused"].step,
            "flat": flat_stepper(self.ps["flat"], self.opts["flat"], dev.device,
                                 f"{opt_name}-{n}-{str(dtype).replace('torch.', '')}")}

    def new_grads(self) -> None:
        """Fresh random gradients, the same values for the three (the flat one's written into
        its pooled gradient views, where autograd would accumulate them)."""
        torch = self.torch
        flat = torch.randn(sum(self.numels), generator=self.gen, device=self.dev.device).to(self.dtype)
        grads = [t.view(s) for t, s in zip(torch.split(flat, self.numels), self.shapes)]
        with torch.no_grad():
            for kind, ps in self.ps.items():
                for p, gr in zip(ps, grads):
                    if kind == "flat" and p.grad is not None:
                        p.grad.copy_(gr)
                    else:
                        p.grad = gr.clone()

    def step_all(self) -> None:
        for step in self.steps.values():
            step()
        self.dev.sync()

    def identical_to_foreach(self) -> tuple[bool, str]:
        """Parameters and every state tensor of the flat run ``torch.equal`` to foreach's."""
        torch = self.torch
        a, b = self.opts["foreach"], self.opts["flat"]
        for i, (p, q) in enumerate(zip(self.ps["foreach"], self.ps["flat"])):
            if not torch.equal(p, q):
                return False, f"parameter {i} differs"
            sa, sb = a.state[p], b.state[q]
            if sorted(sa) != sorted(sb):
                return False, f"parameter {i}: state keys {sorted(sa)} vs {sorted(sb)}"
            for k in sa:
                x, y = sa[k], sb[k]
                if isinstance(x, torch.Tensor) and not torch.equal(x, torch.as_tensor(y, device=x.device)):
                    return False, f"parameter {i}: state {k!r} differs"
        return True, "parameters and optimizer state torch.equal"

    def vs_fused(self) -> tuple[float, float, int]:
        """Flat vs fused: the largest absolute difference where both are finite, the share of
        elements that differ, and how many elements are not finite in either (float16 Adam:
        an ``exp_avg_sq`` that underflows to 0)."""
        torch = self.torch
        flat = torch.cat([p.detach().flatten().double() for p in self.ps["flat"]])
        fused = torch.cat([p.detach().flatten().double() for p in self.ps["fused"]])
        finite = torch.isfinite(flat) & torch.isfinite(fused)
        diff = (flat - fused).abs()[finite]
        differ = float((~(flat == fused)).double().mean())
        return (float(diff.max()) if diff.numel() else 0.0, differ,
                int(flat.numel() - int(finite.sum())))


def step_optim(run: Run, ctx: Ctx) -> None:
    """One flat AdamW / SGD / Adam step over pooled parameters against the same optimizer per
    parameter with ``foreach=True`` (bit-identity) and ``fused=True`` (time), on the device."""
    import warnings

    import torch

    dev = Dev(ctx)
    sizes = (10, 40) if ctx.dry else (1000, 10000)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    steps = 2 if ctx.dry else 3
    rounds = {sizes[0]: 3 if ctx.dry else 30, sizes[1]: 3 if ctx.dry else 20}
    warmup = 1 if ctx.dry else 3
    ident_rows: list[list[object]] = []
    time_rows: list[list[object]] = []
    warnings.simplefilter("ignore")  # FlatStepWarning etc. are not what this step measures

    def timing(key: str, opt_name: str, n: int, t: dict[str, list[float]]) -> None:
        med = {k: statistics.median(v) for k, v in t.items()}
        r_fe, r_fu = median_ratio(t["flat"], t["foreach"]), median_ratio(t["flat"], t["fused"])
        run.figures[f"time/{opt_name}/{n}"] = {
            "flat_s": med["flat"], "foreach_s": med["foreach"], "fused_s": med["fused"],
            "flat_over_foreach": r_fe, "flat_over_fused": r_fu, "rounds": rounds[n]}
        time_rows.append([opt_name, n, fmt_ms(med["flat"]), fmt_ms(med["foreach"]),
                          fmt_ms(med["fused"]), fmt_ratio(r_fe), fmt_ratio(r_fu)])
        print(f"  {key}: flat {fmt_ms(med['flat'])}, foreach {fmt_ms(med['foreach'])}, "
              f"fused {fmt_ms(med['fused'])}", flush=True)
    for opt_name in OPTIMIZERS:
        for n in sizes:
            for dtype in dtypes:
                dt = str(dtype).replace("torch.", "")
                key = f"{opt_name}/{n}/{dt}"
                try:
                    trio = Trio(dev, opt_name, n, dtype)
                    for _ in range(steps):
                        trio.new_grads()
                        trio.step_all()
                    same, why = trio.identical_to_foreach()
                    dmax, share, nonfinite = trio.vs_fused()
                    run.figures[f"identical/{key}"] = same
                    run.figures[f"vs_fused_max_abs/{key}"] = dmax
                    run.figures[f"nonfinite/{key}"] = nonfinite
                    ident_rows.append([opt_name, n, dt, "yes" if same else f"NO ({why})",
                                       f"{dmax:.3g}", f"{share:.1%}", nonfinite])
                    if dtype == torch.float32:
                        run.check(f"{key}: flat step bit-identical to foreach=True", same, why)
                        t = interleaved(dev, trio.steps, rounds[n], warmup)
                        timing(key, opt_name, n, t)
                    else:
                        print(f"  {key}: identical to foreach: {same} ({why})", flush=True)
                    del trio
                except Exception as exc:  # noqa: BLE001 - one case's failure is recorded
                    run.check(f"{key}: runs", False, f"{type(exc).__name__}: {exc}")
                    traceback.print_exc()
    run.tables.append("Bit-identity after {} steps (float32 asserted; bfloat16 and float16 "
                      "recorded as the device does them):\n\n".format(steps) + md_table(
                          ["optimizer", "parameters", "dtype", "flat == foreach=True",
                           "max abs diff vs fused=True (finite)", "elements differing vs fused",
                           "non-finite elements"],
                          ident_rows))
    run.tables.append(f"Step time, float32, {dev.timer_name}, interleaved rounds, medians; the "
                      "ratios are medians of per-round ratios (below 1: flat is faster):\n\n"
                      + md_table(["optimizer", "parameters", "flat", "foreach=True", "fused=True",
                                  "flat / foreach", "flat / fused"], time_rows))
    half = [k for k, v in run.figures.items() if k.startswith("identical/") and "float32" not in k]
    run.figures["half_identical"] = {k: run.figures[k] for k in half}


# -- (f) where a flat fused step is exact ---------------------------------------------------

FUSED_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "Adam": ("Adam", dict(lr=1e-2)),
    "Adam wd": ("Adam", dict(lr=1e-2, weight_decay=0.1)),
    "Adam amsgrad maximize": ("Adam", dict(lr=1e-2, amsgrad=True, maximize=True, weight_decay=0.01)),
    "AdamW": ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
    "AdamW amsgrad": ("AdamW", dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    "SGD": ("SGD", dict(lr=0.05)),
    "SGD wd maximize": ("SGD", dict(lr=0.05, weight_decay=0.01, maximize=True)),
    "SGD momentum": ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    "SGD nesterov": ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True)),
}


def _flat_fused_equal(dev: Dev, cls: Any, kw: dict[str, Any], dtype: Any, seed: int,
                      steps: int, n: int) -> bool:
    """``fused=True`` over one flat tensor ``torch.equal`` to ``fused=True`` per parameter."""
    torch = dev.torch
    rng = random.Random(seed)
    numels = [rng.randint(1, 700) for _ in range(n)]
    g = torch.Generator(device=dev.device).manual_seed(seed)
    init = torch.randn(sum(numels), generator=g, device=dev.device).to(dtype)
    per = [torch.nn.Parameter(t.clone()) for t in torch.split(init, numels)]
    flat = torch.nn.Parameter(init.clone())
    o_per, o_flat = cls(per, fused=True, **kw), cls([flat], fused=True, **kw)
    for _ in range(steps):
        grad = torch.randn(sum(numels), generator=g, device=dev.device).to(dtype)
        for p, gr in zip(per, torch.split(grad, numels)):
            p.grad = gr.clone()
        flat.grad = grad.clone()
        o_per.step()
        o_flat.step()
    dev.sync()
    return bool(torch.equal(torch.cat([p.detach() for p in per]), flat.detach()))


def step_fused(run: Run, ctx: Ctx) -> None:
    """Where ``fused=True`` over one flat tensor is ``torch.equal`` to ``fused=True`` per
    parameter on this device (dtype x optimizer), against flatpool's table of where it steps a
    fused group flat (``FUSED_EXACT``), and a fused AdamW group through the flat optimizer
    ``torch.equal`` to torch's own fused step."""
    import warnings

    import torch
    from torch import nn

    from flatpool import FlatPool
    from flatpool.optim import FlatOptimizer
    from flatpool.optim._rules import FUSED_EXACT

    warnings.simplefilter("ignore")
    dev = Dev(ctx)
    kind = dev.device.type
    seeds, steps, n = (1, 2, 6) if ctx.dry else (3, 5, 12)
    dtypes = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    rows: list[list[object]] = []
    found: dict[tuple[str, str], list[str]] = {}
    for case, (cls_name, kw) in FUSED_CASES.items():
        cls = getattr(torch.optim, cls_name)
        family = "adam" if cls_name.startswith("Adam") else "sgd"
        row: list[object] = [case]
        for dtype in dtypes:
            dt = str(dtype).replace("torch.", "")
            try:
                exact = all(_flat_fused_equal(dev, cls, kw, dtype, s, steps, n) for s in range(seeds))
            except Exception as exc:  # noqa: BLE001 - a dtype the fused kernel refuses here
                row.append(f"n/a ({type(exc).__name__})")
                continue
            run.figures[f"fused_exact/{kind}/{case}/{dt}"] = exact
            row.append("yes" if exact else "no")
            if exact:
                found.setdefault((kind, family), []).append(f"{case}/{dt}")
            claimed = dtype in FUSED_EXACT.get((kind, family), ()) and kw.get("momentum", 0) == 0
            if claimed:
                run.check(f"{case}/{dt}: FUSED_EXACT steps it flat, and it is exact here", exact)
        rows.append(row)
    run.tables.append(
        f"fused=True over one flat tensor vs fused=True per parameter on {kind}, {seeds} seed(s) "
        f"x {steps} steps, {n} parameters of 1-700 elements (yes: torch.equal):\n\n"
        + md_table(["optimizer"] + [str(d).replace("torch.", "") for d in dtypes], rows))
    for (k, family), cases in sorted(found.items()):
        run.note(f"exact on {k} for {family}: {', '.join(cases)} (FUSED_EXACT lists "
                 f"{[str(d) for d in FUSED_EXACT.get((k, family), ())]})")
    # The flat optimizer honours fused=True: torch.equal to torch's own fused step.
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 13), nn.Tanh(), nn.Linear(13, 5)).to(dev.device)
    flat = nn.Sequential(nn.Linear(8, 13), nn.Tanh(), nn.Linear(13, 5)).to(dev.device)
    flat.load_state_dict(ref.state_dict())
    pool = FlatPool(dev.device, name="fused")
    pool.adopt(list(flat.parameters()))
    o_ref = torch.optim.AdamW(ref.parameters(), fused=True, lr=1e-2, weight_decay=0.1)
    o_flat = torch.optim.AdamW(flat.parameters(), fused=True, lr=1e-2, weight_decay=0.1)
    FlatOptimizer(o_flat, [pool], module=flat)
    for step in range(5):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step)).to(dev.device)
        for m, o in ((ref, o_ref), (flat, o_flat)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    dev.sync()
    run.check("a fused=True AdamW group through FlatOptimizer is torch.equal to torch's fused step",
              all(torch.equal(a, b) for a, b in zip(ref.parameters(), flat.parameters())))


# -- (d) a memory snapshot, attributed --------------------------------------------------------


def step_snapshot(run: Run, ctx: Ctx) -> None:
    """The allocator's snapshot (``torch.cuda.memory._snapshot()``, with allocation history)
    attributed by ``flatpool.memory``: a naive copy leaves the originals stale beside the pool;
    after adoption only the pool is left. The picture goes to ``device-snapshot.png``."""
    import torch
    from torch import nn

    from flatpool import AdoptSpec, FlatPool
    from flatpool.memory import (WatchedStorages, build_manifest, capture, cpu_snapshot,
                                 draw_comparison)
    from flatpool.memory.__main__ import main as memory_cli

    dev = Dev(ctx)
    hidden, ffn = (32, 64) if ctx.dry else (1024, 2048)
    recording = False
    if ctx.dry:
        run.skip("allocation history (torch.cuda.memory._record_memory_history)",
                 "CPU has no allocator history; the snapshot is flatpool's CPU census record")
    else:
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=100_000)
        recording = True
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(hidden, ffn, bias=False), nn.Linear(ffn, hidden, bias=False))
        model = model.to(dev.device)
        watch = WatchedStorages(dict(model.named_parameters()))
        stray = torch.zeros(300_000 if not ctx.dry else 3000, device=dev.device)  # no root reaches it
        pool = FlatPool(dev.device, name="fused")
        slices = [pool.allocate(tuple(p.shape), p.dtype) for p in model.parameters()]
        for p, s in zip(model.parameters(), slices):  # the naive rebase: copies into the pool,
            s.tensor().copy_(p.detach())              # the model still on its originals
        dev.sync()
        scan = ctx.dry
        a = capture(roots={"model": model}, pools=[pool], watch=watch, device=dev.device, scan=scan)
        run.figures["naive"] = {"source": a.source, "active_bytes": a.active_bytes,
                                "reserved_bytes": a.reserved_bytes,
                                "by_class": {t.kind: t.nbytes for t in a.totals}}
        run.check("naive rebase: both originals are attributed stale",
                  sorted(i.label for i in a.stale) == ["0.weight", "1.weight"],
                  str([(i.label, i.nbytes) for i in a.stale]))
        run.check("the classes add up to the snapshot's active bytes",
                  sum(t.nbytes for t in a.totals) == a.active_bytes)
        pool_items = [i for i in a.items_of("pool") if i.label == "fused"]
        run.check("the pool's block is attributed to the pool",
                  len(pool_items) == 1 and pool_items[0].nbytes >= pool.capacity)
        stray_items = [i for i in a.items_of("unattributed") if i.address == stray.data_ptr()]
        if ctx.dry:
            run.check("a tensor no root reaches is unattributed (census scan)", len(stray_items) == 1)
        else:
            counters = dev.counters()
            assert counters is not None
            run.check("active bytes == torch.cuda.memory_allocated()",
                      a.active_bytes == counters["allocated"],
                      f"{a.active_bytes} vs {counters['allocated']}")
            run.check("reserved bytes == torch.cuda.memory_reserved()",
                      a.reserved_bytes == counters["reserved"],
                      f"{a.reserved_bytes} vs {counters['reserved']}")
            here = Path(__file__).name
            run.check("a tensor no root reaches is unattributed, named by its allocation's frame",
                      len(stray_items) == 1 and here in stray_items[0].reason,
                      stray_items[0].reason if stray_items else "not found")
        pool.adopt([AdoptSpec(p, slice=s) for p, s in zip(model.parameters(), slices)])
        dev.sync()
        b = capture(roots={"model": model}, pools=[pool], watch=watch, device=dev.device, scan=scan)
        run.figures["adopted"] = {"source": b.source, "active_bytes": b.active_bytes,
                                  "reserved_bytes": b.reserved_bytes,
                                  "by_class": {t.kind: t.nbytes for t in b.totals}}
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        run.check("after adoption nothing is stale and the pool holds the weights",
                  b.stale == () and b.manifest.pool("fused").adopted_bytes == weights)
        run.check("active bytes fell by the originals' bytes",
                  a.active_bytes - b.active_bytes >= weights,
                  f"{a.active_bytes} -> {b.active_bytes} B")
        png = ctx.out / "device-snapshot.png"
        try:
            draw_comparison(png, [("naive rebase", a), ("flatpool adopt", b)])
            run.artifacts.append(png.name)
            run.check("the picture was drawn", png.stat().st_size > 0, png.name)
        except ImportError as exc:
            run.skip("the picture", f"matplotlib missing: {exc}")
        # The offline path: the snapshot pickle and the manifest, attributed by the CLI.
        manifest = build_manifest({"model": model}, pools=[pool], watch=watch)
        manifest.write(ctx.tmp / "manifest.json")
        snap = ctx.tmp / "snapshot.pickle"
        if ctx.dry:
            snap.write_bytes(pickle.dumps(cpu_snapshot(manifest)))
        else:
            torch.cuda.memory._dump_snapshot(str(snap))  # type: ignore[no-untyped-call]
            run.figures["snapshot_pickle_bytes"] = snap.stat().st_size
        with contextlib.redirect_stdout(io.StringIO()) as text:
            rc = memory_cli([str(snap), "--manifest", str(ctx.tmp / "manifest.json")])
        run.check("python -m flatpool.memory attributes the dumped snapshot", rc == 0 and
                  "= active bytes" in text.getvalue() and "fused" in text.getvalue(), f"exit {rc}")
        run.tables.append("Attribution after adoption (`render()`):\n\n```text\n"
                          + b.render(top=6) + "\n```")
        del stray
    finally:
        if recording:
            torch.cuda.memory._record_memory_history(enabled=None)


# -- (e) the demo's fusion on the device --------------------------------------------------------


def step_demo(run: Run, ctx: Ctx) -> None:
    """The demo's FSDP2 modes on ``cuda`` with NCCL, one rank per device (on CPU: one gloo rank,
    tiny widths), judged from its rows; the HyperParallel simulation where there are 2+ ranks.

    With one device the shard world size is 1, where ``fuse_fully_sharded`` leaves a group
    unfused on purpose (nothing is all-gathered, docs/integration.md): that row is recorded as
    skipped with the demo's own words, and the checks are the ones one rank can make (the naive
    rebase leaves stale originals, meta init lands in the pool, training is identical).
    """
    import torch

    from examples import demo, demo_hyperparallel
    from examples.demo_run import Config
    from examples.launch import launch

    if ctx.dry:
        cfg = Config(device="cpu", backend="gloo", world_size=1, hidden=64, ffn=128, steps=1)
    else:
        world = torch.cuda.device_count()
        try:
            import matplotlib  # noqa: F401  (the pictures need it; the demo's rank would fail)
            drawable = world == 1  # one picture a rank: the results folder carries 8 files
        except ImportError:
            drawable = False
        cfg = Config(device="cuda", backend="nccl", world_size=world,
                     png=str(ctx.out / "demo") if drawable else None)
    run.figures.update(world_size=cfg.world_size, backend=cfg.backend, hidden=cfg.hidden,
                       ffn=cfg.ffn, steps=cfg.steps)
    t0 = time.perf_counter()
    ranks = launch(demo.rank_main, cfg, world_size=cfg.world_size, backend=cfg.backend,
                   device=cfg.device, timeout_s=150.0)
    run.figures["fsdp2_seconds"] = round(time.perf_counter() - t0, 1)
    text = "\n\n".join(demo.render(r, rows) for r, rows in enumerate(ranks))
    print(text, flush=True)
    run.tables.append(f"FSDP2 demo, {cfg.world_size} rank(s) on {cfg.device} ({cfg.backend}):"
                      f"\n\n```text\n{text}\n```")
    for rank, rows in enumerate(ranks):
        by = {r.mode: r for r in rows}
        who = f"rank {rank}"
        run.check(f"{who}: every mode trains identically to no fusion",
                  all(r.losses_match and r.params_match for r in rows))
        naive = by["naive rebase"]
        run.check(f"{who}: the naive rebase keeps the originals alive (the reported bug)",
                  naive.stale > 0, f"{naive.stale} stale, {naive.stale_bytes} B")
        run.check(f"{who}: meta init materializes into the pool, nothing stale",
                  not by["meta init"].checks, "; ".join(by["meta init"].checks))
        adopt = by["flatpool adopt"]
        if cfg.world_size == 1:
            run.skip(f"{who}: flatpool adopt fuses the shards",
                     "shard world size 1: fuse_fully_sharded leaves the group unfused by design "
                     "(nothing is all-gathered), so the demo's row reads: "
                     + "; ".join(adopt.checks))
        else:
            run.check(f"{who}: flatpool adopt fuses the shards, nothing stale",
                      not adopt.checks, "; ".join(adopt.checks))
    run.figures["pictures"] = sorted(p.name for p in (ctx.out / "demo").glob("*.png")) \
        if cfg.png else []
    run.artifacts += [f"demo/{n}" for n in run.figures["pictures"]]
    if cfg.world_size < 2:
        run.skip("the HyperParallel simulation (demo --client hyperparallel)",
                 "it shards over 2 ranks or more; one device gives one rank")
        return
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = demo_hyperparallel.main(cfg)
    print(buf.getvalue(), flush=True)
    run.check("the HyperParallel simulation's flatpool rows pass", rc == 0, f"exit code {rc}")


STEPS: dict[str, tuple[str, Callable[[Run, Ctx], None]]] = {
    "environment": ("Environment: python, torch, CUDA, device", step_environment),
    "tests": ("(a) the test suite's device-marked tests (pytest -m device)", step_tests),
    "adopt": ("(b) adopt + release: the originals' blocks go back to the caching allocator",
              step_adopt),
    "optim": ("(c) flat optimizer step vs per-parameter foreach=True / fused=True", step_optim),
    "fused": ("(f) where a flat fused step is torch.equal to fused=True per parameter",
              step_fused),
    "snapshot": ("(d) memory snapshot attributed with flatpool.memory, and its picture",
                 step_snapshot),
    "demo": ("(e) the demo's fusion on the device", step_demo),
}


def run_step(name: str, ctx: Ctx, result: Path) -> int:
    """Run step ``name`` in this process and write its :class:`Run` as JSON to ``result``."""
    run = Run(name)
    inject = dict(kv.split("=", 1) for kv in
                  filter(None, os.environ.get("FLATPOOL_DEVICE_CHECK_INJECT", "").split(",")))
    try:
        if inject.get(name) == "raise":  # the orchestrator's tests: a failing step
            raise RuntimeError(f"injected failure in step {name!r}")
        if inject.get(name) == "hang":  # ... and one that never ends
            time.sleep(3600)
        STEPS[name][1](run, ctx)
    except BaseException as exc:  # noqa: BLE001 - recorded; the next step still runs
        run.error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    result.write_text(json.dumps(run.to_json(), indent=1, default=str))
    return 0 if run.status == "passed" else 1
