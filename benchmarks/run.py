"""Run every benchmark and print one table: figure, baseline from the same run, ratio, target.

    python -m benchmarks.run            # full sizes (minutes)
    python -m benchmarks.run --quick    # tiny sizes, for CI: targets are not judged
    python -m benchmarks.run --only adopt

A MISS is a result, not a failure: the exit status is 0 unless a benchmark crashed.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
import time
import traceback
import warnings

from ._common import Result, render

BENCHMARKS = ("adopt", "memory", "validity", "census", "step")


def machine() -> str:
    import os

    import torch

    model = "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return (f"{os.cpu_count()} CPUs ({model}), {mem:.1f} GiB RAM, Python "
            f"{platform.python_version()}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} intra-op threads")


def summary(results: list[Result], quick: bool) -> str:
    """The last line: the verdicts of a full run; a quick run says that it judged nothing."""
    targets = [r for r in results if r.target not in ("", "-")]
    if quick:
        return (f"quick run: targets not judged ({len(targets)} of {len(results)} results have "
                "one; run without --quick, at full sizes, to judge them)")
    judged = [r for r in results if r.ok is not None]
    return (f"{sum(1 for r in judged if r.ok)} PASS, {sum(1 for r in judged if not r.ok)} MISS "
            f"of {len(judged)} judged targets; {len(results) - len(judged)} result(s) reported "
            "only")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny sizes; targets not judged")
    ap.add_argument("--only", choices=BENCHMARKS, action="append", help="run only this one")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    print(f"machine: {machine()}")
    print(f"mode: {'quick (targets not judged)' if a.quick else 'full'}\n", flush=True)
    results: list[Result] = []
    crashed: list[str] = []
    for name in a.only or BENCHMARKS:
        t0 = time.perf_counter()
        try:
            mod = importlib.import_module(f"benchmarks.bench_{name}")
            got = mod.run(a.quick)
        except Exception:
            crashed.append(name)
            print(f"[{name}] CRASHED:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            continue
        results.extend(got)
        print(f"[{name}] done in {time.perf_counter() - t0:.1f} s", flush=True)
        for r in got:
            print(f"  {r.verdict:10}  {r.name}: {r.figure} vs {r.baseline} ({r.measured})"
                  + ("" if r.ratio is None else f", ratio {r.ratio:.3f} ({r.ratio_kind})")
                  + f", target {r.target}" + (f"  [{r.note}]" if r.note else ""), flush=True)
    print()
    print(render(results, markdown=a.markdown))
    print()
    print(summary(results, a.quick) + (f"; CRASHED: {', '.join(crashed)}" if crashed else ""))
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
