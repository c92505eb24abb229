"""flatpool.memory on a real caching allocator (CUDA, or Ascend NPU through torch_npu).

Skipped without an accelerator. Written device-generically: the same tests run unchanged on
NPU (``torch_npu`` is imported only to look for an NPU, and only when it is installed).
"""

from __future__ import annotations

import importlib
import importlib.util
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from flatpool import DeviceError, FlatPool, resolve_device
from flatpool.memory import WatchedStorages, attribute, build_manifest, capture, device_snapshot
from flatpool.memory.__main__ import main


def accelerator() -> str | None:
    if torch.cuda.is_available():
        return "cuda"
    if importlib.util.find_spec("torch_npu") is not None:
        try:
            resolve_device("npu")
            return "npu"
        except DeviceError:
            return None
    return None


DEVICE = accelerator()
pytestmark = [pytest.mark.device, pytest.mark.skipif(DEVICE is None, reason="no CUDA or NPU device")]


def backend() -> Any:
    return getattr(torch, str(DEVICE))


def settle() -> None:
    backend().synchronize()


def block_of(a: Any, t: torch.Tensor) -> Any:
    start = int(t.untyped_storage().data_ptr())
    return next(b for b in a.blocks if b.address <= start < b.address + b.size)


def test_real_snapshot_classifies_pool_tensor_stale_and_unknown_blocks() -> None:
    dev = resolve_device(str(DEVICE))
    pool = FlatPool(dev, capacity=3 << 20, name="bucket")
    w = pool.allocate((1024, 512), torch.float32)
    pool.materialize()
    w.tensor().normal_()
    copy = w.tensor().clone()           # a stale copy of bucket:0
    named = torch.ones(4096, device=dev)
    unknown = torch.zeros(300_000, device=dev)  # reachable from no root
    settle()
    a = attribute(device_snapshot(dev), {"copy": copy, "named": named}, pools=[pool])
    pool_block = block_of(a, pool.flat())
    assert pool_block.kind == "pool" and pool_block.address == pool.storage.data_ptr()
    assert pool_block.size >= pool.capacity
    assert block_of(a, copy).kind == "stale"
    assert {i.label: i.reason for i in a.stale} == {"copy": "copy of bucket:0"}
    assert block_of(a, named).kind == "tensor"
    lost = block_of(a, unknown)
    assert lost.kind == "unattributed" and lost.address == unknown.data_ptr()
    assert sum(t.nbytes for t in a.totals) == a.active_bytes
    assert a.active_bytes == backend().memory_allocated(dev)  # nothing pending on one stream
    assert a.reserved_bytes == backend().memory_reserved(dev)


def test_watched_original_is_stale_until_it_dies(tmp_path: Path) -> None:
    dev = resolve_device(str(DEVICE))
    original = torch.randn(1 << 20, device=dev)  # 4 MiB
    watch = WatchedStorages({"layer.w": original})
    settle()
    a = capture(roots={"w": original}, watch=watch, device=dev)
    (stale,) = a.stale
    assert (stale.label, stale.nbytes, stale.referrers) == ("layer.w", 4 << 20, ("w",))
    assert block_of(a, original).kind == "stale"
    address = original.data_ptr()
    del original
    settle()
    b = capture(watch=watch, device=dev)
    assert b.stale == ()
    assert all(not blk.active for blk in b.blocks if blk.address == address)


def test_cli_on_a_dumped_snapshot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dev = resolve_device(str(DEVICE))
    pool = FlatPool(dev, capacity=1 << 20, name="bucket")
    pool.materialize()
    keep = torch.randn(1 << 18, device=dev)
    manifest = build_manifest(pools=[pool], watch=WatchedStorages({"old": keep}))
    manifest.write(tmp_path / "m.json")
    settle()
    dump = getattr(backend().memory, "_dump_snapshot", None)
    snap = tmp_path / "snap.pickle"
    if dump is not None:
        dump(str(snap))
    else:
        snap.write_bytes(pickle.dumps(device_snapshot(dev)))
    assert main([str(snap), "--manifest", str(tmp_path / "m.json")]) == 0
    out = capsys.readouterr().out
    assert "= active bytes" in out and "STALE" in out and "bucket" in out
    importlib.import_module("flatpool.memory")  # still importable with the backend loaded
