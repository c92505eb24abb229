"""Bulk page mapping before a batch's copy (flatpool/ownership/prefault.py, issue 20).

It must map the pages (the resident set grows by the range before anything is written), change
no byte, and ask nothing of the kernel where it cannot pay or does not apply.
"""

from __future__ import annotations

import sys

import pytest
import torch

from flatpool import FlatPool
from flatpool.ownership import prefault as pf

MiB = 1 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux madvise")


@linux_only
def test_the_range_is_mapped_before_any_write() -> None:
    buf = torch.empty(64 * MiB, dtype=torch.uint8)  # fresh pages: not resident yet
    before = _rss()
    done = pf.prefault(buf.data_ptr(), 0, buf.numel(), buf.device)
    if not done:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert _rss() - before >= 60 * MiB  # (other threads of the process may free a little)


@linux_only
def test_no_byte_changes() -> None:
    buf = torch.randint(0, 256, (16 * MiB,), dtype=torch.uint8)
    before = buf.clone()
    pf.prefault(buf.data_ptr(), 1000, buf.numel() - 1000, buf.device)  # unaligned ends too
    assert torch.equal(buf, before)
    # (Pages never touched before the call are the other test's: their resident set grows.)


def test_nothing_is_asked_where_it_cannot_pay() -> None:
    buf = torch.empty(pf.MIN_BYTES - 1, dtype=torch.uint8)
    assert not pf.prefault(buf.data_ptr(), 0, buf.numel(), buf.device)  # too small
    assert not pf.prefault(buf.data_ptr(), 0, 64 * MiB, torch.device("meta"))  # not CPU
    assert not pf.prefault(0, 0, 64 * MiB, torch.device("cpu"))  # no storage yet


def test_a_small_tensor_batch_is_prefaulted_and_adopted_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lean path asks for the batch's own byte range (a run: the first slice's start to the
    last one's end), once, and the adoption's result is the same."""
    asked: list[tuple[int, int]] = []
    real = pf.prefault

    def spy(base: int, start: int, end: int, device: torch.device, *, parallel: bool) -> bool:
        asked.append((start, end))
        assert not parallel  # (8 KiB copies run serially inside torch)
        return real(base, start, end, device, parallel=parallel)

    import flatpool.ownership.fastpath as fastpath

    monkeypatch.setattr(fastpath, "prefault", spy)
    ts = [torch.full((2048,), float(i)) for i in range(1000)]  # 8 KiB each, 8 MiB in all
    pool = FlatPool()
    report = pool.adopt(ts)
    assert report.all_released
    slices = report.slices
    assert asked == [(slices[0].offset, slices[-1].end)]
    assert all(float(t[0]) == float(i) == float(t[-1]) for i, t in enumerate(ts))
    big = [torch.ones(1 << 19) for _ in range(8)]  # 2 MiB each: torch faults them in parallel
    FlatPool().adopt(big)
    assert len(asked) == 1
