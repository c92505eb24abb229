"""No crash, ever: nothing the public API allows makes a later tensor read segfault.

flatpool never frees memory something still uses (``resize_(0)`` would make later reads
segfault, with no Python exception). The scenarios run one after the other in one subprocess
under ``-X faulthandler`` (one interpreter start instead of one per scenario) -- forced and
warned adoptions with pinned views, views saved by autograd, disowned-and-freed slices,
relocation with kept views, a dropped pool, rolled-back transactions -- each reading every
tensor involved. A segfault ends the subprocess with return code -11 (SIGSEGV) or -6
(SIGABRT); the scenario that was running is the one reported, the ones after it are not
reached.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = """
import gc, warnings
import torch
from torch import nn
from flatpool import AdoptSpec, FlatPool, Holder
from flatpool.testing import set_fault_hook
warnings.simplefilter("ignore")
seen = []

def read(*tensors):
    for t in tensors:
        with torch._C.DisableTorchFunctionSubclass():
            seen.append(float(t.detach().double().sum()))
            t.detach().clone()
            repr(t)
"""

SCENARIOS = {
    "warn-pinned-view": """
        t = torch.arange(64.0); v = t[8:16]
        pool = FlatPool(alignment=64)
        rep = pool.adopt(t, on_pinned="warn")
        assert not rep.all_released
        read(t, v)
        v.add_(1); t.add_(1)
        read(t, v)
    """,
    "force-pinned-views": """
        t = torch.arange(64.0); v = t[8:16]; w = t.view(8, 8); d = {"x": t[1:3]}
        pool = FlatPool(alignment=64)
        pool.adopt(t, on_pinned="force")
        read(t, v, w, d["x"])
        del t
        gc.collect()
        read(v, w, d["x"])
    """,
    "force-saved-for-backward": """
        p = nn.Parameter(torch.arange(16.0))
        loss = (p[2:] * p[2:]).sum()
        pool = FlatPool(alignment=64)
        pool.adopt(p, on_pinned="force")
        loss.backward()
        read(p, p.grad)
    """,
    "disown-free-reuse": """
        pool = FlatPool(alignment=64, capacity=4096)
        t = torch.arange(32.0)
        slc = pool.adopt(t).slices[0]
        pool.disown(slc)
        pool.free(slc)
        other = pool.allocate(32, torch.float32)
        other.tensor().fill_(7)
        read(t, other.tensor())   # t reads the bytes now owned by `other`: no crash
    """,
    "relocate-with-kept-views": """
        pool = FlatPool(alignment=64, capacity=4096)
        a = pool.allocate(16, torch.float32); a.tensor().fill_(1)
        gap = pool.allocate(16, torch.float32)
        t = torch.arange(16.0); pool.adopt(t)
        kept = a.tensor(); flat = pool.flat()
        pool.free(gap)
        pool.grow(8192, on_pinned="warn")
        read(kept, flat, t, a.tensor())
        mapping = pool.compact(on_pinned="warn")
        read(kept, flat, t, *[s.tensor() for s in mapping.values()])
    """,
    "dropped-pool": """
        pool = FlatPool(alignment=64)
        lin = nn.Linear(8, 8)
        pool.adopt([lin.weight, lin.bias])
        flat = pool.flat()
        del pool
        gc.collect()
        read(lin.weight, lin.bias, flat)
        lin(torch.ones(2, 8)).sum().backward()
    """,
    "readopt-warn": """
        pool = FlatPool(alignment=64)
        t = torch.arange(8.0); pool.adopt(t)
        t.data = torch.arange(8.0) + 1
        keep = t.data[2:4]
        pool.readopt(on_pinned="warn")
        read(t, keep)
    """,
    "rollback-after-commit": """
        pool = FlatPool(alignment=64)
        base = torch.arange(32.0); v = base[4:8]
        calls = []
        def hook(step):
            calls.append(step)
            if step == "release" and calls.count("release") == 2:
                raise RuntimeError("injected")
        set_fault_hook(hook)
        try:
            pool.adopt(AdoptSpec(base, views=(v,)))
        except RuntimeError:
            pass
        set_fault_hook(None)
        read(base, v)
        pool.adopt(AdoptSpec(base, views=(v,)))
        read(base, v, pool.flat())
    """,
}


def _script() -> str:
    body = [PRELUDE]
    for name, code in SCENARIOS.items():
        body.append(f"def scenario_{len(body)}():\n" + textwrap.indent(textwrap.dedent(code), "    "))
        body.append(f"print('start {name}', flush=True)\nscenario_{len(body) - 1}()\n"
                    f"gc.collect()\nprint('ok {name}', len(seen), flush=True)\n")
    return "\n".join(body)


@pytest.fixture(scope="module")
def outcome() -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", _script()],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_reads_after_public_api_never_crash(
    name: str, outcome: subprocess.CompletedProcess[str]
) -> None:
    lines = outcome.stdout.splitlines()
    if f"start {name}" not in lines:
        pytest.fail(f"{name}: not reached (an earlier scenario ended the process, exit code "
                    f"{outcome.returncode})\nstderr:\n{outcome.stderr[-3000:]}")
    assert any(line.startswith(f"ok {name} ") for line in lines), (
        f"{name}: exit code {outcome.returncode}\nstdout:\n{outcome.stdout}\n"
        f"stderr:\n{outcome.stderr[-4000:]}"
    )
