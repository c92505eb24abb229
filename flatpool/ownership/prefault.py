"""Map a batch's destination pages in bulk before the copy writes them (Linux, CPU pools).

A batch adoption into a fresh pool writes every page of its slices once. Left to the copy,
each first write takes a page fault, one 4 KiB page at a time: for 10,000 tensors of 26 KiB
(256 MiB) the faults are most of the copy's time, and copies below torch's parallel grain run
them in one thread. ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+) maps the same pages writable
in one call per range, without the trap per page and without writing a byte; the range is
split over ``torch.get_num_threads()`` threads (the call releases the GIL), as a large
``copy_`` splits its faults. Measured side by side on 2 cores (``benchmarks/bench_adopt.py``).

It changes no byte and no mapping's contents: at worst (an older kernel, another OS, a range
the allocator gave back meanwhile) the call fails and the copy takes its faults as before. So
nothing here can fail an adoption, and a thread still running when an interrupt unwinds the
operation cannot write into memory that was freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading

import torch

MADV_POPULATE_WRITE = 23
"""``<linux/mman.h>``: populate (prefault) page tables writable, without writing."""
MIN_BYTES = 4 << 20
"""Ranges below this are left to the copy's own faults (a thread start costs more)."""
_PAGE = 4096

_madvise = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _madvise = _libc.madvise
        _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _madvise.restype = ctypes.c_int
    except (OSError, AttributeError):  # no libc to load: the copy faults as before
        _madvise = None
_supported = [_madvise is not None]  # cleared by the first EINVAL (a kernel before 5.14)


def _populate(lo: int, hi: int) -> None:
    assert _madvise is not None
    if _madvise(lo, hi - lo, MADV_POPULATE_WRITE) != 0 and ctypes.get_errno() == 22:  # EINVAL
        _supported[0] = False


def prefault(base: int, start: int, end: int, device: torch.device, *,
             parallel: bool = True) -> bool:
    """Map bytes ``[start, end)`` of the CPU storage at address ``base`` writable, in
    ``torch.get_num_threads()`` pieces at once (one, unless ``parallel``); ``False`` when
    nothing was asked of the kernel (another device or OS, a small range, no support). Returns
    once every piece is done."""
    if device.type != "cpu" or not _supported[0] or end - start < MIN_BYTES or base == 0:
        return False
    lo = (base + start + _PAGE - 1) // _PAGE * _PAGE  # whole pages inside the range only
    hi = (base + end) // _PAGE * _PAGE
    if hi <= lo:
        return False
    workers = max(1, min(torch.get_num_threads(), 8)) if parallel else 1
    per = -(-(hi - lo) // workers)  # (ceiling divisions: whole pages a piece)
    step = -(-per // _PAGE) * _PAGE
    pieces = [(a, min(a + step, hi)) for a in range(lo, hi, step)]
    threads = [threading.Thread(target=_populate, args=p, daemon=True) for p in pieces[1:]]
    for t in threads:
        t.start()
    _populate(*pieces[0])
    for t in threads:
        t.join()
    return True


__all__ = ["MADV_POPULATE_WRITE", "MIN_BYTES", "prefault"]
