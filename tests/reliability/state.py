"""Full-state snapshots for the reliability tests: pools, slices, registries and tensors.

A snapshot never keeps a storage alive (that would change what a release proof sees): storage
identity is recorded as the StorageImpl address plus a weak reference, so "same storage after"
means "same address and the first one never died".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from flatpool import FlatPool, Slice
from flatpool import local_tensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def storage_ident(t: torch.Tensor) -> tuple[int, Any, int] | None:
    """(StorageImpl address, weak reference, bytes) of ``t``'s own storage; ``None`` for tensors
    without one (meta, sparse, nested, wrapper subclasses)."""
    with torch._C.DisableTorchFunctionSubclass():
        if t.is_meta or t.layout != torch.strided or t.is_nested or is_traceable_wrapper_subclass(t):
            return None
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
    return int(s._cdata), StorageWeakRef(s), s.nbytes()


def _readable(s: torch.UntypedStorage, t: torch.Tensor) -> bool:
    """``s`` holds real bytes covering all of ``t``'s elements."""
    if s.device.type == "meta":
        return False
    try:
        if s.data_ptr() == 0 and s.nbytes():
            return False
    except (RuntimeError, NotImplementedError):
        return False
    end = t.storage_offset() + 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    return t.numel() == 0 or s.nbytes() >= end * t.element_size()


def _values(t: torch.Tensor, ident: tuple[int, Any, int] | None) -> torch.Tensor | None:
    """A copy of ``t``'s values, or ``None`` where reading would crash or has nothing to read
    (a storage resized below the tensor's extent, a functional or fake placeholder)."""
    with torch._C.DisableTorchFunctionSubclass():
        if t.is_meta:
            return None
        if ident is not None and not _readable(t.untyped_storage(), t):
            return None
        try:
            return t.detach().clone()
        except (RuntimeError, NotImplementedError):
            return None


class TensorState:
    """One tensor object: identity, storage identity and size, geometry, values, autograd
    flags; robust to tensors that have no strided storage or whose storage was resized away."""

    def __init__(self, name: str, t: torch.Tensor) -> None:
        self.name, self.obj_id, self.type = name, id(t), type(t)
        self.meta = bool(t.is_meta)
        self.ident = storage_ident(t)
        with torch._C.DisableTorchFunctionSubclass():
            try:
                self.geometry: Any = (int(t.storage_offset()), tuple(t.shape), tuple(t.stride()),
                                      t.dtype)
            except (RuntimeError, NotImplementedError):  # sparse, nested: no strides
                self.geometry = (t.layout, t.dtype)
            self.requires_grad = t.requires_grad
        self.values = _values(t, self.ident)

    def diff(self, t: torch.Tensor) -> list[str]:
        now = TensorState(self.name, t)
        out: list[str] = []
        if now.obj_id != self.obj_id:
            out.append(f"{self.name}: a different object")
        if now.type is not self.type:
            out.append(f"{self.name}: type {self.type} -> {now.type}")
        if now.meta != self.meta or (self.ident is None) != (now.ident is None):
            out.append(f"{self.name}: meta-ness or storage kind changed")
        elif self.ident is not None and now.ident is not None:
            if self.ident[0] != now.ident[0] or self.ident[1].expired():
                out.append(f"{self.name}: moved to another storage")
            elif self.ident[2] != now.ident[2]:
                out.append(f"{self.name}: storage resized {self.ident[2]} -> {now.ident[2]} bytes")
        if now.geometry != self.geometry:
            out.append(f"{self.name}: geometry {self.geometry} -> {now.geometry}")
        if now.requires_grad != self.requires_grad:
            out.append(f"{self.name}: requires_grad changed")
        if (self.values is None) != (now.values is None):
            out.append(f"{self.name}: readability changed")
        elif self.values is not None and now.values is not None:
            if not _equal(self.values, now.values):
                out.append(f"{self.name}: values changed")
        return out


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.layout != torch.strided or a.is_nested:
        a, b = _dense(a), _dense(b)
    return bool(torch.equal(a, b))


def _dense(t: torch.Tensor) -> torch.Tensor:
    if t.is_nested:
        return torch.cat([c.reshape(-1) for c in t.unbind()])
    return t.to_dense()


def _registry_state(pool: FlatPool) -> list[tuple[int, tuple[Any, ...]]]:
    out = []
    for sid, records in sorted(pool.registry.items(), key=lambda kv: kv[0]):
        out.append((sid, tuple((id(b.current()), b.geometry, b.primary)
                               for b in pool.registry.bindings(sid))))
    return out


class PoolState:
    def __init__(self, pool: FlatPool) -> None:
        self.pool = pool
        with pool.lock:
            self.describe = pool.describe()
            self.slices = tuple(pool.slices())
            self.alloc = pool._state._alloc.snapshot()
            self.materialized = pool.is_materialized
            self.buffer = None if pool._state._buffer is None else storage_ident(pool._state._buffer)
            self.registry = _registry_state(pool)
            self.values = (
                {s.slice_id: s.bytes().clone() for s in self.slices} if self.materialized else {}
            )

    def diff(self) -> list[str]:
        now = PoolState(self.pool)
        name = self.pool.name
        out: list[str] = []
        if now.describe != self.describe:
            out.append(f"pool {name}: layout changed:\n{self.describe}\n->\n{now.describe}")
        if now.slices != self.slices or any(not s.is_live for s in self.slices):
            out.append(f"pool {name}: slice handles changed")
        if now.alloc != self.alloc:
            out.append(f"pool {name}: allocator state changed")
        if now.materialized != self.materialized:
            out.append(f"pool {name}: materialization changed")
        if self.buffer is not None and now.buffer is not None:
            if self.buffer[0] != now.buffer[0] or self.buffer[1].expired():
                out.append(f"pool {name}: storage replaced")
        if now.registry != self.registry:
            out.append(f"pool {name}: registry changed {self.registry} -> {now.registry}")
        for sid, v in self.values.items():
            if sid in now.values and not torch.equal(v, now.values[sid]):
                out.append(f"pool {name}: bytes of slice {sid} changed")
        return out



class Snapshot:
    """Everything a failed call must leave untouched."""

    def __init__(
        self,
        pools: Iterable[FlatPool],
        tensors: dict[str, torch.Tensor],
        places: dict[str, tuple[Any, Any, bool]] | None = None,
    ) -> None:
        self.pools = [PoolState(p) for p in pools]
        self.tensors = {
            n: (t, TensorState(n, t)) for n, t in tensors.items()
        }
        self.locals = {
            n: TensorState(n + "._local_tensor", local_tensor(t))
            for n, t in tensors.items()
            if local_tensor(t) is not t
        }
        self.places = dict(places or {})
        self.place_ids = {n: id(_get(*pl)) for n, pl in self.places.items()}

    def diff(self) -> list[str]:
        out: list[str] = []
        for p in self.pools:
            out += p.diff()
        for n, (t, st) in self.tensors.items():
            out += st.diff(t)
            if n in self.locals:
                out += self.locals[n].diff(local_tensor(t))
        for n, pl in self.places.items():
            if id(_get(*pl)) != self.place_ids[n]:
                out.append(f"place {n}: holds another object now")
        return out

    def assert_unchanged(self) -> None:
        problems = self.diff()
        assert not problems, "state changed:\n" + "\n".join(problems)

    def drop_tensors(self) -> None:
        self.tensors.clear()


def _get(owner: Any, key: Any, item: bool) -> Any:
    return owner[key] if item else getattr(owner, key)


def check_layout(pool: FlatPool) -> None:
    """Slices disjoint, aligned, inside the capacity; accounting adds up with the free list."""
    with pool.lock:
        slices: Sequence[Slice] = pool.slices()
        cap = pool.capacity
        pos = 0
        for s in slices:
            assert s.is_live
            assert s.offset % pool.slice_alignment(s.dtype) == 0, (s, pool.alignment)
            assert s.offset >= pos, f"overlap at {s}"
            assert s.end <= cap, f"{s} past capacity {cap}"
            pos = s.end
        used = sum(s.nbytes for s in slices)
        assert pool.used_bytes == used
        assert pool.used_bytes + pool.free_bytes == cap
        free = pool._state._alloc.free_ranges()
        assert sum(e - s for s, e in free) == cap - used, (free, cap, used)
        for fs, fe in free:
            assert 0 <= fs < fe <= cap
            for s in slices:
                assert fe <= s.offset or s.end <= fs, f"free range {(fs, fe)} overlaps {s}"
        if pool.is_materialized:
            assert pool.storage.nbytes() == cap
        # The indexes every later allocate()/free() relies on agree with the layout.
        alloc = pool._state._alloc
        assert list(alloc._starts) == sorted(alloc._starts) and len(alloc._starts) == len(alloc._ends)
        # The best-fit indexes hold every free range with a usable byte at the pool's
        # alignment, and no other: a padding gap (none) fits no request, it only coalesces.
        usable = [(s, e) for s, e in free if alloc._usable(s, e) > 0]
        assert sorted(alloc._by_size) == alloc._by_size == sorted((e - s, s) for s, e in usable)
        assert alloc._by_usable == sorted((alloc._usable(s, e), s) for s, e in usable)
        index = pool._state._index  # singles and runs (flatpool/_slice_index.py) agree with the layout
        assert index.consistent() and len(index) == len(slices)
        assert index.ordered() == list(slices) and set(index.handles()) == set(slices)
        for s in slices:  # the by-offset lookup finds each slice from its first and last byte
            assert index.floor(s.offset) == s == index.floor(s.end - 1) == index.get(s.slice_id)
