"""Inputs that used to crash the process, run in one subprocess under ``-X faulthandler``.

Each case prints ``start <name>`` before it runs and ``ok <name>`` after it checked a clean,
typed outcome, so a segfault (exit code -11) names the case it died in. One subprocess for all
of them: starting Python and torch costs seconds; a case costs milliseconds, except the pinned
adoptions (about half a second each: the pin is explained by gc scans).

* Storage-less inputs (a wrapper subclass built like TwoTensor, a C++ functional tensor; alone
  and in a batch): the copy out of their placeholder storage segfaulted. (TwoTensor itself and
  FakeTensor are rows of the catalogue.)
* DLPack consumers (``numpy.from_dlpack``, ``to_dlpack`` capsules; under "raise" and "warn") and
  ``t.numpy()`` arrays (under "force" and with ``discover=True``): the release proof freed
  memory they still read. Every consumer is read after the adoption, once fresh allocations
  had a chance to reuse the freed memory.
* Re-adoption of a bound tensor whose storage was resized away (FSDP frees unsharded parameters
  with ``resize_(0)``): the copy read past the end of the storage.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import gc, sys, warnings
import numpy, torch
import flatpool
from flatpool import AdoptSpec, FlatPool

warnings.simplefilter("ignore")
N = 1 << 20  # 4 MiB of float32: freed memory goes back to the system and faults when read

def churn():
    """Allocate and touch memory a freed original could have been reused for."""
    junk = [torch.full((N,), 7.0) for _ in range(4)]
    del junk

def case(name):
    def run(fn):
        print("start", name, flush=True)
        fn()
        print("ok", name, flush=True)
    return run

def dlpack_pin():
    """torch 2.7 gives a DLPack consumer a view of its own on the storage (named as a C++
    holder); later releases give it the tensor's own impl (named as held outside Python)."""
    t = torch.zeros(4)
    s = t.untyped_storage()
    before = flatpool._torch_compat.storage_users(s)
    from torch.utils.dlpack import to_dlpack
    capsule = to_dlpack(t)
    view = flatpool._torch_compat.storage_users(s) > before
    del capsule
    return "held only from C++" if view else "held outside Python"

DLPACK_PIN = dlpack_pin()

def refused(error, call, pattern):
    try:
        call()
    except error as exc:
        assert pattern in str(exc), (pattern, str(exc))
        return
    raise AssertionError(f"expected {error.__name__}")

@case("functional")
def _():
    f = torch._to_functional_tensor(torch.randn(4))
    pool = FlatPool()
    refused(flatpool.InvalidTypeError, lambda: pool.adopt(f), "functional tensor")
    refused(flatpool.InvalidTypeError, lambda: pool.adopt([torch.ones(3), f]), "#1")
    assert pool.slices() == ()

def consumer(kind, t):
    if kind == "numpy.from_dlpack":
        return numpy.from_dlpack(t), None
    if kind == "to_dlpack":
        from torch.utils.dlpack import from_dlpack, to_dlpack
        capsule = to_dlpack(t)
        return None, capsule
    if kind == "t.numpy()":
        return t.numpy(), None
    raise ValueError(kind)

def read(array, capsule):
    if capsule is not None:
        from torch.utils.dlpack import from_dlpack
        return float(from_dlpack(capsule)[:1000].sum())
    return float(array[:1000].sum())

# DLPack consumers under "raise" (rolled back: the tensor and the consumer stay on the original)
# and "warn" (kept: the pool keeps the original for the consumer); t.numpy() under "force",
# whose array's base is a Python tensor force would otherwise move.
for kind, mode in [("numpy.from_dlpack", "raise"), ("numpy.from_dlpack", "warn"),
                   ("to_dlpack", "raise"), ("to_dlpack", "warn"), ("t.numpy()", "force")]:
    @case(f"{kind} {mode}")
    def _():
        t = torch.full((N,), 5.0)
        array, capsule = consumer(kind, t)
        pool = FlatPool()
        if mode == "raise":
            refused(flatpool.PinnedStorageError, lambda: pool.adopt(t), DLPACK_PIN)
            assert not pool.owns(t)
        else:
            report = pool.adopt(t, on_pinned=mode)
            assert pool.owns(t) and not report.items[0].released and report.freed_bytes == 0
            t.fill_(1.0)  # the pool's copy; the consumer keeps the original
        churn()
        assert read(array, capsule) == 5000.0, kind

@case("t.numpy() discover")
def _():
    t = torch.full((N,), 5.0)
    array = t.numpy()
    refused(flatpool.PinnedStorageError, lambda: FlatPool().adopt(t, discover=True), "t.numpy()")
    churn()
    assert float(array[:1000].sum()) == 5000.0

for size in (0, 100):
    @case(f"readopt resized to {size}")
    def _():
        pool = FlatPool()
        t = torch.arange(1024.0)
        pool.adopt(t)
        t.data = torch.arange(1024.0) + 1
        t.untyped_storage().resize_(size)
        refused(flatpool.InvalidRequestError, pool.readopt, f"holds only {size} bytes")
        assert t.untyped_storage().nbytes() == size and not pool.is_valid()

class Wrapper(torch.Tensor):
    """A traceable wrapper subclass built like torch's TwoTensor (whose module takes a second to
    import): the wrapper's own storage is a placeholder, its data lives in ``.a``."""

    @staticmethod
    def __new__(cls, a):
        return torch.Tensor._make_wrapper_subclass(cls, a.shape, dtype=a.dtype, device=a.device)

    def __init__(self, a):
        self.a = a

    def __tensor_flatten__(self):
        return ["a"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, size, stride):
        return Wrapper(inner["a"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x.a if isinstance(x, Wrapper) else x
        args = [unwrap(a) for a in args]
        kwargs = {k: unwrap(v) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)

@case("wrapper subclass")
def _():
    w = Wrapper(torch.ones(4))
    pool = FlatPool()
    refused(flatpool.InvalidTypeError, lambda: pool.adopt(w), "Wrapper")
    refused(flatpool.InvalidTypeError, lambda: pool.adopt([torch.ones(4), w]), "#1 Wrapper")
    assert pool.slices() == () and float(w.a.sum()) == 4.0

print("all ok")
'''


def test_crash_cases_fail_cleanly_in_a_subprocess() -> None:
    proc = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(SCRIPT)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    started = [line.split(" ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("start ")]
    assert proc.returncode == 0, (
        f"exit code {proc.returncode} in case {started[-1] if started else '?'!r}\n"
        f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    )
    assert proc.stdout.rstrip().endswith("all ok"), proc.stdout
    assert len(started) == 10, started
