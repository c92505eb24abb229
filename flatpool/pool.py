"""``FlatPool``: one contiguous, byte-addressed storage on one device, carved into slices.

Slices are planned first (from real or meta shapes) and the storage is made by a single
allocation at :meth:`FlatPool.materialize` or at the first access that needs it. Afterwards
allocation takes free space best-fit and :meth:`FlatPool.free` coalesces neighbours.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Union

import torch

from .aliasing import byte_range, storage_key, storage_of
from .allocator import RangeAllocator, align_up
from .devices import DeviceLike, resolve_device
from .errors import (
    FlatPoolError,
    ForeignSliceError,
    FreedSliceError,
    InvalidRequestError,
    InvalidTypeError,
    PoolExhaustedError,
)
from .slices import Slice

if TYPE_CHECKING:
    from .ownership.adopt import AdoptTargets
    from .ownership.meta import MetaTargets
    from .ownership.registry import AdoptionRegistry
    from .ownership.spec import AdoptionReport, AdoptSpec, OnPinned

ShapeLike = Union[int, Sequence[int], torch.Size]

DEFAULT_ALIGNMENT = 512
"""Bytes every slice start is aligned to by default: what NPU (HCCL) and most CUDA collective
kernels want for their buffers, and a multiple of every dtype's element size."""

MAX_BYTES = 1 << 62
"""Largest pool extent accepted: torch sizes are int64, and planning beyond this can never be
materialized (sizes that overflow are refused when planned, not at materialization)."""

_QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
_pool_ids = itertools.count()
_all_pools: weakref.WeakSet[FlatPool] = weakref.WeakSet()
_all_pools_lock = threading.Lock()  # listing while another thread adds raises RuntimeError


def live_pools() -> list[FlatPool]:
    """Every pool object still alive in this process."""
    with _all_pools_lock:
        return list(_all_pools)


def check_shape(shape: ShapeLike) -> tuple[int, ...]:
    """Validate ``shape`` (an int, a sequence of ints, a ``torch.Size``) into a tuple."""
    if isinstance(shape, bool):
        raise InvalidTypeError(f"shape must be ints, got a bool: {shape!r}")
    if isinstance(shape, int):
        dims: tuple[Any, ...] = (shape,)
    elif isinstance(shape, (Sequence, torch.Size)) and not isinstance(shape, (str, bytes)):
        dims = tuple(shape)
    else:
        raise InvalidTypeError(f"shape must be an int or a sequence of ints, got {shape!r}")
    out: list[int] = []
    for d in dims:
        if isinstance(d, bool):  # operator.index(True) == 1: a bool is not a dimension
            raise InvalidTypeError(f"shape {shape!r} has a bool dimension {d!r}")
        if not isinstance(d, int):
            try:
                d = operator.index(d)
            except TypeError:
                raise InvalidTypeError(
                    f"shape {shape!r} has a non-integer dimension {d!r} ({type(d).__name__})"
                ) from None
        if d < 0:
            raise InvalidRequestError(f"shape {shape!r} has a negative dimension {d}")
        out.append(int(d))
    return tuple(out)


def check_dtype(dtype: object) -> torch.dtype:
    if not isinstance(dtype, torch.dtype):
        raise InvalidTypeError(
            f"dtype must be a torch.dtype such as torch.float32, got {type(dtype).__name__}: "
            f"{dtype!r}"
        )
    if dtype in _QUANTIZED:
        raise InvalidTypeError(
            f"quantized dtype {dtype} needs quantizer parameters a plain storage cannot carry; "
            "store its integer representation (int_repr()) instead"
        )
    return dtype


class FlatPool:
    """Contiguous device storage handing out typed :class:`Slice` views.

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"npu"`` (with optional index) or a ``torch.device``.
            It must be available now; ``torch_npu`` is imported only for ``"npu"``.
        alignment: every slice starts at a multiple of ``max(alignment, dtype.itemsize)``
            bytes. A power of two; default 512. Use 1 to pack slices without gaps.
        capacity: fixed size in bytes. ``None`` (default) lets the pool grow while it is
            planned; :meth:`materialize` then fixes the capacity at the planned extent.
        name: shown in errors, ``repr`` and :meth:`describe`.

    All methods are thread-safe (one re-entrant lock per pool).
    """

    def __init__(
        self,
        device: DeviceLike = "cpu",
        *,
        alignment: int = DEFAULT_ALIGNMENT,
        capacity: int | None = None,
        name: str | None = None,
    ) -> None:
        if isinstance(alignment, bool) or not isinstance(alignment, int):
            raise InvalidTypeError(f"alignment must be an int, got {alignment!r}")
        if alignment < 1 or alignment & (alignment - 1):
            raise InvalidRequestError(
                f"alignment must be a positive power of two (1, 2, 4, ..., 512), got {alignment}"
            )
        if capacity is not None:
            if isinstance(capacity, bool) or not isinstance(capacity, int):
                raise InvalidTypeError(f"capacity must be an int or None, got {capacity!r}")
            if capacity < 0:
                raise InvalidRequestError(f"capacity must be >= 0 bytes, got {capacity}")
            if capacity > MAX_BYTES:
                raise InvalidRequestError(f"capacity {capacity} exceeds {MAX_BYTES} bytes")
        if name is not None and not isinstance(name, str):
            raise InvalidTypeError(f"name must be a str or None, got {name!r}")
        self.device: torch.device = resolve_device(device)
        self.alignment = alignment
        self.name: str = name if name is not None else f"pool{next(_pool_ids)}"
        self._lock = threading.RLock()
        self._alloc = RangeAllocator(capacity, alignment)
        self._buffer: torch.Tensor | None = None
        self._slice_ids = itertools.count()
        self._live: dict[int, Slice] = {}
        self._offsets: list[int] = []  # sorted starts of live slices
        self._at_offset: dict[int, Slice] = {}
        self._registry: AdoptionRegistry | None = None
        with _all_pools_lock:
            _all_pools.add(self)

    # -- state ---------------------------------------------------------------------------
    @property
    def lock(self) -> threading.RLock:
        """The pool's re-entrant lock; hold it to make several calls atomic."""
        return self._lock

    @property
    def is_materialized(self) -> bool:
        return self._buffer is not None

    @property
    def capacity(self) -> int:
        """Bytes of the storage (planned extent while unmaterialized and growable)."""
        return self._alloc.extent

    @property
    def used_bytes(self) -> int:
        """Bytes inside live slices (alignment padding counts as free)."""
        with self._lock:  # iterating _live while another thread allocates would raise
            return sum(s.nbytes for s in self._live.values())

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def largest_free_bytes(self) -> int:
        return self._alloc.largest_free()

    def slices(self) -> tuple[Slice, ...]:
        """Live slices, in storage order."""
        with self._lock:
            return tuple(self._at_offset[o] for o in self._offsets)

    def is_live(self, slc: Slice) -> bool:
        return slc.pool is self and self._live.get(slc.slice_id) is slc

    @property
    def storage(self) -> torch.UntypedStorage:
        """The pool's storage (materializes the pool)."""
        return self._materialized_buffer().untyped_storage()

    @property
    def registry(self) -> AdoptionRegistry:
        """What this pool adopted: which tensor objects live in which slice."""
        if self._registry is None:
            from .ownership.registry import AdoptionRegistry

            self._registry = AdoptionRegistry(self)
        return self._registry

    def __repr__(self) -> str:
        state = "materialized" if self.is_materialized else "planned"
        return (
            f"FlatPool(name={self.name!r}, device={str(self.device)!r}, {state}, "
            f"capacity={self.capacity}, used={self.used_bytes}, slices={len(self._live)})"
        )

    # -- allocation ------------------------------------------------------------------------
    def slice_alignment(self, dtype: torch.dtype) -> int:
        return max(self.alignment, dtype.itemsize)

    def allocate(self, shape: ShapeLike, dtype: torch.dtype) -> Slice:
        """Reserve a slice for a tensor of ``shape`` and ``dtype``.

        Before materialization this only plans (no memory is touched); afterwards it takes the
        best-fitting free gap. Raises :class:`PoolExhaustedError` when nothing fits.
        """
        return self._allocate(check_shape(shape), check_dtype(dtype))

    def _allocate_many(self, requests: list[tuple[tuple[int, ...], torch.dtype]]) -> list[Slice]:
        """Validated requests in order, as one step when the pool is planned from scratch."""
        with self._lock:
            sizes = [(math.prod(d) * t.itemsize, self.slice_alignment(t)) for d, t in requests]
            if all(n > 0 for n, _ in sizes):
                before = self._alloc.snapshot()
                starts = self._alloc.append_many(sizes)
                if starts is not None and (not starts or starts[-1] + sizes[-1][0] <= MAX_BYTES):
                    out = []
                    for (dims, dt), start in zip(requests, starts):
                        slc = Slice(self, next(self._slice_ids), start, dims, dt)
                        self._live[slc.slice_id] = slc
                        self._at_offset[start] = slc
                        out.append(slc)
                    self._offsets.extend(starts)  # past every existing slice, already sorted
                    return out
                if starts is not None:  # over the address limit: undo, report per request
                    self._alloc.restore(before)
            return [self._allocate(d, t) for d, t in requests]

    def _allocate(self, dims: tuple[int, ...], dt: torch.dtype) -> Slice:
        """:meth:`allocate` for a shape and dtype already validated (taken from a tensor)."""
        nbytes = math.prod(dims) * dt.itemsize
        if nbytes == 0:
            raise InvalidRequestError(
                f"shape {dims} of {dt} holds no bytes; keep zero-size tensors outside the pool"
            )
        with self._lock:
            align = self.slice_alignment(dt)
            start = self._alloc.find(nbytes, align)
            if start is not None and start + nbytes > MAX_BYTES - self.alignment:
                raise InvalidRequestError(
                    f"shape {dims} of {dt} ({nbytes} bytes) at offset {start} would take pool "
                    f"{self.name!r} past {MAX_BYTES} bytes, more than any device can address"
                )
            if start is None:
                raise PoolExhaustedError(
                    f"pool {self.name!r} cannot fit {nbytes} bytes ({dt}, shape {dims}) at "
                    f"alignment {align}: {self.free_bytes} bytes free of {self.capacity}, the "
                    f"largest usable gap is {self._alloc.largest_fit(align)} bytes. Free slices, "
                    "compact() or grow() the pool.",
                    requested=nbytes,
                    free=self.free_bytes,
                    largest_free=self._alloc.largest_fit(align),
                )
            self._alloc.take(start, nbytes)
            slc = Slice(self, next(self._slice_ids), start, dims, dt)
            self._insert(slc)
            return slc

    def allocate_like(self, t: torch.Tensor) -> Slice:
        """Reserve a slice with ``t``'s shape and dtype; ``t`` may be a meta tensor."""
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError(f"allocate_like() needs a tensor, got {type(t).__name__}")
        return self.allocate(tuple(t.shape), t.dtype)

    def free(self, slc: Slice) -> None:
        """Return ``slc``'s bytes to the pool; the handle is dead afterwards."""
        with self._lock:
            self.check_live(slc)
            if self._registry is not None and self._registry.holds(slc):
                raise InvalidRequestError(
                    f"slice {slc.slice_id} of pool {self.name!r} still backs adopted tensors; "
                    "call pool.disown(slice) (or release them) before freeing it"
                )
            self._remove(slc)
            self._alloc.release(slc.offset, slc.end)
            if self._registry is not None:  # bindings whose tensors died: a later readopt()
                self._registry.unbind(slc)  # would look the freed slice up

    def check_live(self, slc: Slice) -> None:
        if not isinstance(slc, Slice):
            raise InvalidTypeError(f"expected a Slice, got {type(slc).__name__}")
        if slc.pool is not self:
            raise ForeignSliceError(
                f"slice {slc.slice_id} belongs to pool {slc.pool.name!r}, not {self.name!r}"
            )
        if self._live.get(slc.slice_id) is not slc:
            raise FreedSliceError(
                f"slice {slc.slice_id} of pool {self.name!r} (offset {slc.offset}, "
                f"{slc.nbytes} bytes) was freed or relocated; use the handle returned since"
            )

    def _insert(self, slc: Slice) -> None:
        self._live[slc.slice_id] = slc
        bisect.insort(self._offsets, slc.offset)
        self._at_offset[slc.offset] = slc

    def _remove(self, slc: Slice) -> None:
        del self._live[slc.slice_id]
        i = bisect.bisect_left(self._offsets, slc.offset)
        del self._offsets[i]
        del self._at_offset[slc.offset]

    # -- storage ---------------------------------------------------------------------------
    def materialize(self) -> None:
        """Make the storage: one allocation of ``capacity`` bytes. Idempotent."""
        self._materialized_buffer()

    def _materialized_buffer(self) -> torch.Tensor:
        buf = self._buffer
        if buf is not None:
            return buf
        with self._lock:
            if self._buffer is None:
                extent = self._alloc.extent
                # A fixed capacity is allocated as given; a planned extent is padded to alignment.
                capacity = align_up(extent, self.alignment) if self._alloc.growable else extent
                buf = empty_storage_tensor(capacity, self.device, self.name)
                self._alloc.fix(capacity)
                self._buffer = buf
            return self._buffer

    def _install_buffer(self, buf: torch.Tensor, allocator: RangeAllocator) -> None:
        """Replace storage and layout at once (relocation); callers rebind what lived here."""
        self._buffer = buf
        self._alloc = allocator

    def view(self, slc: Slice) -> torch.Tensor:
        """A fresh tensor of ``slc``'s shape and dtype on the pool's storage."""
        self.check_live(slc)
        return self.view_at(slc.offset, slc.shape, slc.dtype)

    def view_at(
        self,
        offset: int,
        shape: Sequence[int],
        dtype: torch.dtype,
        stride: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """A base-less tensor at byte ``offset`` of the storage (no autograd view link)."""
        storage = self.storage
        strides = tuple(stride) if stride is not None else contiguous_strides(shape)
        out = torch.empty(0, dtype=dtype, device=self.device)
        with torch.no_grad():
            out.set_(storage, offset // dtype.itemsize, tuple(shape), strides)
        return out

    def view_bytes(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.view_at(offset, (nbytes,), torch.uint8)

    def flat(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole buffer as one 1-D tensor, for fused collectives.

        ``dtype=None`` gives the slices' dtype when every live slice shares one (and the
        capacity is a multiple of its size), else bytes. An explicit ``dtype`` other than
        ``torch.uint8`` requires every live slice to have it.
        """
        with self._lock:
            self._materialized_buffer()  # first: materializing may pad the capacity
            dtypes = {s.dtype for s in self._live.values()}
            if dtype is None:
                dtype = dtypes.pop() if len(dtypes) == 1 else torch.uint8
                if self.capacity % dtype.itemsize:
                    dtype = torch.uint8
            else:
                dtype = check_dtype(dtype)
                if dtype != torch.uint8 and dtypes - {dtype}:
                    raise InvalidRequestError(
                        f"pool {self.name!r} holds slices of {sorted(map(str, dtypes))}; a flat "
                        f"{dtype} view would reinterpret them. Use flat() or flat(torch.uint8)."
                    )
                if self.capacity % dtype.itemsize:
                    raise InvalidRequestError(
                        f"capacity {self.capacity} is not a multiple of {dtype}'s size"
                    )
            return self.view_at(0, (self.capacity // dtype.itemsize,), dtype)

    # -- aliasing --------------------------------------------------------------------------
    def owns(self, t: torch.Tensor) -> bool:
        """True when ``t``'s storage *is* this pool's storage and all its bytes lie inside."""
        buf = self._buffer
        if buf is None:
            return False
        if storage_key(storage_of(t)) != storage_key(buf.untyped_storage()):
            return False
        rng = byte_range(t)
        return 0 <= rng.start and rng.end <= self.capacity

    def slice_of(self, t: torch.Tensor) -> Slice | None:
        """The live slice holding all of ``t``'s bytes, or ``None``."""
        with self._lock:
            if not self.owns(t):
                return None
            rng = byte_range(t)
            i = bisect.bisect_right(self._offsets, rng.start) - 1
            if i < 0:
                return None
            slc = self._at_offset[self._offsets[i]]
            if rng.nbytes == 0:
                inside = slc.offset <= rng.start < slc.end
            else:
                inside = rng.end <= slc.end
            return slc if inside else None

    # -- ownership -------------------------------------------------------------------------
    def adopt(
        self,
        targets: AdoptTargets,
        *,
        discover: bool = False,
        on_pinned: OnPinned = "raise",
    ) -> AdoptionReport:
        """Move tensors' data into slices of this pool and prove the originals died.

        ``targets`` is a tensor, an :class:`AdoptSpec`, or a sequence of them (one batch: one
        copy, all-or-nothing). Every tensor object named (the tensor, a DTensor's local tensor,
        ``AdoptSpec.views``) is rebound in place, so identity, ``requires_grad`` and optimizer
        references survive; ``AdoptSpec.holders`` are given fresh pool tensors. With
        ``discover=True`` a gc scan also finds every other Python tensor on the originals.
        If an original is still referenced afterwards, ``on_pinned`` decides (see
        :data:`OnPinned`); by default everything rolls back and
        :class:`PinnedStorageError` names the holders.
        """
        from .ownership.adopt import adopt

        return adopt(self, targets, discover=discover, on_pinned=on_pinned)

    def readopt(
        self, specs: Sequence[AdoptSpec] | None = None, *, on_pinned: OnPinned = "raise"
    ) -> AdoptionReport:
        """Bring every adopted tensor that left the pool back into its slice (idempotent).

        Use after a framework re-materialized on its own (``to_empty``, lazy init,
        ``load_state_dict``): current values are copied into the existing slices and the
        objects rebound, with the same release proof as :meth:`adopt`. Pass ``specs`` (each
        with its ``slice``) to name the current holders explicitly; they replace the slices'
        recorded bindings.
        """
        from .ownership.readopt import readopt

        return readopt(self, specs, on_pinned=on_pinned)

    def moved(self) -> list[Slice]:
        """Slices some of whose adopted tensors no longer sit in the pool."""
        from .ownership.readopt import moved

        seen: dict[int, Slice] = {}
        for slc, _, _ in moved(self):
            seen.setdefault(slc.slice_id, slc)
        return list(seen.values())

    def is_valid(self) -> bool:
        """True when every adopted tensor still aliases its slice."""
        return not self.moved()

    def materialize_into(
        self, targets: MetaTargets, slices: Sequence[Slice] | None = None
    ) -> tuple[Slice, ...]:
        """Give meta tensors/parameters pool storage in place (``swap_tensors``); see
        :func:`flatpool.ownership.meta.materialize_into`."""
        from .ownership.meta import materialize_into

        return materialize_into(self, targets, slices)

    def disown(self, slc: Slice) -> None:
        """Forget which tensors were adopted into ``slc`` (they keep using it) so it can be freed."""
        with self._lock:
            self.check_live(slc)
            if self._registry is not None:
                self._registry.unbind(slc)

    def grow(self, capacity: int, *, on_pinned: OnPinned = "raise") -> None:
        """Move to a storage of ``capacity`` bytes, keeping offsets and handles; every adopted
        tensor is rebound and the old storage proven dead (or everything rolls back)."""
        from .ownership.relocate import grow

        grow(self, capacity, on_pinned=on_pinned)

    def compact(self, *, on_pinned: OnPinned = "raise") -> dict[int, Slice]:
        """Pack slices without free gaps into a right-sized storage; returns old slice id ->
        new handle (old handles raise :class:`FreedSliceError`)."""
        from .ownership.relocate import compact

        return compact(self, on_pinned=on_pinned)

    # -- introspection -------------------------------------------------------------------
    def describe(self) -> str:
        """A table of the layout: every slice and every gap, with totals."""
        with self._lock:
            rows = [("offset", "end", "bytes", "kind", "dtype", "shape", "slice")]
            pos = 0
            for slc in self.slices():
                if slc.offset > pos:
                    rows.append((str(pos), str(slc.offset), str(slc.offset - pos), "gap", "", "", ""))
                rows.append(
                    (
                        str(slc.offset),
                        str(slc.end),
                        str(slc.nbytes),
                        "slice",
                        str(slc.dtype).replace("torch.", ""),
                        "x".join(map(str, slc.shape)) or "scalar",
                        str(slc.slice_id),
                    )
                )
                pos = slc.end
            if self.capacity > pos:
                rows.append((str(pos), str(self.capacity), str(self.capacity - pos), "gap", "", "", ""))
            widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
            lines = [
                f"FlatPool {self.name!r} on {self.device} "
                f"({'materialized' if self.is_materialized else 'planned'}, "
                f"alignment {self.alignment})"
            ]
            lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
            lines.append(
                f"capacity {self.capacity} B, used {self.used_bytes} B, free {self.free_bytes} B "
                f"in {len(self._alloc.free_ranges())} range(s), {len(self._live)} slice(s)"
            )
            return "\n".join(lines)


def empty_storage_tensor(capacity: int, device: torch.device, name: str) -> torch.Tensor:
    """``capacity`` uninitialized bytes on ``device``; a failed allocation is a typed error."""
    try:
        return torch.empty(capacity, dtype=torch.uint8, device=device)
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        raise PoolExhaustedError(
            f"{device} cannot allocate {capacity} bytes for pool {name!r}: {exc}",
            requested=capacity, free=0, largest_free=0,
        ) from exc


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (what a fresh ``torch.empty(shape)`` has)."""
    strides: list[int] = []
    acc = 1
    for d in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


__all__ = ["DEFAULT_ALIGNMENT", "FlatPool", "FlatPoolError", "ShapeLike", "live_pools"]
