"""The one place flatpool moves bytes and tensor objects: the copy into slices, and the move.

Every operation (adopt, readopt, grow/compact, materialize, and rollback) copies bytes with
:func:`copy_all` and moves tensor objects with :func:`move` (rollback with :func:`set_many` and
:func:`swap_many`, the same primitives). A move is journaled before it happens (write-ahead):
:func:`move` appends each :class:`Member` record to the transaction's journal and only then
moves it, so a rollback (:mod:`flatpool.ownership._transaction`) is right wherever an
interrupt lands. See [Note: flatpool terms] in :mod:`flatpool.ownership`.

A member keeps its identity whichever way it moves (:class:`Move`):

* ``IN_PLACE``: ``set_`` its TensorImpl onto the slice. Autograd graphs and other C++ holders of
  the impl follow it.
* ``OFF_BASE``: an autograd view whose base stays behind (``set_`` would keep the ``_base``,
  which pins the original): a fresh base-less impl on the slice is swapped in.
* ``ONTO_LOCAL``: a storage-less (meta) wrapper whose local tensor moves: an impl of its own
  class on the local tensor's place is swapped in.
* ``NEW_IMPL``: a meta tensor (``materialize_into``): the impl its caller made is swapped in.
"""

from __future__ import annotations

import enum
import threading
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import starmap
from typing import Any, Union

import torch

from .. import _torch_compat as tc
from ..errors import AdoptionError
from .._holder import Holder
from ._faults import checkpoint


# -- copying bytes ---------------------------------------------------------------------------
COPY_CHUNK = 1024
"""Originals copied per :func:`copy_all` call of a batch (bounds the byte views alive at once)."""

SMALL_COPY = 32768
"""Byte copies below this are spread over Python threads by :func:`copy_all`: torch runs a
``copy_`` below its grain size (32768 elements; these are uint8 views) serially, so thousands
of them take their first-touch page faults one at a time; larger copies already run in
parallel inside torch (docs/performance.md has the measurements)."""

THREADED_BYTES = 4 << 20
"""Small copies are threaded only when they add up to this many bytes: below it, starting and
joining the threads costs more than the page faults they would overlap."""

Chunk = tuple[list[torch.Tensor], list[torch.Tensor]]


def byte_view(storage: torch.UntypedStorage, start: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` bytes of ``storage`` from ``start`` as a new base-less uint8 tensor."""
    with tc.outside_inference():
        result = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
            storage, start, (nbytes,), (1,)
        )
        return result  # not `return f()`: see flatpool.ownership._interrupts


class _Crew:
    """Worker threads copying chunks, accountable to the calling thread.

    A worker counts itself running (under the lock) before it copies, unless the crew was
    cancelled: after :meth:`cancel` no copy starts, and :meth:`cancel` returns once none runs.
    Whether an interrupted ``Thread.start()`` started its thread does not matter: such a
    thread either counted itself before the cancel (and is waited for) or copies nothing.
    """

    def __init__(self, chunks: list[Chunk]) -> None:
        self.cond = threading.Condition()
        self.running = 0
        self.unfinished = len(chunks)
        self.cancelled = False
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._work, args=c, daemon=True) for c in chunks]

    def _work(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        with self.cond:
            if self.cancelled:
                self.unfinished -= 1
                self.cond.notify_all()
                return
            self.running += 1
        try:
            with torch.no_grad():  # grad mode is per thread
                tc.foreach_copy(dst, src)
        except BaseException as exc:  # re-raised in the calling thread
            self.errors.append(exc)
        finally:
            with self.cond:
                self.running -= 1
                self.unfinished -= 1
                self.cond.notify_all()

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def wait_done(self) -> None:
        """Every chunk copied (the normal end)."""
        with self.cond:
            while self.unfinished:
                self.cond.wait()

    def cancel(self) -> None:
        """No chunk starts any more; return once no worker copies. Safe to repeat."""
        with self.cond:
            self.cancelled = True
            while self.running:
                self.cond.wait()


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all ``i``: one ``_foreach_copy_``, and on CPU the small
    copies split over ``torch.get_num_threads()`` Python threads (the op releases the GIL).

    Thousands of small copies into a fresh pool are bound by first-touch page faults taken one
    at a time; threads take them in parallel, as a single large ``copy_`` does. Whatever lands
    in the calling thread (an interrupt at any bytecode), no worker writes into ``dst`` once
    this returns or raises.
    """
    workers = torch.get_num_threads() if dst and dst[0].device.type == "cpu" else 1
    small = [i for i, d in enumerate(dst) if d.nbytes < SMALL_COPY] if workers > 1 else []
    if len(small) < 4 * workers or sum(dst[i].nbytes for i in small) < THREADED_BYTES:
        with torch.no_grad():
            tc.foreach_copy(dst, src)
        return
    large = sorted(set(range(len(dst))) - set(small))
    mine: Chunk = ([dst[i] for i in large], [src[i] for i in large])
    chunks: list[Chunk] = []
    per = -(-len(small) // workers)
    for k in range(0, len(small), per):
        part = small[k : k + per]
        chunks.append(([dst[i] for i in part], [src[i] for i in part]))
    if not large:
        mine = chunks.pop(0)
    crew = _Crew(chunks)
    try:
        crew.start()
        with torch.no_grad():
            tc.foreach_copy(*mine)
        crew.wait_done()
    except BaseException:
        _cancel(crew)
        raise
    if crew.errors:
        raise crew.errors[0]


def _cancel(crew: _Crew) -> None:
    """:meth:`_Crew.cancel` to the end, even if exceptions land while it waits (signals are
    deferred while a flatpool operation unwinds; other asynchronous exceptions only retry)."""
    while True:
        try:
            crew.cancel()
            return
        except BaseException:  # noqa: B902 - the workers must stop before anything is freed
            continue


# -- moving tensor objects -------------------------------------------------------------------
class Move(enum.Enum):
    """How a member moves onto the pool (see the module)."""

    IN_PLACE = "set_ in place"
    OFF_BASE = "a fresh base-less impl swapped in"
    ONTO_LOCAL = "a wrapper impl on its local tensor's place swapped in"
    NEW_IMPL = "the impl made for it swapped in"


class Member:
    """A member to move, and its journal record: where it sat, so any rollback puts it back.

    ``obj`` sat on original ``key`` at element ``offset`` with ``size``, ``stride`` (``dtype``'s
    elements) and version counter ``version`` (-1: leave the counter alone); ``key`` is
    ``None`` when it had no place on a real storage (a meta tensor or wrapper). For the impl
    swaps, ``fresh`` is the other tensor of the swap: the new impl before it, the old impl
    after (held strongly until :meth:`let_go`), and ``impl`` the address of ``obj``'s impl
    before it (unchanged means the swap never happened). ``holder`` and ``primary`` are what
    the registry's binding will say.
    """

    __slots__ = ("obj", "how", "key", "offset", "size", "stride", "dtype", "version", "holder",
                 "primary", "fresh", "fresh_ref", "impl")

    def __init__(self, obj: torch.Tensor, how: Move, key: int | None, offset: int,
                 size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype,
                 version: int, holder: Holder | None = None, primary: bool = False,
                 fresh: torch.Tensor | None = None) -> None:
        self.obj, self.how, self.key = obj, how, key
        self.offset, self.size, self.stride, self.dtype = offset, size, stride, dtype
        self.version, self.holder, self.primary = version, holder, primary
        self.fresh = fresh
        self.fresh_ref: weakref.ref[torch.Tensor] | None = None
        self.impl = 0 if how is Move.IN_PLACE else tc.impl_address(obj)

    @property
    def byte_offset(self) -> int:
        """Where ``obj`` starts on its original, in bytes."""
        return self.offset * self.dtype.itemsize

    def old_impl(self) -> torch.Tensor | None:
        """The object that carries ``obj``'s old impl after the swap (``None`` once it died)."""
        if self.fresh is not None:
            return self.fresh
        return None if self.fresh_ref is None else self.fresh_ref()

    def let_go(self) -> None:
        """Drop the strong reference to the old impl (so the original can die), keep a weak one."""
        if self.fresh is not None:
            self.fresh_ref = weakref.ref(self.fresh)
            self.fresh = None


class SlotSet:
    """``setattr(obj, name, ...)`` replaced ``old`` (a DTensor's ``_local_tensor``, say)."""

    __slots__ = ("obj", "name", "old")

    def __init__(self, obj: Any, name: str, old: Any) -> None:
        self.obj, self.name, self.old = obj, name, old


Record = Union[Member, SlotSet]
"""What a transaction's journal holds."""
Place = tuple[torch.Tensor, torch.UntypedStorage, int, Sequence[int], Sequence[int]]
"""``(tensor object, storage, element offset, size, stride)``."""
Dest = tuple[torch.UntypedStorage, int, tuple[int, ...], tuple[int, ...]]
"""Where a member goes: ``(storage, element offset, size, stride)``."""


def member_of(obj: torch.Tensor, how: Move, key: int | None, holder: Holder | None = None,
              primary: bool = False) -> Member:
    """``obj``'s record, read from its TensorImpl now (before anything of its batch moved: a
    view shares its base's version counter, which a move bumps)."""
    with tc.no_torch_function():
        meta = tc.impl_is_meta(obj)
        result = Member(obj, how, key, tc.impl_storage_offset(obj), tuple(tc.impl_size(obj)),
                        tuple(tc.impl_stride(obj)), tc.impl_dtype(obj),
                        -1 if meta else tc.impl_version(obj), holder, primary)
        return result  # not `return f()`: see flatpool.ownership._interrupts


def move(journal: list[Record], members: Sequence[Member], dests: Sequence[Dest]) -> None:
    """Journal ``members``, then move each onto its destination (:data:`Dest`).

    Tensors that shared a version counter (views of one base, and the base) still share one:
    ``set_`` keeps an impl's counter, and a swapped view's new impl takes the counter of the
    first member of its group. Every counter is then put back to what its record read: the
    values did not change, and a pending backward must not fail as "modified in place".
    """
    counters: dict[int, torch.Tensor] = {}
    swapped = [(m, dest) for m, dest in zip(members, dests) if m.how is not Move.IN_PLACE]
    with tc.no_torch_function():
        if any(m.how is Move.OFF_BASE for m, _ in swapped):  # (only they need the counters)
            for m in members:
                if m.how is Move.IN_PLACE:
                    counters.setdefault(counter_group(m.obj), m.obj)
        for m, (storage, offset, size, stride) in swapped:
            if m.how is Move.OFF_BASE:
                group = counter_group(m.obj)
                m.fresh = fresh_like(m.obj, storage, offset, size, stride, m.dtype,
                                     _leaf_with_grad(m.obj), counters.get(group))
                counters.setdefault(group, m.fresh)
            elif m.how is Move.ONTO_LOCAL:  # keep the wrapper class's dispatch keys
                m.fresh = tc.subclass_alias(type(m.obj), fresh_like(
                    m.obj, storage, offset, size, stride, m.dtype), _leaf_with_grad(m.obj))
                tc.copy_tensor_flags(m.obj, m.fresh)
    del counters, swapped  # they hold swapped-in impls, which carry the old ones after the swap
    checkpoint("rebind")
    journal.extend(members)  # write-ahead: each record exists before its move
    set_many([(m.obj, *dest) for m, dest in zip(members, dests) if m.how is Move.IN_PLACE])
    swap_many([(m.obj, m.fresh) for m in members
               if m.how is not Move.IN_PLACE and m.fresh is not None])
    counted = [m for m in members if m.version >= 0]
    tc.set_versions([m.obj for m in counted], [m.version for m in counted])


def _leaf_with_grad(t: torch.Tensor) -> bool:
    return tc.impl_requires_grad(t) and tc.impl_is_leaf(t)


def set_many(places: Iterable[Place]) -> None:
    """``set_`` every tensor object onto its place, in place (identity and impl kept): the only
    ``set_`` loop of flatpool's moves (a move, and its rollback)."""
    with tc.no_torch_function(), tc.outside_inference(), torch.no_grad():
        deque(starmap(tc.impl_set_, places), maxlen=0)  # (one C-level pass)


def swap_many(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Exchange the TensorImpls of each pair (see :func:`flatpool._torch_compat.swap_impl`);
    a leaf's ``.grad`` and hooks go with the object (they lived on its old impl)."""
    for a, b in pairs:
        try:
            tc.swap_impl(a, b)
        except RuntimeError as exc:  # (torch refuses some impl pairs: say which object)
            raise AdoptionError(
                f"cannot swap a new TensorImpl into a {type(a).__name__} in place: {exc}"
            ) from exc
        tc.carry_leaf_state(a, b)


def fresh_on(
    storage: torch.UntypedStorage, offset: int, size: Sequence[int], stride: Sequence[int],
    dtype: torch.dtype, requires_grad: bool = False,
) -> torch.Tensor:
    """A new base-less tensor on ``storage`` at ``(offset, size, stride)`` in elements."""
    with tc.outside_inference():
        out = torch.empty(0, dtype=dtype, device=storage.device)
        out.set_(storage, offset, tuple(size), tuple(stride))  # (it requires no grad yet)
        if requires_grad:
            out.requires_grad_(True)
    return out


def fresh_like(
    obj: torch.Tensor, storage: torch.UntypedStorage, offset: int, size: Sequence[int],
    stride: Sequence[int], dtype: torch.dtype, requires_grad: bool = False,
    counter_of: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`fresh_on`, carrying ``obj``'s lazy conj/neg bits: a new impl that is to read as
    ``obj`` reads over the same bytes (a conj view's storage holds the unconjugated values).

    ``counter_of``: a tensor whose version counter the new impl shares (an alias of ``obj``
    before the move), so that autograd still sees an in-place write through either one."""
    if counter_of is None or tc.impl_dtype(counter_of) != dtype:
        out = fresh_on(storage, offset, size, stride, dtype, requires_grad)
    else:
        with tc.outside_inference():
            out = tc.counter_alias(counter_of)
            with torch.no_grad():
                tc.impl_set_(out, storage, offset, tuple(size), tuple(stride))
            if requires_grad:
                out.requires_grad_(True)
    tc.copy_tensor_flags(obj, out)
    return out


def counter_group(t: torch.Tensor) -> int:
    """Which version counter ``t`` uses, as far as autograd links tell: an autograd view shares
    its base's (the impl address of the base names the group), anything else has its own.
    Call under ``no_torch_function()``."""
    base = tc.impl_base(t)
    return tc.impl_address(t if base is None else base)


__all__ = [
    "COPY_CHUNK", "Dest", "Member", "Move", "Place", "Record", "SlotSet", "byte_view", "copy_all",
    "counter_group", "fresh_like", "fresh_on", "member_of", "move", "set_many", "swap_many",
]
