"""``FlatPool``: the public face of a pool, with its ownership operations.

:class:`flatpool._state.PoolState` holds the storage, the layout and the registry and keeps them
consistent; the ownership engine (:mod:`flatpool.ownership`) moves tensors in and out through
that interface; this class puts the two together as one object.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import _slice_index, _state, slices
from .ownership._adopt import AdoptTargets, adopt
from .ownership._meta import MetaTargets, materialize_into
from .ownership._readopt import readopt
from .ownership._validity import is_valid, moved
from .ownership._relocate import compact, grow
from .ownership._spec import AdoptionReport, AdoptSpec, OnPinned
from .slices import Slice
from .requests import ShapeLike, check_dtype, check_shape, contiguous_strides
from ._state import DEFAULT_ALIGNMENT, MAX_BYTES, PoolState, empty_storage_tensor, live_pools


class FlatPool(PoolState):
    """Contiguous device storage handing out typed :class:`Slice` views.

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"npu"`` (with optional index), a ``torch.device``, or
            an accelerator index. It must be available now; ``torch_npu`` is imported only for
            ``"npu"``.
        alignment: every slice starts at a multiple of ``max(alignment, dtype.itemsize)``
            bytes. A power of two up to 1 GiB; default 512. Use 1 to pack slices without gaps.
        capacity: fixed size in bytes. ``None`` (default) lets the pool grow while it is
            planned; :meth:`materialize` then fixes the capacity at the planned extent.
        name: shown in errors, ``repr`` and :meth:`describe`.

    All methods are thread-safe (one re-entrant lock per pool).
    """

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
        a wrapper sharing its storage, ``AdoptSpec.views``, what ``AdoptSpec.holders`` hold)
        moves in place, so identity, ``requires_grad`` and optimizer references survive. With
        ``discover=True`` a gc scan also finds every other Python tensor on the originals.
        If an original is still referenced afterwards, ``on_pinned`` decides (see
        :data:`OnPinned`); by default everything rolls back and
        :class:`PinnedStorageError` names the holders.
        """
        return adopt(self, targets, discover=discover, on_pinned=on_pinned)

    def readopt(
        self, specs: Sequence[AdoptSpec] | None = None, *, on_pinned: OnPinned = "raise"
    ) -> AdoptionReport:
        """Bring every adopted tensor that is not in place back into its slice (idempotent).

        Use after a framework re-materialized on its own (``to_empty``, lazy init,
        ``load_state_dict``): current values are copied into the existing slices and the
        objects moved back, with the same release proof as :meth:`adopt`. Pass ``specs``
        (each with its ``slice``) to name the current holders explicitly; they replace the
        slices' recorded bindings.
        """
        return readopt(self, specs, on_pinned=on_pinned)

    def moved(self) -> list[Slice]:
        """Slices some of whose adopted tensors are not in place (see
        [Note: flatpool terms] in :mod:`flatpool.ownership`)."""
        seen: dict[int, Slice] = {}
        for slc, _, _ in moved(self):
            seen.setdefault(slc.slice_id, slc)
        return list(seen.values())

    def is_valid(self) -> bool:
        """True when every adopted tensor is in place (on its slice, with the shape, strides and
        dtype it was adopted with) and no slice lost all the parameters adopted into it (a
        module that replaced them, ``load_state_dict(assign=True)``: :meth:`readopt` then warns
        and says how to re-adopt): exactly when :meth:`moved` is empty and nothing is orphaned."""
        return is_valid(self)

    def materialize_into(
        self, targets: MetaTargets, slices: Sequence[Slice] | None = None
    ) -> tuple[Slice, ...]:
        """Give meta tensors/parameters pool storage in place (identity kept); see
        :func:`flatpool.ownership._meta.materialize_into`."""
        return materialize_into(self, targets, slices)

    def grow(self, capacity: int, *, on_pinned: OnPinned = "raise") -> None:
        """Move to a storage of ``capacity`` bytes, keeping offsets and handles; every adopted
        tensor is moved and the old storage proven dead (or everything rolls back)."""
        grow(self, capacity, on_pinned=on_pinned)

    def compact(self, *, on_pinned: OnPinned = "raise") -> dict[int, Slice]:
        """Pack slices without free gaps into a right-sized storage; returns old slice id ->
        new handle (old handles raise :class:`FreedSliceError`)."""
        return compact(self, on_pinned=on_pinned)


# These modules name FlatPool in annotations but cannot import it (this module imports them):
# give them the name, so that ``typing.get_type_hints`` (Sphinx, runtime type checkers, IDEs)
# resolves their annotations (``Slice.pool``, ``live_pools()``) at run time. attrs evaluates
# ``Slice.__init__``'s in a copy of the slices module's namespace made when the class was
# defined: that copy gets the name too.
for _namespace in (vars(slices), vars(_slice_index), vars(_state),
                   getattr(Slice.__init__, "__globals__")):
    _namespace["FlatPool"] = FlatPool

__all__ = [
    "DEFAULT_ALIGNMENT", "MAX_BYTES", "FlatPool", "ShapeLike", "check_dtype", "check_shape",
    "contiguous_strides", "empty_storage_tensor", "live_pools",
]
