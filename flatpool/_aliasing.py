"""Storage identity and byte-range checks between tensors, pool or no pool.

Decided by storage identity and byte ranges, never ``data_ptr()``: two storages can share an
address (empty tensors, reuse), and wrappers such as HyperParallel's DTensor override it.
Geometry comes from the TensorImpl (a subclass's ``shape`` may be global).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Union

import torch
from attrs import define

from . import _torch_compat as tc
from .errors import AliasingError, InvalidTypeError

NamedTensors = Union[Mapping[str, torch.Tensor], Iterable[torch.Tensor]]
storage_key: Callable[[torch.UntypedStorage], int] = tc.storage_key


@define(frozen=True)
class ByteRange:
    """Where a tensor's elements lie in its storage, in bytes: ``[start, end)``."""

    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def contains(self, other: ByteRange) -> bool:
        return self.start <= other.start and other.end <= self.end

    def intersects(self, other: ByteRange) -> bool:
        """True when the ranges share a byte; an empty range shares none."""
        if not self.nbytes or not other.nbytes:
            return False
        return self.start < other.end and other.start < self.end


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns the data: a DTensor's ``_local_tensor``, else ``t`` itself."""
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    inner = getattr(t, "_local_tensor", None)
    if isinstance(inner, torch.Tensor) and inner is not t:
        return local_tensor(inner)
    return t


def check_strided(t: torch.Tensor, what: object = "tensor") -> None:
    """Refuse layouts that have no single strided storage (sparse, nested, mkldnn) by name."""
    with tc.no_torch_function():
        layout = tc.impl_layout(t)
        nested = tc.impl_is_nested(t)
    if nested:
        raise InvalidTypeError(
            f"{what} is a nested tensor: its components live in several buffers with no single "
            "strided storage; pass its components (t.unbind()) instead")
    if layout != torch.strided:
        raise InvalidTypeError(
            f"{what} has layout {layout}; only strided (dense) tensors have one storage with "
            "byte ranges: convert it first (to_dense())")


def _inner_names(t: torch.Tensor) -> str:
    """The attributes a traceable wrapper subclass keeps its data in (``a, b`` for TwoTensor)."""
    try:
        names = t.__tensor_flatten__()[0]  # type: ignore[attr-defined]
        return ", ".join(f".{n}" for n in names) or "its inner tensors"
    except Exception:  # a subclass whose flatten fails still gets a message
        return "its inner tensors"


def check_no_wrapper(t: torch.Tensor, what: object) -> None:
    """Refuse a wrapper subclass without ``_local_tensor``: its storage crashes when read."""
    if tc.is_wrapper_subclass(t):
        raise InvalidTypeError(
            f"{what} is a {type(t).__name__}, a wrapper tensor subclass with no data of its own "
            f"(it keeps its data in {_inner_names(t)}): pass those inner tensors instead")


def own_storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """``t``'s *own* storage, not unwrapped; ``None`` for meta tensors and placeholder storages
    (torch's DTensor, fake tensors). The storage, not the class, tells a storage-sharing
    ``_make_subclass`` wrapper (HyperParallel's DTensor) from a storage-less one."""
    try:
        with tc.no_torch_function():
            if tc.impl_is_meta(t) or tc.impl_layout(t) != torch.strided or tc.impl_is_nested(t):
                return None
            storage = tc.impl_untyped_storage(t)
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    if not tc.storage_has_data(storage):
        return None
    return storage if storage.nbytes() > 0 else None


def storage_of(t: torch.Tensor) -> torch.UntypedStorage:
    """The untyped storage behind ``t`` (through DTensor and storage-sharing subclasses)."""
    inner = local_tensor(t)
    check_strided(inner)
    check_no_wrapper(inner, "tensor")
    with tc.no_torch_function():
        result = tc.impl_untyped_storage(inner)
        return result  # not `return f()`: see flatpool._interrupts


def extent_of(t: torch.Tensor) -> ByteRange:
    """The strided byte extent of ``t`` itself (call under ``no_torch_function``)."""
    item = tc.impl_element_size(t)
    start = tc.impl_storage_offset(t) * item
    numel = tc.impl_numel(t)
    if numel == 0:
        return ByteRange(start, start)
    if tc.impl_is_contiguous(t):  # (its span is its element count: no loop over the dims)
        return ByteRange(start, start + numel * item)
    span = 1
    for size, stride in zip(tc.impl_size(t), tc.impl_stride(t)):
        span += (size - 1) * abs(stride)
    return ByteRange(start, start + span * item)


def byte_range(t: torch.Tensor) -> ByteRange:
    """The bytes of ``t``'s storage its elements can touch (the strided extent)."""
    inner = local_tensor(t)
    check_strided(inner)
    check_no_wrapper(inner, "tensor")
    with tc.no_torch_function():
        result = extent_of(inner)
        return result  # not `return f()`: see flatpool._interrupts


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` are backed by one storage (whatever their ranges)."""
    return storage_key(storage_of(a)) == storage_key(storage_of(b))


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` share a storage and their byte extents intersect
    (conservative for interleaved strided views; empty tensors overlap nothing)."""
    if not same_storage(a, b):
        return False
    return byte_range(a).intersects(byte_range(b))


def check_no_aliasing(tensors: NamedTensors) -> None:
    """Raise one :class:`AliasingError` listing *every* pair of tensors whose memory overlaps
    (an iterable's names are ``[i]``; one tensor given twice aliases itself)."""
    items: list[tuple[str, torch.Tensor]]
    if isinstance(tensors, torch.Tensor):  # iterable too: it would be checked row by row
        raise InvalidTypeError("check_no_aliasing() needs a mapping or iterable of tensors, "
                               "got a single tensor")
    if isinstance(tensors, Mapping):
        items = [(str(k), v) for k, v in tensors.items()]
    else:
        items = [(f"[{i}]", v) for i, v in enumerate(tensors)]
    by_storage: dict[int, list[tuple[ByteRange, str]]] = {}
    keep_alive: list[torch.UntypedStorage] = []
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError(f"{name} is a {type(t).__name__}, not a torch.Tensor")
        check_strided(local_tensor(t), name)
        check_no_wrapper(local_tensor(t), name)
        storage = storage_of(t)
        keep_alive.append(storage)
        rng = byte_range(t)
        if rng.nbytes:
            by_storage.setdefault(storage_key(storage), []).append((rng, name))
    offenders: list[tuple[str, str]] = []
    for ranges in by_storage.values():
        ranges.sort(key=lambda r: (r[0].start, r[0].end))
        active: list[tuple[ByteRange, str]] = []
        for rng, name in ranges:
            active = [a for a in active if a[0].end > rng.start]
            offenders.extend((other, name) for _, other in active)
            active.append((rng, name))
    if offenders:
        listed = ", ".join(f"{a} & {b}" for a, b in offenders)
        raise AliasingError(
            f"{len(offenders)} pair(s) of tensors share memory: {listed}. Give each tensor its "
            "own storage (clone()) or pass only one of each aliasing pair.",
            offenders)
