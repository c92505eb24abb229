"""Builders for snapshot dicts in ``torch.cuda.memory._snapshot()``'s format, for the tests of
flatpool.memory (plain data: what a real allocator would return)."""

from __future__ import annotations

from typing import Any


def blk(address: int | None, size: int, state: str = "active_allocated",
        requested: int | None = None, frames: list[dict[str, Any]] | None = None
        ) -> dict[str, Any]:
    out: dict[str, Any] = {"size": size, "requested_size": size if requested is None else requested,
                           "state": state}
    if address is not None:
        out["address"] = address
    if frames is not None:
        out["frames"] = frames
    return out


def seg(address: int, total: int, blocks: list[dict[str, Any]],
        device: int | None = 0) -> dict[str, Any]:
    active = sum(b["size"] for b in blocks if b["state"].startswith("active"))
    out: dict[str, Any] = {
        "address": address, "total_size": total, "stream": 0,
        "segment_type": "large" if total > (1 << 20) else "small",
        "segment_pool_id": (0, 0), "allocated_size": active, "active_size": active,
        "requested_size": active, "is_expandable": False, "blocks": blocks,
    }
    if device is not None:
        out["device"] = device
    return out


def snapshot(*segments: dict[str, Any]) -> dict[str, Any]:
    return {"segments": list(segments), "device_traces": [[]], "allocator_settings": {}}
