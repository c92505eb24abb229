"""A pool's own state (layout, storage, registry) and every rule that keeps it consistent.

The ownership engine changes a pool only through :class:`PoolState`'s methods, including
``capture``/``restore``/``install`` for all-or-nothing operations. Readers take the pool's lock
too: a relocation holds it until its release proof, so a query never sees a half-moved pool.
"""

from __future__ import annotations

import itertools
import math
import threading
import weakref
from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from . import _torch_compat as tc
from ._npu_format import check_pool_storage
from ._aliasing import check_strided, extent_of, local_tensor
from ._table import table
from ._allocator import AllocSnapshot, RangeAllocator, align_up
from ._devices import DeviceLike, resolve_device
from .errors import (
    ForeignSliceError, FreedSliceError, InvalidRequestError, InvalidTypeError, PoolExhaustedError,
    PoolInvariantError,
)
from ._registry import AdoptionRegistry
from ._requests import ShapeLike, check_dtype, check_shape, contiguous_strides
from ._slice_index import SliceIndex, SliceRun
from .slices import Slice
from ._unreleased import Trace, UnreleasedOriginal

_T = TypeVar("_T")

if TYPE_CHECKING:
    from .pool import FlatPool
    from ._registry import Binding

DEFAULT_ALIGNMENT = 512
"""Default slice alignment: what HCCL and most CUDA collective kernels want."""

MAX_ALIGNMENT = 1 << 30
"""Largest alignment accepted (1 GiB): offsets near the int64 limit overflow torch's sizes."""

MAX_BYTES = 1 << 62
"""Largest pool extent accepted (torch sizes are int64): refused when planned."""

_pool_ids = itertools.count()
_all_states: weakref.WeakSet[PoolState] = weakref.WeakSet()
_by_storage: dict[int, weakref.ref[PoolState]] = {}
_registry_lock = threading.Lock()  # listing while another thread adds raises RuntimeError


def live_states() -> list[PoolState]:
    """The state of every pool still alive in this process (:func:`flatpool.live_pools`)."""
    with _registry_lock:
        result = list(_all_states)
        return result  # not `return f()`: see flatpool._interrupts


def pool_of_storage(key: int) -> PoolState | None:
    """The live pool whose current storage has key ``key``, if any. An entry is trusted only
    if the pool still says so: a dead storage's address may belong to a new one."""
    ref = _by_storage.get(key)
    pool = None if ref is None else ref()
    return pool if pool is not None and pool._buffer_key == key else None


_pool_storages: dict[int, int] = {}
"""Storage key -> raw weak reference, for every pool's storage, also after its pool object died
(tensors may still view it). The weak reference keeps the key from being reused meanwhile."""
_pruned_at = [64]  # entries after which the next lookup drops the dead ones


def was_pool_storage(key: int) -> bool:
    """The live storage with key ``key`` is (or was) a pool's storage."""
    with _registry_lock:
        if len(_pool_storages) > _pruned_at[0]:  # dead pools' dead storages: amortized O(1)
            for dead in [k for k, r in _pool_storages.items() if tc.weak_expired(r)]:
                tc.weak_free(_pool_storages.pop(dead))
            _pruned_at[0] = max(64, 2 * len(_pool_storages))
        ref = _pool_storages.get(key)
        return ref is not None and not tc.weak_expired(ref)


def _remember_storage(pool: PoolState, old: int | None, new: int | None) -> None:
    """O(1) and the same lines every time: it runs inside operations (and their rollback)."""
    if old is not None and (ref := _pool_storages.pop(old, None)) is not None:
        tc.weak_free(ref)
    if new is not None and new not in _pool_storages and pool._buffer is not None:
        _pool_storages[new] = tc.weak_storage(pool._buffer.untyped_storage())


def _index_storage(pool: PoolState, old: int | None, new: int | None) -> None:
    with _registry_lock:
        if old is not None and (r := _by_storage.get(old)) is not None and r() is pool:
            del _by_storage[old]
        if new is not None:
            _by_storage[new] = weakref.ref(pool)
        _remember_storage(pool, old, new)


def empty_storage_tensor(capacity: int, device: torch.device, name: str) -> torch.Tensor:
    """``capacity`` uninitialized bytes on ``device``, outside inference mode (adoptions
    ``set_`` normal tensors onto it); a failed allocation is a typed error."""
    try:
        with tc.outside_inference():
            result = torch.empty(capacity, dtype=torch.uint8, device=device)
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        raise PoolExhaustedError(
            f"{device} cannot allocate {capacity} bytes for pool {name!r}: {exc}",
            requested=capacity, free=0, largest_free=0,
        ) from exc
    return check_pool_storage(result, name)  # NPU: the plain ND format, or NpuFormatError


class PoolSnapshot:
    """Everything :meth:`PoolState.restore` needs to put a pool back (O(slices) to take)."""

    __slots__ = ("alloc", "index", "buffer", "buffer_key", "registry", "traces", "freed",
                 "__weakref__")
    alloc: AllocSnapshot
    index: SliceIndex
    buffer_key: int | None
    registry: dict[int, list[Binding]]
    traces: tuple[Trace, ...]

    def __init__(self, pool: PoolState) -> None:
        self.alloc = pool._alloc.snapshot()
        self.index = pool._index.copy()
        self.buffer: torch.Tensor | None = pool._buffer
        self.buffer_key = pool._buffer_key
        self.registry = pool._registry.snapshot()
        self.traces = pool._traces  # a tuple, replaced on change: shared, not copied
        self.freed: list[Slice] = []  # freed since by others (a gc finalizer): kept freed


class PoolState:
    """One pool's storage, layout and registry; arguments as :class:`~flatpool.FlatPool`'s,
    plus ``public``, the pool that holds this state (kept weakly)."""

    def __init__(self, public: FlatPool, device: DeviceLike = "cpu", *,
                 alignment: int = DEFAULT_ALIGNMENT, capacity: int | None = None,
                 name: str | None = None) -> None:
        if isinstance(alignment, bool) or not isinstance(alignment, int):
            raise InvalidTypeError(f"alignment must be an int, got {alignment!r}")
        if alignment < 1 or alignment & (alignment - 1) or alignment > MAX_ALIGNMENT:
            raise InvalidRequestError(
                f"alignment must be a power of two from 1 to {MAX_ALIGNMENT} (1 GiB), got "
                f"{alignment}")
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
        self.grows: bool = capacity is None
        self._buffer: torch.Tensor | None = None
        self._buffer_key: int | None = None
        self._next_slice_id = 0  # (an int, not an itertools.count: no gc-tracked object)
        self._index = SliceIndex()
        # Bumped *before* every change of the live handles: an interrupt in between costs a
        # reader a recheck, never a stale answer.
        self.live_version = 0
        self._registry = AdoptionRegistry()
        # Open captures (weakly: a snapshot holds the buffer): frees meanwhile outlast them.
        # Tuples, replaced on change: an idle pool holds the shared empty tuple, no container
        # the cycle collector must scan (fusion makes a pool per group, thousands at once).
        self._watching: tuple[weakref.ref[PoolSnapshot], ...] = ()
        self._traces: tuple[Trace, ...] = ()
        self._public_ref = weakref.ref(public)
        with _registry_lock:
            _all_states.add(self)

    # -- copying: a pool owns device memory that live tensors point into -----------------------
    def __reduce__(self) -> Any:
        raise InvalidTypeError(
            f"pool {self.name!r} cannot be pickled or copied: it owns device memory that live "
            "tensors point into. Save the tensors (module.state_dict()) and build a new pool.")

    def __copy__(self) -> Any:
        self.__reduce__()

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        self.__reduce__()

    # -- state -----------------------------------------------------------------------------
    @property
    def lock(self) -> threading.RLock:
        return self._lock

    @property
    def is_materialized(self) -> bool:
        with self._lock:
            return self._buffer is not None

    @property
    def capacity(self) -> int:
        with self._lock:
            return self._alloc.extent

    @property
    def used_bytes(self) -> int:
        with self._lock:
            result = self._index.used_bytes()
            return result  # not `return f()`: see flatpool._interrupts

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self.capacity - self.used_bytes

    @property
    def largest_free_bytes(self) -> int:
        with self._lock:
            result = self._alloc.largest_free()
            return result  # not `return f()`: see flatpool._interrupts

    def slices(self) -> tuple[Slice, ...]:
        with self._lock:
            result = tuple(self._index.ordered())
            return result  # not `return f()`: see flatpool._interrupts

    def is_live(self, slc: Slice) -> bool:
        with self._lock:  # a relocation rebuilds the index: never look at it half-built
            return slc.pool._state is self and self._index.get(slc.slice_id) == slc

    def live_slice(self, slice_id: int) -> Slice | None:
        with self._lock:
            result = self._index.get(slice_id)
            return result  # not `return f()`: see flatpool._interrupts

    @property
    def storage(self) -> torch.UntypedStorage:
        with self._lock:
            result = self.byte_buffer().untyped_storage()
            return result  # not `return f()`: see flatpool._interrupts

    @property
    def storage_key(self) -> int | None:
        with self._lock:
            return self._buffer_key

    @property
    def storage_nbytes(self) -> int:
        with self._lock:  # (the size only: never the bytes, which may be freed)
            buf = self._buffer
            return 0 if buf is None else tc.storage_nbytes(tc.impl_untyped_storage(buf))

    @property
    def registry(self) -> AdoptionRegistry:
        return self._registry

    def __repr__(self) -> str:
        with self._lock:
            state = "materialized" if self.is_materialized else "planned"
            return (
                f"FlatPool(name={self.name!r}, device={str(self.device)!r}, {state}, "
                f"capacity={self.capacity}, used={self.used_bytes}, slices={len(self._index)})"
            )

    # -- allocation ------------------------------------------------------------------------
    def slice_alignment(self, dtype: torch.dtype) -> int:
        return max(self.alignment, dtype.itemsize)

    def allocate(self, shape: ShapeLike, dtype: torch.dtype) -> Slice:
        return self.allocate_checked(check_shape(shape), check_dtype(dtype))

    def allocate_like(self, t: torch.Tensor) -> Slice:
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError(f"allocate_like() needs a tensor, got {type(t).__name__}")
        inner = local_tensor(t)
        check_strided(inner, f"allocate_like()'s {type(t).__name__}")  # no single dense shape
        with tc.no_torch_function():
            result = self.allocate(tuple(tc.impl_size(inner)), tc.impl_dtype(inner))
            return result  # not `return f()`: see flatpool._interrupts

    def allocate_many(self, requests: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[Slice]:
        if len(requests) == 1:
            # One request is placed as a single: the place a run would get, all or nothing by
            # itself (no layout saved first), and its index entries are fewer objects than a
            # run's columns (a fusion makes a one-slice pool per group).
            return [self.allocate_checked(*requests[0])]
        return self._all_or_nothing(self._allocate_many, requests)

    def _allocate_many(self, requests: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[Slice]:
        sizes = [(math.prod(d) * t.itemsize, self.slice_alignment(t)) for d, t in requests]
        if all(n > 0 for n, _ in sizes):
            before = self._alloc.snapshot()
            starts = self._alloc.append_many(sizes)
            if starts is not None and (not starts or starts[-1] + sizes[-1][0] <= MAX_BYTES):
                return self._index_run(starts, [d for d, _ in requests],
                                       [t for _, t in requests]).handles()
            if starts is not None:  # over the address limit: undo, report per request
                self._alloc.restore(before)
        return [self.allocate_checked(d, t) for d, t in requests]

    def _all_or_nothing(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)`` under the lock; any exception puts the layout back as it was.

        ``fn`` changes the layout only (allocator, index, slice ids: never the storage, the
        registry or the traces), so only the layout is saved, not a whole :class:`PoolSnapshot`.
        """
        with self._lock:
            before = (self._alloc.snapshot(), self._index.copy())
            try:
                result = fn(*args)
                return result  # not `return f()`: see flatpool._interrupts
            except BaseException:
                self._restore_layout(*before)
                raise

    def _restore_layout(self, alloc: AllocSnapshot, index: SliceIndex) -> None:
        """Put back a layout saved by :meth:`_all_or_nothing` (idempotent: assignments)."""
        self._alloc.restore(alloc)
        self.live_version += 1
        self._index = index.copy()

    def _index_run(self, starts: array[int], shapes: Sequence[tuple[int, ...]],
                   dtypes: Sequence[torch.dtype]) -> SliceRun:
        """The run the allocator just appended, indexed as one lazy ``SliceRun``."""
        first = self._take_ids(len(starts))
        run = SliceRun(self._public, first, starts, shapes, dtypes)
        self.live_version += 1
        self._index.add_run(run)
        return run

    def allocate_checked(self, dims: tuple[int, ...], dt: torch.dtype) -> Slice:
        """:meth:`allocate` for a shape and dtype already validated."""
        nbytes = math.prod(dims) * dt.itemsize
        if nbytes == 0:
            raise InvalidRequestError(
                f"shape {dims} of {dt} holds no bytes; keep zero-size tensors outside the pool")
        with self._lock:
            align = self.slice_alignment(dt)
            start = self._alloc.find(nbytes, align)
            if start is not None and start + nbytes > MAX_BYTES - self.alignment:
                raise InvalidRequestError(
                    f"shape {dims} of {dt} ({nbytes} bytes) at offset {start} would take pool "
                    f"{self.name!r} past {MAX_BYTES} bytes, more than any device can address")
            if start is None:
                free = self.capacity - self._index.used_bytes()
                largest = self._alloc.largest_fit(align)
                raise PoolExhaustedError(
                    f"pool {self.name!r} cannot fit {nbytes} bytes ({dt}, shape {dims}) at "
                    f"alignment {align}: {free} bytes free of {self.capacity}, the largest "
                    f"usable gap is {largest} bytes. " + self._full_hint(),
                    requested=nbytes, free=free, largest_free=largest)
            slc = Slice(self._public, self._take_ids(1), start, dims, dt)
            with self._alloc.journaled():  # all or nothing, whatever line an interrupt hits
                try:
                    self._alloc.take(start, nbytes)
                    self._insert(slc)
                except BaseException:
                    self._unindex(slc)
                    raise
            return slc

    def free(self, slc: Slice) -> None:
        with self._lock:
            self.check_live(slc)
            if self._registry.holds(slc.slice_id):
                raise InvalidRequestError(
                    f"slice {slc.slice_id} of pool {self.name!r} still backs adopted tensors; "
                    "call pool.disown(slice) (or release them) before freeing it")
            self._drop(slc)
            for ref in self._watching:  # an operation's rollback must not bring it back
                snap = ref()
                if snap is not None and snap.index.get(slc.slice_id) == slc:
                    snap.freed.append(slc)

    def _drop(self, slc: Slice) -> None:
        """Forget ``slc`` (index, free list, dead bindings): all or nothing under an interrupt."""
        bound = self._registry.bindings(slc.slice_id)
        with self._alloc.journaled():
            try:
                self._remove(slc)
                self._alloc.release(slc.offset, slc.end)
                self._registry.unbind(slc.slice_id)  # bindings whose tensors died
            except BaseException:
                self._reindex(slc)
                if bound and not self._registry.bindings(slc.slice_id):
                    self._registry.bind(slc.slice_id, list(bound))
                raise

    def disown(self, slc: Slice) -> None:
        with self._lock:
            self.check_live(slc)
            self._registry.unbind(slc.slice_id)

    def check_live(self, slc: Slice) -> None:
        if not isinstance(slc, Slice):
            raise InvalidTypeError(f"expected a Slice, got {type(slc).__name__}")
        if slc.pool._state is not self:
            raise ForeignSliceError(
                f"slice {slc.slice_id} belongs to pool {slc.pool.name!r}, not {self.name!r}")
        live = self._index.get(slc.slice_id)
        if live is not slc and live != slc:  # (a copy of a handle is the same handle)
            raise FreedSliceError(
                f"slice {slc.slice_id} of pool {self.name!r} (offset {slc.offset}, "
                f"{slc.nbytes} bytes) was freed or relocated; use the handle returned since")

    @property
    def public(self) -> FlatPool | None:
        """The :class:`~flatpool.FlatPool` holding this state, held weakly so that a pool dies
        by reference counting, not at the next gc pass."""
        return self._public_ref()

    @property
    def _public(self) -> FlatPool:
        """:attr:`public` for the handles made through the pool's methods (so while it lives)."""
        pool = self._public_ref()
        assert pool is not None, "a pool's state outlived its FlatPool while making a handle"
        return pool

    def new_handle(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> Slice:
        """A fresh slice handle (new id) not yet in the layout: for :meth:`install`."""
        return Slice(self._public, self._take_ids(1), offset, shape, dtype)

    def _take_ids(self, n: int) -> int:
        """The first of ``n`` fresh slice ids (never reused in this pool)."""
        first = self._next_slice_id
        self._next_slice_id = first + n
        return first

    def _insert(self, slc: Slice) -> None:
        self.live_version += 1
        self._index.insert(slc)

    def _remove(self, slc: Slice) -> None:
        self.live_version += 1
        self._index.remove(slc)

    def _unindex(self, slc: Slice) -> None:
        """Undo :meth:`_insert` however far it got (absolute: each entry removed if there)."""
        self.live_version += 1
        self._index.unindex(slc)

    def _reindex(self, slc: Slice) -> None:
        """Undo :meth:`_remove` however far it got (absolute: each entry put back if missing)."""
        self.live_version += 1
        self._index.reindex(slc)

    def _full_hint(self) -> str:
        if self.grows:  # only a materialized growing pool is ever full
            return ("allocate() never moves a materialized pool's storage: grow() it first "
                    "(adopt() grows a pool made without capacity= by itself), or free slices.")
        return ("Free slices, compact() or grow() the pool, or make it without capacity= to "
                "let adopt() grow it.")

    # -- storage ---------------------------------------------------------------------------
    def materialize(self) -> None:
        self.byte_buffer()

    def byte_buffer(self) -> torch.Tensor:
        # Under the lock: even a brief reference to the old buffer would pin the storage a
        # relocation in another thread is proving dead.
        with self._lock:
            if self._buffer is None:
                extent = self._alloc.extent
                # A fixed capacity is allocated as given; a planned extent is padded to alignment.
                capacity = align_up(extent, self.alignment) if self._alloc.growable else extent
                buf = empty_storage_tensor(capacity, self.device, self.name)
                key = tc.storage_address(buf)
                self._alloc.fix(capacity)
                self._buffer, self._buffer_key = buf, key
                _index_storage(self, None, key)
            return self._buffer

    def view(self, slc: Slice) -> torch.Tensor:
        with self._lock:
            self.check_live(slc)
            result = self.view_at(slc.offset, slc.shape, slc.dtype)
            return result  # not `return f()`: see flatpool._interrupts

    def view_at(self, offset: int, shape: Sequence[int], dtype: torch.dtype,
                stride: Sequence[int] | None = None) -> torch.Tensor:
        storage = self.storage
        strides = tuple(stride) if stride is not None else contiguous_strides(shape)
        with tc.outside_inference():
            out = torch.empty(0, dtype=dtype, device=self.device)
            with torch.no_grad():
                out.set_(storage, offset // dtype.itemsize, tuple(shape), strides)
        return out

    def view_bytes(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.view_at(offset, (nbytes,), torch.uint8)

    def slice_bytes(self, slc: Slice) -> torch.Tensor:
        """``slc``'s bytes as a 1-D ``uint8`` view, checked live in the same locked step (a
        freed range may already belong to another slice)."""
        with self._lock:
            self.check_live(slc)
            result = self.view_bytes(slc.offset, slc.nbytes)
            return result  # not `return f()`: see flatpool._interrupts

    def flat(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        with self._lock:
            self.byte_buffer()  # first: materializing may pad the capacity
            dtypes = self._index.dtypes()
            if dtype is None:
                dtype = dtypes.pop() if len(dtypes) == 1 else torch.uint8
                if self.capacity % dtype.itemsize:
                    dtype = torch.uint8
            else:
                dtype = check_dtype(dtype)
                if dtype != torch.uint8 and dtypes - {dtype}:
                    raise InvalidRequestError(
                        f"pool {self.name!r} holds slices of {sorted(map(str, dtypes))}; a flat "
                        f"{dtype} view would reinterpret them. Use flat() or flat(torch.uint8).")
                if self.capacity % dtype.itemsize:
                    raise InvalidRequestError(
                        f"capacity {self.capacity} is not a multiple of {dtype}'s size")
            result = self.view_at(0, (self.capacity // dtype.itemsize,), dtype)
            return result  # not `return f()`: see flatpool._interrupts

    # -- aliasing --------------------------------------------------------------------------
    def owns(self, t: torch.Tensor) -> bool:
        return self._placement(t) is not None

    def _placement(self, t: torch.Tensor) -> tuple[int, int] | None:
        """``t``'s byte extent in this pool's storage, or ``None`` when it is not inside."""
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError(f"expected a torch.Tensor, got {type(t).__name__}")
        inner = local_tensor(t)
        with self._lock:
            key = self._buffer_key
            if key is None:
                return None
            with tc.no_torch_function():
                if tc.impl_is_meta(inner) or tc.impl_layout(inner) != torch.strided:
                    return None
                if tc.storage_address(inner) != key:
                    return None
                rng = extent_of(inner)
            if 0 <= rng.start and rng.end <= self.capacity:
                return rng.start, rng.end
            return None

    def slice_of(self, t: torch.Tensor) -> Slice | None:
        with self._lock:
            place = self._placement(t)
            if place is None:
                return None
            start, end = place
            slc = self._index.floor(start)
            if slc is None:
                return None
            inside = slc.offset <= start < slc.end if start == end else end <= slc.end
            return slc if inside else None

    # -- all-or-nothing support ----------------------------------------------------------
    def capture(self) -> PoolSnapshot:
        """Remember everything for :meth:`restore`; slices freed until :meth:`forget` stay so."""
        with self._lock:
            snap = PoolSnapshot(self)
            self._watching = (*self._watching, weakref.ref(snap))
            return snap

    def forget(self, snap: PoolSnapshot) -> None:
        """``snap`` is done with (its operation finished)."""
        with self._lock:
            self._watching = tuple([r for r in self._watching
                                    if (open_ := r()) is not None and open_ is not snap])

    def restore(self, snap: PoolSnapshot) -> None:
        """Put the pool back as :meth:`capture` saw it. Idempotent: every field is assigned."""
        with self._lock:
            self._alloc.restore(snap.alloc)
            self.live_version += 1
            self._index = snap.index.copy()
            old = self._buffer_key
            self._buffer, self._buffer_key = snap.buffer, snap.buffer_key
            _index_storage(self, old if old != snap.buffer_key else None, snap.buffer_key)
            self._registry.restore(snap.registry)
            self._traces = snap.traces
            for slc in snap.freed:  # freed by others meanwhile (absolute: skip if gone)
                if self._index.get(slc.slice_id) == slc:
                    self._drop(slc)

    def install(
        self, buffer: torch.Tensor | None, allocator: RangeAllocator, slices: Sequence[Slice]
    ) -> None:
        """Switch to a new storage, layout and set of handles in one step (relocation)."""
        with self._lock:
            key = None if buffer is None else tc.storage_key(buffer.untyped_storage())
            old = self._buffer_key
            self._buffer, self._buffer_key, self._alloc = buffer, key, allocator
            _index_storage(self, old if old != key else None, key)
            self.live_version += 1
            self._index = SliceIndex()
            for s in sorted(slices, key=lambda s: s.offset):
                self._insert(s)

    def check_invariants(self) -> None:
        with self._lock:
            if self._buffer is not None:
                nbytes = self._buffer.untyped_storage().nbytes()
                if nbytes != self.capacity:
                    raise PoolInvariantError(
                        f"pool {self.name!r}'s storage is {nbytes} bytes, not its capacity "
                        f"{self.capacity}: a tensor placed past its end grew it, or a tensor on it "
                        "shrank it (untyped_storage().resize_())")
            if not self._index.consistent():
                raise PoolInvariantError(f"pool {self.name!r}'s slice index is inconsistent")

    # -- originals left alive --------------------------------------------------------------
    def trace_unreleased(self, info: UnreleasedOriginal, storage: torch.UntypedStorage,
                         tensor: torch.Tensor | None = None) -> None:
        """Remember an original an adoption left alive (with ``tensor``: keep it until that
        TensorImpl has no owner besides its Python object)."""
        with self._lock:
            self._traces = (*self._traces, Trace(info, storage, tensor))

    def unreleased_originals(self) -> tuple[UnreleasedOriginal, ...]:
        self.release_kept()
        with self._lock:
            result = tuple([t.info for t in self._traces if t.alive()])
            return result  # not `return f()`: see flatpool._interrupts

    def release_kept(self) -> int:
        with self._lock:
            dropped = sum(t.release_if_free() for t in self._traces)
            # (tuples from lists: see flatpool.ownership._adopt._items on tuples a generator fills)
            self._traces = tuple([t for t in self._traces if t.alive()])
            return dropped

    # -- introspection -------------------------------------------------------------------
    def describe(self) -> str:
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
                    ))
                pos = slc.end
            if self.capacity > pos:
                rows.append((str(pos), str(self.capacity), str(self.capacity - pos), "gap", "", "", ""))
            lines = [
                f"FlatPool {self.name!r} on {self.device} "
                f"({'materialized' if self.is_materialized else 'planned'}, "
                f"alignment {self.alignment})"
            ]
            lines += table(rows, right=range(len(rows[0])))
            lines.append(
                f"capacity {self.capacity} B, used {self.used_bytes} B, free {self.free_bytes} B "
                f"in {len(self._alloc.free_ranges())} range(s), {len(self._index)} slice(s)")
            result = "\n".join(lines)
            return result  # not `return f()`: see flatpool._interrupts
