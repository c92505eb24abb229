"""The one place flatpool moves bytes and tensor objects: the copy into slices, and the move.

Every operation, and rollback, copies bytes with :func:`copy_all` and moves tensor objects with
:func:`move` (rollback: :func:`set_many`, :func:`swap_many`). A move is journaled before it
happens (write-ahead), so a rollback is right wherever an interrupt lands. A member keeps its
identity whichever way it moves (:class:`Move`): ``IN_PLACE`` ``set_``s its impl (C++ holders
follow); ``OFF_BASE`` swaps in a base-less impl (``set_`` would keep the ``_base``, pinning the
original); ``ONTO_LOCAL`` gives a storage-less wrapper its local tensor's place; ``NEW_IMPL``
swaps in the impl ``materialize_into`` made. Terms: [Note: flatpool terms].
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
``copy_`` below its grain size serially, taking first-touch page faults one at a time."""

THREADED_BYTES = 4 << 20
"""Small copies are threaded only when they add up to this many bytes (threads cost too)."""

Chunk = tuple[list[torch.Tensor], list[torch.Tensor]]


def byte_view(storage: torch.UntypedStorage, start: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` bytes of ``storage`` from ``start`` as a new base-less uint8 tensor."""
    with tc.outside_inference():
        result = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
            storage, start, (nbytes,), (1,))
        return result  # not `return f()`: see flatpool._interrupts


class _Crew:
    """Worker threads copying chunks. A worker counts itself running (under the lock) before
    it copies unless cancelled, so after :meth:`cancel` returns none copies, even one whose
    ``Thread.start()`` was interrupted."""

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
    """``dst[i].copy_(src[i])`` for all ``i``; on CPU the small copies split over Python
    threads, taking their page faults in parallel. Whatever lands in the calling thread, no
    worker writes into ``dst`` once this returns or raises."""
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
    """:meth:`_Crew.cancel` to the end, even if asynchronous exceptions land while it waits."""
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

    ``key`` is ``None`` for no place on a real storage; ``version`` -1 leaves the counter
    alone. For impl swaps ``fresh`` is the other tensor (the old impl after the swap, held until
    :meth:`let_go`) and ``impl`` the address before (unchanged: the swap never happened).
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
    """``obj``'s record, read before anything of its batch moved (a move bumps shared counters)."""
    with tc.no_torch_function():
        meta = tc.impl_is_meta(obj)
        result = Member(obj, how, key, tc.impl_storage_offset(obj), tuple(tc.impl_size(obj)),
                        tuple(tc.impl_stride(obj)), tc.impl_dtype(obj),
                        -1 if meta else tc.impl_version(obj), holder, primary)
        return result  # not `return f()`: see flatpool._interrupts


def move(journal: list[Record], members: Sequence[Member], dests: Sequence[Dest]) -> None:
    """Journal ``members``, then move each onto its destination (:data:`Dest`). Tensors that
    shared a version counter still share one, and every counter is put back to its record's
    value: a pending backward must not fail as "modified in place"."""
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
    """``set_`` every tensor object onto its place (identity and impl kept)."""
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


def fresh_on(storage: torch.UntypedStorage, offset: int, size: Sequence[int], stride: Sequence[int],
             dtype: torch.dtype, requires_grad: bool = False) -> torch.Tensor:
    """A new base-less tensor on ``storage`` at ``(offset, size, stride)`` in elements."""
    with tc.outside_inference():
        out = torch.empty(0, dtype=dtype, device=storage.device)
        out.set_(storage, offset, tuple(size), tuple(stride))  # (it requires no grad yet)
        if requires_grad:
            out.requires_grad_(True)
    return out


def fresh_like(obj: torch.Tensor, storage: torch.UntypedStorage, offset: int, size: Sequence[int],
               stride: Sequence[int], dtype: torch.dtype, requires_grad: bool = False,
               counter_of: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`fresh_on`, carrying ``obj``'s lazy conj/neg bits and sharing ``counter_of``'s
    version counter, so autograd still sees an in-place write through either one."""
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
    """Which version counter ``t`` uses: a view shares its base's (named by the base's impl
    address). Call under ``no_torch_function()``."""
    base = tc.impl_base(t)
    return tc.impl_address(t if base is None else base)
