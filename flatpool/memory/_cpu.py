"""A snapshot-shaped record of live CPU storages, for attribution where no allocator exists.

``malloc`` keeps no snapshot; one segment per live storage lets the attribution code run (and
be tested) on CPU with real addresses. Storages only C++ references are not seen.
"""

from __future__ import annotations

import gc
import warnings
from typing import Any

import torch

from .. import local_tensor, own_storage
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


__all__ = ["SOURCE", "cpu_snapshot"]
