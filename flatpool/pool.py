"""``FlatPool``: the public API of a pool, delegating to its private state and the engine.

The pool *holds* a :class:`flatpool._state.PoolState` (composition), which flatpool's engine
and add-ons reach through one private accessor, ``pool._state``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from ._registry import AdoptionRegistry
from ._state import DEFAULT_ALIGNMENT, MAX_BYTES, PoolState, live_states
from ._devices import DeviceLike
from .ownership._adopt import AdoptTargets, adopt
from .ownership._meta import MetaTargets, materialize_into
from .ownership._readopt import readopt
from .ownership._relocate import compact, grow
from .ownership._spec import AdoptionReport, AdoptSpec, OnPinned
from .ownership._validity import is_valid, moved
from ._requests import ShapeLike, contiguous_strides
from .slices import Slice
from ._unreleased import UnreleasedOriginal


class FlatPool:
    """Contiguous device storage handing out typed :class:`Slice` views.

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"npu"`` (optional index), a ``torch.device`` or an
            accelerator index, available now (``torch_npu`` is imported only for ``"npu"``).
        alignment: every slice starts at a multiple of ``max(alignment, dtype.itemsize)``
            bytes: a power of two up to 1 GiB; 1 packs slices without gaps.
        capacity: fixed size in bytes, or ``None`` for a *growing* pool: an ``adopt`` that
            does not fit moves it, in the same transaction, to a storage with room (copying
            every byte once: adopt many tensors a call). ``allocate()`` never moves it.
        name: shown in errors, ``repr`` and :meth:`describe`.

    All methods are thread-safe (one re-entrant lock per pool).
    """

    __slots__ = ("_state", "__weakref__")

    _state: PoolState  # refers back to this object weakly, for the handles it makes

    def __init__(self, device: DeviceLike = "cpu", *, alignment: int = DEFAULT_ALIGNMENT,
                 capacity: int | None = None, name: str | None = None) -> None:
        self._state = PoolState(self, device, alignment=alignment, capacity=capacity, name=name)

    def __reduce__(self) -> Any:
        return self._state.__reduce__()  # raises: it cannot be pickled or copied

    def __copy__(self) -> Any:
        return self._state.__reduce__()

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return self._state.__reduce__()

    def __repr__(self) -> str:
        return repr(self._state)

    # -- what the pool is ------------------------------------------------------------------
    @property
    def name(self) -> str:
        """Shown in errors, ``repr`` and :meth:`describe`."""
        return self._state.name

    @property
    def device(self) -> torch.device:
        return self._state.device

    @property
    def alignment(self) -> int:
        """Every slice starts at a multiple of ``max(alignment, dtype.itemsize)`` bytes."""
        return self._state.alignment

    @property
    def grows(self) -> bool:
        """Made without ``capacity=``: ``adopt`` moves it to a larger storage when needed."""
        return self._state.grows

    @property
    def lock(self) -> threading.RLock:
        """The pool's re-entrant lock; hold it to make several calls atomic."""
        return self._state.lock

    @property
    def is_materialized(self) -> bool:
        return self._state.is_materialized

    @property
    def capacity(self) -> int:
        """Bytes of the storage (planned extent while unmaterialized and growable)."""
        return self._state.capacity

    @property
    def used_bytes(self) -> int:
        """Bytes inside live slices (alignment padding counts as free)."""
        return self._state.used_bytes

    @property
    def free_bytes(self) -> int:
        return self._state.free_bytes

    @property
    def largest_free_bytes(self) -> int:
        return self._state.largest_free_bytes

    @property
    def storage(self) -> torch.UntypedStorage:
        """The pool's storage (materializes the pool). Holding it pins it: a later
        relocation then fails, or keeps it alive with ``on_pinned="warn"``."""
        return self._state.storage

    @property
    def storage_key(self) -> int | None:
        """The identity of the pool's current storage; ``None`` before materialization."""
        return self._state.storage_key

    @property
    def storage_nbytes(self) -> int:
        """Bytes the pool's storage holds now (0 before materialization): its capacity, unless
        a tensor on it shrank it (``untyped_storage().resize_()``)."""
        return self._state.storage_nbytes

    @property
    def live_version(self) -> int:
        """Bumped before every change of the live slices: a cache of them is current until then."""
        return self._state.live_version

    @property
    def registry(self) -> AdoptionRegistry:
        """What this pool adopted: which tensor objects live in which slice."""
        return self._state.registry

    # -- slices ----------------------------------------------------------------------------
    def slice_alignment(self, dtype: torch.dtype) -> int:
        """Where a slice of ``dtype`` may start: a multiple of this many bytes."""
        return self._state.slice_alignment(dtype)

    def allocate(self, shape: ShapeLike, dtype: torch.dtype) -> Slice:
        """Reserve a slice for ``shape`` and ``dtype``: planned before materialization, then the
        best-fitting gap; :class:`PoolExhaustedError` when nothing fits."""
        return self._state.allocate(shape, dtype)

    def allocate_like(self, t: torch.Tensor) -> Slice:
        """Reserve a slice with ``t``'s local shape and dtype; ``t`` may be a meta tensor."""
        return self._state.allocate_like(t)

    def allocate_many(self, requests: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[Slice]:
        """Validated ``(shape, dtype)`` requests in order, placed in one step when the pool is
        planned from scratch, else one by one; all or none."""
        return self._state.allocate_many(requests)

    def free(self, slc: Slice) -> None:
        """Return ``slc``'s bytes to the pool; the handle is dead afterwards."""
        self._state.free(slc)

    def disown(self, slc: Slice) -> None:
        """Forget which tensors were adopted into ``slc`` (they keep using it) so it can be freed."""
        self._state.disown(slc)

    def slices(self) -> tuple[Slice, ...]:
        """Live slices, in storage order."""
        return self._state.slices()

    def is_live(self, slc: Slice) -> bool:
        """``slc`` is a live handle of this pool (compared by value: a copy of a handle is the
        same handle)."""
        return self._state.is_live(slc)

    def live_slice(self, slice_id: int) -> Slice | None:
        """The live handle with id ``slice_id``, if any."""
        return self._state.live_slice(slice_id)

    def describe(self) -> str:
        """A table of the layout: every slice and every gap, with totals."""
        return self._state.describe()

    def check_invariants(self) -> None:
        """Raise :class:`PoolInvariantError` unless the storage is exactly ``capacity`` bytes (a
        tensor on it may have grown or shrunk it) and the slice index matches the allocator."""
        self._state.check_invariants()

    # -- storage and views -----------------------------------------------------------------
    def materialize(self) -> None:
        """Make the storage: one allocation of ``capacity`` bytes. Idempotent."""
        self._state.materialize()

    def byte_buffer(self) -> torch.Tensor:
        """The whole storage as one 1-D ``uint8`` tensor (materializes the pool)."""
        return self._state.byte_buffer()

    def flat(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole buffer as one 1-D tensor, for fused collectives: in the slices' common dtype
        (``dtype=None``, else bytes) or ``dtype``, which every live slice must have unless uint8."""
        return self._state.flat(dtype)

    def view(self, slc: Slice) -> torch.Tensor:
        """A fresh tensor of ``slc``'s shape and dtype on the pool's storage
        (what :meth:`Slice.tensor` returns)."""
        return self._state.view(slc)

    def view_at(self, offset: int, shape: Sequence[int], dtype: torch.dtype,
                stride: Sequence[int] | None = None) -> torch.Tensor:
        """A base-less tensor at byte ``offset`` of the storage (no autograd view link)."""
        return self._state.view_at(offset, shape, dtype, stride)

    def view_bytes(self, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` bytes at byte ``offset`` of the storage, as a 1-D ``uint8`` tensor."""
        return self._state.view_bytes(offset, nbytes)

    # -- aliasing --------------------------------------------------------------------------
    def owns(self, t: torch.Tensor) -> bool:
        """True when ``t``'s storage *is* this pool's storage and all its bytes lie inside."""
        return self._state.owns(t)

    def slice_of(self, t: torch.Tensor) -> Slice | None:
        """The live slice holding all of ``t``'s bytes, or ``None``."""
        return self._state.slice_of(t)

    # -- ownership -------------------------------------------------------------------------
    def adopt(
        self,
        targets: AdoptTargets,
        *,
        discover: bool = False,
        on_pinned: OnPinned = "raise",
    ) -> AdoptionReport:
        """Move tensors' data into slices of this pool and prove the originals died.

        ``targets``: a tensor, an :class:`AdoptSpec`, or a sequence of them (one all-or-nothing
        batch). Every tensor object named moves in place, so identity and optimizer references
        survive; ``discover=True`` also finds every other Python tensor on the originals by a gc
        scan. A still-referenced original is handled per ``on_pinned`` (:data:`OnPinned`).
        """
        return adopt(self._state, targets, discover=discover, on_pinned=on_pinned)

    def readopt(
        self, specs: Sequence[AdoptSpec] | None = None, *, on_pinned: OnPinned = "raise"
    ) -> AdoptionReport:
        """Bring every adopted tensor that is not in place back into its slice (idempotent), after
        a framework re-materialized on its own (``to_empty``, ``load_state_dict``). ``specs``
        (each with its ``slice``) name the current holders and replace the slices' bindings.
        """
        return readopt(self._state, specs, on_pinned=on_pinned)

    def moved(self) -> list[Slice]:
        """Slices some of whose adopted tensors are not in place (see
        [Note: flatpool terms] in :mod:`flatpool.ownership`)."""
        seen: dict[int, Slice] = {}
        for slc, _, _ in moved(self._state):
            seen.setdefault(slc.slice_id, slc)
        return list(seen.values())

    def is_valid(self) -> bool:
        """True exactly when :meth:`moved` is empty and no slice lost all the parameters adopted
        into it (``load_state_dict(assign=True)``: :meth:`readopt` then says how to re-adopt)."""
        return is_valid(self._state)

    def materialize_into(
        self, targets: MetaTargets, slices: Sequence[Slice] | None = None
    ) -> tuple[Slice, ...]:
        """Give meta tensors/parameters pool storage in place (identity kept); see
        ``docs/meta.md``."""
        return materialize_into(self._state, targets, slices)

    def grow(self, capacity: int, *, on_pinned: OnPinned = "raise") -> None:
        """Move to a storage of ``capacity`` bytes, keeping offsets and handles; every adopted
        tensor is moved and the old storage proven dead (or everything rolls back)."""
        grow(self._state, capacity, on_pinned=on_pinned)

    def compact(self, *, on_pinned: OnPinned = "raise") -> dict[int, Slice]:
        """Pack slices without free gaps into a right-sized storage; returns old slice id ->
        new handle (old handles raise :class:`FreedSliceError`)."""
        return compact(self._state, on_pinned=on_pinned)

    def unreleased_originals(self) -> tuple[UnreleasedOriginal, ...]:
        """Adopted originals still alive: pinned by others under ``on_pinned="warn"``/``"force"``,
        or kept by the pool because something outside Python may still read them."""
        return self._state.unreleased_originals()

    def release_kept(self) -> int:
        """Drop the originals this pool kept whose outside holders are gone; returns how many."""
        return self._state.release_kept()


def live_pools() -> list[FlatPool]:
    """Every pool object still alive in this process."""
    return [pool for state in live_states() if (pool := state.public) is not None]


__all__ = [
    "DEFAULT_ALIGNMENT", "MAX_BYTES", "FlatPool", "ShapeLike", "contiguous_strides", "live_pools",
]
