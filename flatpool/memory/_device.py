"""Snapshots of one device's memory: the caching allocator's, or on CPU a record of live storages.

``malloc`` keeps no snapshot, so on CPU one block per live storage lets the attribution code run
(and be tested) with real addresses; storages only C++ references are not seen. ``torch_npu`` is
imported only for an ``npu`` device; only the asked device's segments are kept.
"""

from __future__ import annotations

import gc
import warnings
from typing import Any

import torch

from .. import DeviceError, DeviceLike, local_tensor, own_storage, resolve_device
from ._manifest import Manifest

SOURCE = "cpu census"


def _manifest_ranges(manifest: Manifest) -> list[tuple[int, int]]:
    out = [(p.address, p.end) for p in manifest.pools if p.device == "cpu"]
    out += [(s.address, s.end) for s in (*manifest.flats, *manifest.tensors) if s.device == "cpu"]
    out += [(o.address, o.end) for o in manifest.originals if o.device in (None, "cpu")]
    return out


def _scanned_ranges() -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    enabled = gc.isenabled()
    gc.disable()  # a collection during the scan would only slow it down
    try:
        with warnings.catch_warnings():  # isinstance() on deprecated torch aliases warns
            warnings.simplefilter("ignore")
            tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
        for t in tensors:
            try:
                storage = own_storage(local_tensor(t))
            except Exception:  # an exotic subclass refusing to show its storage: skip it
                continue
            if storage is not None and storage.device.type == "cpu":
                out.append((int(storage.data_ptr()), int(storage.data_ptr()) + storage.nbytes()))
        del tensors
    finally:
        if enabled:
            gc.enable()
    return out


def cpu_snapshot(manifest: Manifest | None = None, *, scan: bool = True) -> dict[str, Any]:
    """One block per live CPU storage (the manifest's; with ``scan``, every tensor gc tracks),
    overlaps merged, in ``torch.cuda.memory._snapshot()``'s format (picklable)."""
    ranges = _manifest_ranges(manifest) if manifest is not None else []
    if scan:
        ranges += _scanned_ranges()
    merged: list[list[int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if merged and start < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    segments = []
    for start, end in merged:
        size = end - start
        segments.append({
            "address": start, "total_size": size, "stream": 0,
            "segment_type": "large" if size > (1 << 20) else "small",
            "allocated_size": size, "active_size": size, "requested_size": size,
            "blocks": [{"address": start, "size": size, "requested_size": size,
                        "state": "active_allocated", "frames": []}],
        })
    return {"segments": segments, "device_traces": [], "flatpool_source": SOURCE}


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
