"""No crash, ever: nothing the public API allows makes a later tensor read segfault.

flatpool never frees memory something still uses (``resize_(0)`` would make later reads
segfault, with no Python exception). Each scenario runs in a subprocess under
``-X faulthandler`` -- forced and warned adoptions with pinned views, views saved by autograd,
disowned-and-freed slices, relocation with kept views, a dropped pool, rolled-back
transactions -- and then reads every tensor involved. A segfault would show as return code
-11 (SIGSEGV) or -6 (SIGABRT) instead of 0.
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


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_reads_after_public_api_never_crash(name: str) -> None:
    script = PRELUDE + textwrap.dedent(SCENARIOS[name]) + "\nprint('read', len(seen))\n"
    proc = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", script],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, (
        f"{name}: exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    assert proc.stdout.startswith("read ")
