"""What a pool adopted: for each slice, the tensor objects bound to it and where to find them.

Bindings keep only weak references (to tensors, and to holders' owners where the owner allows
it), so a pool never keeps a model alive. They are what validity checks, re-adoption and
relocation walk. A batch adoption binds thousands of tensors, so a binding is stored as a plain
tuple (:data:`Record`) and turned into a :class:`Binding` only when someone asks for one.

A *parameter* is never given a weak reference of any kind: ``torch.utils.swap_tensors``
refuses a tensor that has a Python weak reference or a C++ weak reference to its TensorImpl, and
``nn.Module._apply`` (``.to``, ``.cpu()``, ``.double()``, ``to_empty``) swaps DTensor
parameters (every parameter under ``torch.__future__.set_swap_module_params_on_conversion(True)``).
A :class:`ParamRef` holds the parameter strongly instead and reads as dead (and lets go) once it
is the parameter's only holder: a Python reference count, no allocation. A parameter dropped by
its model is let go at the pool's next look at that binding (``holds``, ``readopt``,
relocation) or with the pool.
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Iterable, Iterator, Sequence
from operator import attrgetter
from typing import Any, Callable, Union

import torch
from attrs import define
from torch import nn

from . import torch_compat as tc
from .holder import Holder

Ref = Callable[[], Any]
Record = tuple[Ref, int, tuple[int, ...], tuple[int, ...], torch.dtype, Union[Ref, None], Any, bool, bool]
"""``(tensor ref, byte offset in the slice, shape, stride, dtype, holder-owner ref or None,
holder key, holder is an item, primary)``."""


class ParamRef:
    """A reference to a parameter that ``torch.utils.swap_tensors`` does not refuse.

    Strong, but it answers ``None`` (and drops the parameter) when nothing else holds it: no
    Python reference beside its own, and none torch keeps for a C++ owner of the impl.
    """

    __slots__ = ("_obj",)

    def __init__(self, t: torch.Tensor) -> None:
        self._obj: torch.Tensor | None = t

    def __call__(self) -> torch.Tensor | None:
        obj = self._obj
        if obj is None:
            return None
        # Ours: the slot and the local above; torch's own while C++ shares the impl.
        ours = 2 + (tc.PRESERVED_TENSOR_REF if tc.tensor_impl_users(obj) > 1 else 0)
        if tc.python_refs(obj) <= ours:
            self._obj = None
            return None
        return obj


class TensorRef(ParamRef):
    """:class:`ParamRef` for a plain tensor (not a parameter): the same rule and layout; only
    a dropped *parameter* makes its slice orphaned (:func:`flatpool.ownership.readopt.orphaned`),
    so the two are told apart by class."""

    __slots__ = ()


def tensor_ref(t: torch.Tensor) -> Ref:
    """How a record refers to ``t``: a Python weak reference, a :class:`ParamRef` for a
    parameter (which ``nn.Module._apply`` may have to swap)."""
    cls = type(t)  # (the exact classes first: Parameter's isinstance check runs Python code;
    # a subclass made a parameter, a DTensor's, says so by its ``_is_param`` flag, which is
    # what that check reads first)
    if cls is nn.Parameter or (cls is not torch.Tensor and (
            getattr(t, "_is_param", False) is True or isinstance(t, nn.Parameter))):
        return ParamRef(t)
    return weakref.ref(t)


def plain_ref(t: torch.Tensor) -> ParamRef:
    """How a lean batch's record refers to an exact ``torch.Tensor`` or ``nn.Parameter``: a
    :class:`ParamRef`, or a :class:`TensorRef` for a tensor (40 B, not a weak reference's 80;
    and ``swap_tensors`` works on the tensor afterwards)."""
    return ParamRef(t) if type(t) is nn.Parameter else TensorRef(t)


def _ref(obj: Any) -> Ref:
    if isinstance(obj, torch.Tensor):
        return tensor_ref(obj)
    try:
        return weakref.ref(obj)
    except TypeError:  # dicts, lists: keep strongly, they are what the caller named
        return lambda: obj


def make_record(
    tensor: torch.Tensor, byte_offset: int, shape: tuple[int, ...], stride: tuple[int, ...],
    dtype: torch.dtype, holder: Holder | None, primary: bool,
) -> Record:
    if holder is None:
        return (tensor_ref(tensor), byte_offset, shape, stride, dtype, None, None, False, primary)
    return (tensor_ref(tensor), byte_offset, shape, stride, dtype, _ref(holder.owner),
            holder.key, holder.item, primary)


def record_holder(rec: Record) -> Holder | None:
    owner_ref = rec[5]
    if owner_ref is None:
        return None
    owner = owner_ref()
    return None if owner is None else Holder(owner, rec[6], rec[7])


def current(rec: Record) -> torch.Tensor | None:
    """The object bound by ``rec`` now: what its holder holds, else the weakly held tensor.

    A holder lets re-adoption find a *replacement* object a framework installed there.
    """
    if rec[5] is not None:
        holder = record_holder(rec)
        if holder is None:
            return None
        try:
            value = holder.get()
        except (AttributeError, KeyError, IndexError, TypeError):
            return None
        return value if isinstance(value, torch.Tensor) else None
    tensor: torch.Tensor | None = rec[0]()
    return tensor


@define(frozen=True)
class Geometry:
    """A tensor's placement relative to the start of its slice."""

    byte_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@define(frozen=True, eq=False)
class Binding:
    """One tensor object bound to a slice, and how to find it again (a view of a record)."""

    record: Record

    @property
    def geometry(self) -> Geometry:
        r = self.record
        return Geometry(r[1], r[2], r[3], r[4])

    @property
    def primary(self) -> bool:
        return self.record[8]

    def holder(self) -> Holder | None:
        return record_holder(self.record)

    def current(self) -> torch.Tensor | None:
        return current(self.record)


RUN_MIN = 64
"""Batches smaller than this are bound as plain records (a run saves nothing there)."""


class _Run:
    """The bindings of a lean batch (one tensor per slice, ids ``first ..``), as columns: a
    record is built only when someone asks for it, then kept (readers may key on its id).

    The column holds the tensors themselves (8 B a tensor). Making a record moves its tensor
    into a :class:`ParamRef`, which from then on is its only holder here, so the rule "held by
    nothing but the pool reads as dead" counts exactly as for any other record; a tensor in the
    column is never read for liveness (every reader goes through a record)."""

    __slots__ = ("first", "objs", "sizes", "strides", "dtypes", "made")

    def __init__(
        self, first: int, objs: list[torch.Tensor | None], sizes: list[tuple[int, ...]],
        strides: list[tuple[int, ...]], dtypes: list[torch.dtype],
    ) -> None:
        self.first, self.objs, self.sizes, self.strides, self.dtypes = (
            first, objs, sizes, strides, dtypes)
        self.made: list[Record | None] | None = None

    def __len__(self) -> int:
        return len(self.objs)

    def __contains__(self, slice_id: int) -> bool:
        return 0 <= slice_id - self.first < len(self.objs)

    def record(self, slice_id: int) -> Record:
        i = slice_id - self.first
        made = self.made
        if made is None:
            made = self.made = [None] * len(self.objs)
        rec = made[i]
        if rec is None:
            obj = self.objs[i]
            ref: Ref = _dead if obj is None else plain_ref(obj)
            rec = made[i] = (ref, 0, self.sizes[i], self.strides[i], self.dtypes[i],
                             None, None, False, True)
            del obj
            self.objs[i] = None  # (an interrupt before this line only keeps one alive longer)
        return rec


def _dead() -> None:
    """The reference of a record whose tensor was let go before the record was made."""
    return None


_first_id = attrgetter("first")


def _call(ref: weakref.ref[RegistrySnapshot]) -> RegistrySnapshot | None:
    return ref()


class RegistrySnapshot(dict[int, list[Record]]):
    """What :meth:`AdoptionRegistry.snapshot` remembers: the plain records, and the batches'
    columns (shared: a batch is never changed in place) with the ids taken out of them."""

    runs: list[_Run]
    dead: set[int]


class AdoptionRegistry:
    """Per-pool map: slice id -> records. Guarded by the pool's lock.

    A lean batch is bound as one :class:`_Run` (:meth:`bind_run`): its slices' records exist
    only as columns until asked for. ``_dead`` holds the ids taken out of a run since (unbound,
    or bound anew: those records then live in the plain map)."""

    def __init__(self) -> None:
        self._records: dict[int, list[Record]] = {}
        self._runs: list[_Run] = []
        self._dead: set[int] = set()
        self._snaps: list[weakref.ref[RegistrySnapshot]] = []
        """Snapshots that may still be restored: a run they share is copied before an entry of
        it is cleared (copy on write), so a restore finds the run as it was."""
        self.version = 0
        """Bumped *before* every change (an interrupt in between costs a recheck, never a
        stale answer)."""

    def _run_of(self, slice_id: int) -> _Run | None:
        if not isinstance(slice_id, int) or slice_id in self._dead:
            return None  # (a key no slice id equals finds nothing, as in the plain map)
        runs = self._runs  # in id order (each run's ids past every earlier one's)
        i = bisect.bisect_right(runs, slice_id, key=_first_id) - 1
        return runs[i] if i >= 0 and slice_id in runs[i] else None

    def _get(self, slice_id: int) -> list[Record] | tuple[Record, ...]:
        recs = self._records.get(slice_id)
        if recs is not None:
            return recs
        run = self._run_of(slice_id) if self._runs else None
        return () if run is None else (run.record(slice_id),)

    def holds(self, slice_id: int) -> bool:
        return any(current(r) is not None for r in self._get(slice_id))

    def holds_any(self, slice_ids: Iterable[int]) -> bool:
        """:meth:`holds` of any of ``slice_ids``: nothing to look at in an empty registry (a
        planned pool's, which a fusion's slices come from)."""
        if not self._records and not self._runs:
            return False
        return any(map(self.holds, slice_ids))

    def records(self, slice_id: int) -> tuple[Record, ...]:
        return tuple(self._get(slice_id))

    def bindings(self, slice_id: int) -> tuple[Binding, ...]:
        return tuple(Binding(r) for r in self._get(slice_id))

    def bind(self, slice_id: int, records: list[Record]) -> None:
        self.version += 1
        self._records[slice_id] = records
        run = self._run_of(slice_id) if self._runs else None
        if run is not None:
            self._dead.add(slice_id)
            self._let_go(run, slice_id)

    def _let_go(self, run: _Run, slice_id: int) -> None:
        """The run stops holding the tensor of ``slice_id`` (taken out of it): a strong hold
        left in its cache would pin the tensor (and, through it, a storage a relocation must
        prove dead) and make the rule of the record that replaced it count one holder too
        many. A run a snapshot shares is copied first, so a rollback finds it unchanged."""
        if any(snap is not None and any(r is run for r in snap.runs)
               for snap in map(_call, self._snaps)):
            copy = _Run(run.first, list(run.objs), run.sizes, run.strides, run.dtypes)
            copy.made = None if run.made is None else list(run.made)
            self._runs = [copy if r is run else r for r in self._runs]  # one assignment
            run = copy
        i = slice_id - run.first
        run.objs[i] = None
        if run.made is not None:
            run.made[i] = None

    def bind_many(self, pairs: Iterable[tuple[int, list[Record]]]) -> None:
        self.version += 1
        if not self._runs:
            self._records.update(pairs)
            return
        for slice_id, records in pairs:
            self.bind(slice_id, records)

    def bind_run(
        self, slice_ids: Sequence[int], tensors: list[torch.Tensor],
        sizes: list[tuple[int, ...]], strides: list[tuple[int, ...]], dtypes: list[torch.dtype],
    ) -> None:
        """Bind one exact tensor or parameter (``tensors[i]``, primary, at byte 0) to each of
        ``slice_ids``: fresh ids of consecutive numbers (a lean batch's) as one column, else
        plain records (with :func:`plain_ref`)."""
        if not slice_ids:
            return
        first = slice_ids[0]
        last = self._runs[-1] if self._runs else None
        if (len(slice_ids) < RUN_MIN or (last is not None and first < last.first + len(last))
                or (not (isinstance(slice_ids, range) and slice_ids.step == 1)
                    and any(i - 1 != j for i, j in zip(slice_ids[1:], slice_ids)))):
            self.bind_many(
                (i, [(plain_ref(t), 0, sz, st, dt, None, None, False, True)])
                for i, t, sz, st, dt in zip(slice_ids, tensors, sizes, strides, dtypes))
            return
        run = _Run(first, list(tensors), sizes, strides, dtypes)
        self.version += 1
        self._runs = [*self._runs, run]  # one assignment: all or nothing

    def unbind(self, slice_id: int) -> list[Record]:
        self.version += 1
        recs = self._records.pop(slice_id, None)
        run = self._run_of(slice_id) if self._runs else None
        if run is not None:  # (_run_of finds no id taken out already)
            rec = run.record(slice_id)
            self._dead.add(slice_id)
            self._let_go(run, slice_id)
            if recs is None:
                return [rec]
        return [] if recs is None else recs

    def items(self) -> Iterator[tuple[int, list[Record]]]:
        out = list(self._records.items())
        dead = self._dead
        for run in self._runs:
            out += [(i, [run.record(i)]) for i in range(run.first, run.first + len(run))
                    if i not in dead]
        return iter(out)

    def __len__(self) -> int:
        return len(self._records) + sum(len(r) for r in self._runs) - len(self._dead)

    def snapshot(self) -> RegistrySnapshot:
        snap = RegistrySnapshot(self._records)  # lists are replaced, never mutated in place
        snap.runs, snap.dead = list(self._runs), set(self._dead)
        # (weakly, by identity: a snapshot compares as a dict; the dead ones are dropped here)
        self._snaps = [*(r for r in self._snaps if r() is not None), weakref.ref(snap)]
        return snap

    def restore(self, snap: dict[int, list[Record]]) -> None:
        """Put back a :meth:`snapshot` (or install a plain map of records: relocation)."""
        self.version += 1
        runs: list[_Run] = getattr(snap, "runs", [])
        dead: set[int] = getattr(snap, "dead", set())
        self._records, self._runs, self._dead = dict(snap), list(runs), set(dead)


__all__ = ["AdoptionRegistry", "Binding", "RegistrySnapshot", "Geometry", "ParamRef", "Record", "TensorRef", "current",
           "make_record", "plain_ref", "record_holder", "tensor_ref"]
