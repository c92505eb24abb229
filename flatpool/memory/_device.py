"""Take a snapshot of one device's caching allocator (CPU: the census record instead).

``torch_npu`` is imported only for an ``npu`` device; only the asked device's segments are kept.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import DeviceError, DeviceLike, resolve_device
from ._cpu import cpu_snapshot
from ._manifest import Manifest


def _allocator_snapshot(dev: torch.device) -> Any:
    if dev.type == "cuda":
        return torch.cuda.memory._snapshot(dev)
    backend = getattr(torch, "npu", None)  # registered by resolve_device()'s torch_npu import
    memory = getattr(backend, "memory", None)
    take = getattr(memory, "_snapshot", None)
    if take is None:
        raise DeviceError("torch_npu is loaded but torch.npu.memory._snapshot() is missing: "
                          "this torch_npu cannot take allocator snapshots")
    return take()


def device_snapshot(
    device: DeviceLike, manifest: Manifest | None = None, *, scan: bool = True
) -> dict[str, Any]:
    """A snapshot dict of ``device`` now (on CPU, :func:`cpu_snapshot` of ``manifest``)."""
    dev = resolve_device(device)
    if dev.type == "cpu":
        return cpu_snapshot(manifest, scan=scan)
    snap = _allocator_snapshot(dev)
    if not isinstance(snap, dict) or not isinstance(snap.get("segments"), list):
        raise DeviceError(f"the {dev.type} allocator returned a snapshot without a segment "
                          f"list ({type(snap).__name__})")
    out = dict(snap)
    out["segments"] = [s for s in snap["segments"]
                       if not isinstance(s, dict) or s.get("device", dev.index) == dev.index]
    return out


__all__ = ["device_snapshot"]
