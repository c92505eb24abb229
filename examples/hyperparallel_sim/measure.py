"""What a simulated fully_shard unit is backed by: live storages, surviving originals, wrappers.

The measurements the tests and the demo assert and print, taken the way a memory snapshot sees
a rank: every distinct storage reachable from the members (padded data, local tensor, their
autograd bases, the Parameter wrapper's own TensorImpl) and from the group's flat buffers;
weak references to the storages the members had before fusion; and what the wrapper's own
memory reads next to the local tensor it fronts. Storage identities come from the TensorImpls
(:mod:`flatpool._torch_compat`), never from ``data_ptr()`` (the DTensor overrides it).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import torch
from attrs import define, field
from torch.multiprocessing.reductions import StorageWeakRef

from flatpool import own_storage
from flatpool import _torch_compat as tc

from .dtensor import wrapper_local_geometry, wrapper_own_values, wrapper_storage_key
from .param import HSDPParam

if TYPE_CHECKING:
    from .unit import FullyShardUnit

MiB = 1 << 20


def _chain(t: torch.Tensor | None) -> list[torch.Tensor]:
    """``t`` and its autograd bases (the wrapper's own ``_base``, not the local's)."""
    out = []
    while isinstance(t, torch.Tensor):
        out.append(t)
        with tc.no_torch_function():
            t = tc.impl_base(t)
    return out


def member_holders(p: HSDPParam) -> list[tuple[str, torch.Tensor]]:
    """Every tensor through which a member reaches a storage, named by role."""
    rows = [(f"{p.param_name}.data", t) for t in _chain(p._sharded_param_data)]
    rows += [(f"{p.param_name}.local", t) for t in _chain(p._sharded_local_tensor)]
    rows.append((f"{p.param_name}.wrapper", p.sharded_param))
    return rows


@define(frozen=True)
class StorageRow:
    key: int
    nbytes: int
    holders: tuple[str, ...]


def live_storages(unit: FullyShardUnit) -> list[StorageRow]:
    """Distinct live storages reachable from the unit's members and its group's buffers."""
    found: dict[int, tuple[int, list[str]]] = {}
    named: list[tuple[str, torch.Tensor]] = []
    for p in unit.hsdp_params:
        named += member_holders(p)
    named += [(f"group.flat{i}", t) for i, t in enumerate(unit.flat_buffers())]
    for name, t in named:
        s = own_storage(t)
        if s is not None:
            found.setdefault(tc.storage_key(s), (s.nbytes(), []))[1].append(name)
    return [StorageRow(k, n, tuple(sorted(set(h)))) for k, (n, h) in found.items()]


@define
class Originals:
    """Weak references to the members' storages taken before fusion."""

    refs: list[tuple[str, int, int, Any]] = field(factory=list)

    @classmethod
    def of(cls, unit: FullyShardUnit) -> Originals:
        out, seen = cls(), set()
        for p in unit.hsdp_params:
            for _, t in member_holders(p):
                s = own_storage(t)
                if s is None or tc.storage_key(s) in seen:
                    continue
                seen.add(tc.storage_key(s))
                ref = StorageWeakRef(s)  # type: ignore[no-untyped-call]
                out.refs.append((p.param_name, s.nbytes(), tc.storage_key(s), ref))
        return out

    def alive(self) -> list[tuple[str, int]]:
        return [(n, b) for n, b, _, r in self.refs if not r.expired()]

    def alive_held_by_wrappers(self, unit: FullyShardUnit) -> int:
        """How many live originals are exactly the storage a Parameter wrapper sits on."""
        wrappers = {wrapper_storage_key(p.sharded_param) for p in unit.hsdp_params}
        alive = {k for _, _, k, r in self.refs if not r.expired()}
        return len(alive & {k for k in wrappers if k is not None})


def wrapper_is_stale(p: HSDPParam) -> bool | None:
    """Does the Parameter wrapper's own memory differ from the local tensor it fronts?"""
    if wrapper_storage_key(p.sharded_param) is None:
        return None
    own = wrapper_own_values(p.sharded_param)
    local = p._sharded_local_tensor.detach()
    return not torch.equal(own, local)


def wrapper_view(p: HSDPParam) -> dict[str, Any]:
    """What the wrapper says about itself, through each door."""
    w = p.sharded_param
    key = wrapper_storage_key(w)
    geom = None if key is None else wrapper_local_geometry(w)
    return {"shape": tuple(w.shape), "size": tuple(w.size()), "impl_geometry": geom,
            "meta": key is None, "storage": key}


def census(unit: FullyShardUnit, originals: Originals | None = None) -> dict[str, Any]:
    rows = live_storages(unit)
    out: dict[str, Any] = {
        "live": len(rows),
        "live_mib": sum(r.nbytes for r in rows) / MiB,
        "rows": [(r.nbytes / MiB, r.holders) for r in sorted(rows, key=lambda r: -r.nbytes)],
        "valid": unit.is_valid(),
        "stale_wrappers": [wrapper_is_stale(p) for p in unit.hsdp_params],
        "wrappers": [wrapper_view(p) for p in unit.hsdp_params],
    }
    if originals is not None:
        out["originals_alive"] = len(originals.alive())
        out["originals_held_by_wrappers"] = originals.alive_held_by_wrappers(unit)
    return out


def digest(t: torch.Tensor) -> str:
    """Bit-exact fingerprint of a tensor (results cross process boundaries as plain data)."""
    data = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).hexdigest()


__all__ = [
    "MiB", "Originals", "StorageRow", "census", "digest", "live_storages", "member_holders",
    "wrapper_is_stale", "wrapper_view",
]
