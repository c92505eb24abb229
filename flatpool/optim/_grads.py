"""Pooled gradients with torch's ``.grad`` semantics and torch's memory.

Each ``.grad`` is a view of ``<pool>/grad`` installed zeroed when a backward starts, so autograd
and FSDP2 (which add in place) write straight into the pool. Views nothing wrote to (their own
version counter unchanged) go back to ``None`` (:meth:`Grads.settle`), as torch skips ``None``;
frozen parameters get none; the pool dies with ``zero_grad(set_to_none=True)``. A gradient
installed elsewhere (the user's buffer, autograd's own) is copied in at every step
(:meth:`Grads.absorb`) and stays the ``.grad``: only views flatpool installed are flatpool's.

FSDP2's reduce-scatter can write a group's gradients straight into its pool instead
(:meth:`Grads.hand_out`, through :meth:`FlatOptimizer.collective_output` from the integration's
``ReduceScatter.allocate``): FSDP2 then makes every ``.grad`` as a view of the pool itself, and
:meth:`Grads.pooled` recognizes those new objects by one address comparison per group.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterable, Sequence
from itertools import compress, repeat
from typing import Any

import torch
from attrs import define

from .. import _torch_compat as tc
from .._aliasing import local_tensor
from ..pool import FlatPool
from ._torch import local_of
from ._companions import new_pool, views
from ._layout import Member, Segment, multi_dim
from ._wrap import wrap_like

_grad_of = operator.attrgetter("grad")
_version_of = operator.attrgetter("_version")
_requires_grad_of = operator.attrgetter("requires_grad")
_is_none = functools.partial(operator.is_, None)
_data_ptr = torch.Tensor.data_ptr
_contiguous = torch.Tensor.is_contiguous
_shape_of = operator.attrgetter("shape")
_dtype_of = operator.attrgetter("dtype")
_device_of = operator.attrgetter("device")
_layout_of = operator.attrgetter("layout")
_not_none = functools.partial(operator.is_not, None)


@define(frozen=True)
class Checked:
    """Foreign gradients found copyable at a step: the members, the gradients' types, and
    what :func:`unpoolable` requires of each local tensor (strided; the member's shape, dtype
    and device). No gradient is held: they die as with torch."""

    at: list[int]
    types: list[type]
    plain: bool
    """Every gradient is its own local tensor (no wrapper)."""
    shapes: list[torch.Size]
    dtypes: list[torch.dtype]
    devices: list[torch.device]


@define(frozen=True)
class Run:
    """Members of one pool that a collective writes as one flat tensor from byte 0: their
    indices, parameters, byte offsets and shapes, and whether every one is a wrapper (DTensor)."""

    idx: list[int]
    params: list[torch.Tensor]
    offsets: list[int]
    shapes: list[torch.Size]
    wrapped: bool


def run_of(grads: Grads, idx: Sequence[int]) -> Run:
    """The :class:`Run` of members ``idx`` (made once per plan: per-member work)."""
    ms = [grads.members[i] for i in idx]
    return Run(list(idx), [m.param for m in ms], [m.offset for m in ms], [m.shape for m in ms],
               all(grads.wrapped[i] for i in idx))


class Grads:
    """The gradient views of ``members`` (every member of every group, in plan order)."""

    def __init__(self, members: Sequence[Member]) -> None:
        self.members = list(members)
        self.params = [m.param for m in self.members]
        self.wrapped = [local_tensor(p) is not p for p in self.params]
        self.any_wrapped = any(self.wrapped)
        self.multi = multi_dim(self.members)
        """Members whose views' contiguity is checked (:func:`~._layout.multi_dim`)."""
        self._is_multi = [len(m.shape) > 1 for m in self.members]
        self._pools: dict[int, FlatPool] = {}
        """The current gradient pool of each parameter pool (absent: released)."""
        self._flat: dict[int, torch.Tensor] = {}
        """Each segment's gradient range in the current gradient pools (dropped with them)."""
        n = len(self.members)
        self.locals: list[torch.Tensor | None] = [None] * n
        self.objs: list[torch.Tensor | None] = [None] * n
        """Per member: its view's local tensor and the object installed as ``.grad``."""
        self.addrs: list[int | None] = [None] * n
        self.sparse: set[int] = set()
        """Members that get sparse gradients (an ``Embedding(sparse=True)``, or seen once)."""
        self.served: set[int] = set()
        """Members whose ``.grad`` another component makes (DDP's bucket views, FSDP2's
        reduce-scatter into the pool): never pre-installed."""
        self._all_placed = False
        """Every member has a view (no ``None`` in :attr:`objs`)."""
        self.unwritten: tuple[list[int], list[int]] = ([], [])
        """Unwritten pre-installed views: indices, versions (replaced whole: interrupt-safe)."""
        self._handed: dict[int, tuple[Run, list[int]]] = {}
        """Gradient pools handed out as a reduce-scatter output whose ``.grad``s are not yet
        recognized, per parameter pool: the run and its members' addresses."""
        self._checked: dict[int, Checked] = {}
        """Per group (its first member): the foreign gradients checked at the last step."""
        self._copy: tuple[list[int], list[torch.Tensor], list[int], torch.Tensor | None] | None = None
        """The last copy-in's members, their places (local views), those views' addresses, and
        the one flat range they fill when they are adjacent 1-D places."""

    # -- the gradient pools ------------------------------------------------------------------
    def buffer(self, pool: FlatPool) -> FlatPool | None:
        """The current gradient pool of ``pool`` (``None`` while released)."""
        return self._pools.get(id(pool))

    def pools(self) -> list[FlatPool]:
        return list(self._pools.values())

    def _pool(self, pool: FlatPool, zeroed: bool = True) -> tuple[FlatPool, bool]:
        """The gradient pool of ``pool``, and whether it was made just now (all zeros unless
        ``zeroed`` is false: a collective writes it whole)."""
        have = self._pools.get(id(pool))
        if have is not None:
            return have, False
        made = new_pool(f"{pool.name}/grad", pool.capacity, pool.device, zeroed=zeroed)
        self._pools[id(pool)] = made
        return made, True

    def range(self, seg: Segment, start: int, n: int) -> torch.Tensor:
        """``n`` elements of a segment's gradients from byte ``start`` (members there pooled)."""
        key = id(seg)
        flat = self._flat.get(key)
        if flat is None:
            flat = self._flat[key] = self._pools[id(seg.pool)].view_at(
                seg.start, (seg.numel,), seg.dtype)
        a = (start - seg.start) // seg.dtype.itemsize
        return flat if n == seg.numel else flat[a:a + n]

    # -- views -----------------------------------------------------------------------------
    def _place(self, indices: Iterable[int]) -> list[int]:
        """Give each member a new view; returns those whose place was not known to be zero."""
        dirty = []
        self._copy = None
        by_pool: dict[int, list[int]] = {}
        for i in indices:
            by_pool.setdefault(id(self.members[i].pool), []).append(i)
        for idx in by_pool.values():
            ms = [self.members[i] for i in idx]
            gpool, made = self._pool(ms[0].pool)
            locals_ = views(gpool, [m.offset for m in ms], [m.shape for m in ms],
                            [m.dtype for m in ms])
            for i, m, local in zip(idx, ms, locals_):
                self.locals[i] = local
                self.objs[i] = wrap_like(m.param, local) if self.wrapped[i] else local
                self.addrs[i] = _data_ptr(local)
            if not made:
                dirty += idx
        self._all_placed = not any(map(_is_none, self.objs))
        return dirty

    def install_missing(self) -> None:
        """A zeroed view for every member that requires grad and has none (not sparse ones:
        accumulating into a dense view would make them dense; nor :attr:`served` ones)."""
        skip = self.sparse | self.served if self.served else self.sparse
        todo = [i for i, (g, rg) in enumerate(zip(map(_grad_of, self.params),
                                                  map(_requires_grad_of, self.params)))
                if g is None and rg and i not in skip]
        if not todo:
            return
        with torch.no_grad():
            dirty = self._place(todo)
            if dirty:
                torch._foreach_zero_([self.locals[i] for i in dirty])  # type: ignore[misc]
        versions = list(map(_version_of, [self.locals[i] for i in todo]))
        at, vs = self._without(todo)
        self.unwritten = (at + todo, vs + versions)
        for i in todo:  # installed last: an interrupt before leaves .grad None, as it was
            self.params[i].grad = self.objs[i]

    def settle(self) -> None:
        """Give every pre-installed view nothing wrote to back as ``None``, as torch has it."""
        at, versions = self.unwritten
        if not at:
            return
        objs = [self.objs[i] for i in at]
        grads = list(map(_grad_of, [self.params[i] for i in at]))
        kept = map(operator.is_, grads, objs)
        same = map(operator.eq, map(_version_of, [self.locals[i] for i in at]), versions)
        back = [i for i, k, s in zip(at, kept, same) if k and s]
        for i in back:  # before forgetting them: an interrupt here leaves the rest to the next
            self.params[i].grad = None
        self.unwritten = ([], [])

    def _without(self, indices: Iterable[int]) -> tuple[list[int], list[int]]:
        """The unwritten record without ``indices``."""
        at, versions = self.unwritten
        if not at:
            return at, versions
        drop = set(indices)
        if not drop:
            return at, versions
        kept = [(i, v) for i, v in zip(at, versions) if i not in drop]
        return [i for i, _ in kept], [v for _, v in kept]

    def absorb(self, indices: list[int], src: list[torch.Tensor] | None = None) -> None:
        """Copy each member's foreign gradient into its place, with one copy for all. The
        ``.grad`` stays what its owner installed (their buffer, their scaling): read again at
        every step, never rebound."""
        if not indices:
            return
        if src is None:
            src = [local_tensor(self.params[i].grad) for i in indices]  # type: ignore[arg-type]
        with torch.no_grad():  # our own view moved (``.grad.data = x``): the user's now
            dst, flat = self._places(indices)
            try:  # one C++ loop: ~4x cheaper on the host than the foreach copy's one copy_ each
                done = flat is not None and torch.cat(src, out=flat) is flat
            except RuntimeError:  # a source overlapping the pool: refused before any write
                done = False
            if not done:
                torch._foreach_copy_(dst, src)
        del src, dst, flat
        self.unwritten = self._without(indices)

    def _on_pools(self, tensors: Iterable[torch.Tensor]) -> bool:
        """Whether one of ``tensors`` is on a gradient pool's memory (one C-level pass)."""
        ours = {p.storage_key for p in self._pools.values()}
        return bool(ours) and not ours.isdisjoint(map(tc.storage_address, tensors))

    def _places(self, indices: list[int]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The local views to copy ``indices``' foreign gradients into, placed where needed, and
        the flat range they make up (``None`` unless 1-D and adjacent); the last step's when
        every one is still at its place (C-level comparisons)."""
        last = self._copy
        if last is not None and last[0] == indices and list(map(_data_ptr, last[1])) == last[2] and (
                not self.any_wrapped
                or all(map(operator.is_, map(local_of, map(self.objs.__getitem__, indices)),  # type: ignore[arg-type]
                           last[1]))):
            return last[1], last[3]
        self._place([i for i in indices if self._pools.get(id(self.members[i].pool)) is None
                     or not self._at_place(i)])
        dst: list[torch.Tensor] = [self.locals[i] for i in indices]  # type: ignore[misc]
        ms = [self.members[i] for i in indices]
        flat = None
        if all(len(m.shape) == 1 for m in ms) and all(
                a.end == b.offset and a.pool is b.pool and a.dtype == b.dtype
                for a, b in zip(ms, ms[1:])):
            flat = self._pools[id(ms[0].pool)].view_at(
                ms[0].offset, ((ms[-1].end - ms[0].offset) // ms[0].dtype.itemsize,), ms[0].dtype)
        self._copy = (list(indices), dst, list(map(_data_ptr, dst)), flat)
        return dst, flat

    def foreign(self, lo: int, at: list[int], grads: list[torch.Tensor | None]
                ) -> tuple[list[int], list[torch.Tensor]] | str:
        """Of members ``at`` (their ``.grad``s ``grads``, none pooled) in the group starting at
        ``lo``: those with a gradient to copy in and their local tensors, or why one cannot be
        (torch steps the group).
        When the same members have gradients of the same types as at the last step, that check
        runs as C-level passes (no per-member Python)."""
        keep = list(map(_not_none, grads))
        if not all(keep):
            at, grads = list(compress(at, keep)), list(compress(grads, keep))
        last = self._checked.get(lo)
        if last is not None and last.at == at and list(map(type, grads)) == last.types:
            locs = grads if last.plain else list(map(local_tensor, grads))  # type: ignore[arg-type]
            if (all(map(operator.is_, map(_layout_of, locs), repeat(torch.strided)))
                    and list(map(_shape_of, locs)) == last.shapes
                    and list(map(_dtype_of, locs)) == last.dtypes
                    and list(map(_device_of, locs)) == last.devices):
                return self._unless_on_pools(at, locs)  # type: ignore[arg-type]
        self._checked.pop(lo, None)
        for i, grad in zip(at, grads):
            why = unpoolable(grad, self.members[i])  # type: ignore[arg-type]
            if why is not None:
                if grad.layout != torch.strided:  # type: ignore[union-attr]
                    self.sparse.add(i)  # never pre-install a dense view for it again
                return why
        locs = [local_tensor(g) for g in grads]  # type: ignore[arg-type]
        ms = [self.members[i] for i in at]
        self._checked[lo] = Checked(at, list(map(type, grads)), all(map(operator.is_, locs, grads)),
                                    [m.shape for m in ms], [m.dtype for m in ms],
                                    [m.pool.device for m in ms])
        return self._unless_on_pools(at, locs)

    def _unless_on_pools(self, at: list[int], locs: list[torch.Tensor]
                         ) -> tuple[list[int], list[torch.Tensor]] | str:
        """``(at, locs)``, or why not when a gradient is on a gradient pool's memory (its own
        view re-viewed, ``g.data = g.data.t()``, or another member's): copying the pool into
        itself would change the user's gradient, which torch's step only reads. So no gradient
        copied in (nor written back after the kernel) overlaps the places it meets."""
        if self._on_pools(locs):
            return ("a .grad on flatpool's gradient memory that is not its pooled view "
                    "(re-viewed, or another parameter's): torch's step reads it where it is")
        return at, locs

    def reinstall(self, indices: Sequence[int],
                  assign: Callable[[Any, str, Any], None] = setattr) -> None:
        """Copy views an earlier plan installed into this plan's places and install these
        (values first: an interrupt between leaves the old view, copied again next time)."""
        self.absorb(list(indices))
        for i in indices:
            assign(self.params[i], "grad", self.objs[i])

    # -- FSDP2's reduce-scatter into the pool -------------------------------------------------
    def hand_out(self, pool: FlatPool, run: Run, numel: int,
                 dtype: torch.dtype) -> torch.Tensor | None:
        """The gradient pool of ``pool`` as one flat ``numel`` tensor at storage offset 0, for
        FSDP2 to reduce-scatter into and view each ``.grad`` out of (``run``: its members in
        FSDP2's order, packed from byte 0 without gaps: the caller checked). ``None`` while any
        of them has a gradient: FSDP2 then adds into those (exact, as plain FSDP2)."""
        if not all(map(_is_none, map(_grad_of, run.params))):
            return None
        gpool, _ = self._pool(pool, zeroed=False)  # written whole by the collective
        out = gpool.view_at(0, (numel,), dtype)
        if out.storage_offset() != 0:  # FSDP2 views each .grad at an absolute storage offset
            return None
        self._handed[id(pool)] = (run, list(map(_data_ptr(out).__add__, run.offsets)))
        return out

    def _take_handed(self) -> None:
        """Make the ``.grad``s FSDP2 viewed out of handed-out pools the members' pooled views:
        one address and shape comparison per group (C-level maps), per member only where one
        differs."""
        handed, self._handed = self._handed, {}
        for run, want in handed.values():
            grads = list(map(_grad_of, run.params))
            if any(map(_is_none, grads)):  # (a member FSDP2 gave no gradient: none is pooled)
                continue
            locals_ = list(map(local_of, grads)) if run.wrapped else list(map(local_tensor, grads))
            addrs = list(map(_data_ptr, locals_))
            if addrs == want and list(map(_shape_of, locals_)) == run.shapes:
                self._set_views(run.idx, locals_, grads)
                continue
            ok = [k for k, (a, b, t) in enumerate(zip(addrs, want, locals_))
                  if a == b and t.shape == run.shapes[k]]
            self._set_views([run.idx[k] for k in ok], [locals_[k] for k in ok],
                            [grads[k] for k in ok])
        self._all_placed = not any(map(_is_none, self.objs))

    def _set_views(self, at: list[int], locals_: list[torch.Tensor],
                   objs: list[torch.Tensor]) -> None:
        self._copy = None
        if at and at[-1] - at[0] == len(at) - 1:  # one run (FSDP2's order is the plan's)
            a, b = at[0], at[-1] + 1
            self.locals[a:b] = locals_
            self.objs[a:b] = objs
            self.addrs[a:b] = list(map(_data_ptr, locals_))
            return
        for i, lt, o in zip(at, locals_, objs):
            self.locals[i], self.objs[i], self.addrs[i] = lt, o, _data_ptr(lt)

    def pooled(self, lo: int, hi: int) -> list[bool]:
        """Per member of ``[lo, hi)``: its ``.grad`` is its pooled view, still at its place."""
        return self.read(lo, hi)[0]

    def read(self, lo: int, hi: int) -> tuple[list[bool], list[torch.Tensor | None]]:
        """:meth:`pooled`, and the ``.grad``s it read (one read a member a step)."""
        if self._handed:
            self._take_handed()
        whole = lo == 0 and hi == len(self.params)  # (the step's read: no slice copies)
        objs = self.objs if whole else self.objs[lo:hi]
        grads = list(map(_grad_of, self.params if whole else self.params[lo:hi]))
        return self._pooled(lo, hi, objs, grads), grads

    def _pooled(self, lo: int, hi: int, objs: list[torch.Tensor | None],
                grads: list[torch.Tensor | None]) -> list[bool]:
        if self._all_placed and all(map(operator.is_, grads, objs)):  # the steady state
            whole = lo == 0 and hi == len(self.locals)
            locals_ = self.locals if whole else self.locals[lo:hi]
            if ((not self.any_wrapped or all(map(operator.is_, map(local_of, objs), locals_)))  # type: ignore[arg-type]
                    and list(map(_data_ptr, locals_)) == (self.addrs if whole else self.addrs[lo:hi])  # type: ignore[arg-type]
                    and all(map(_contiguous, map(self.locals.__getitem__,  # type: ignore[arg-type]
                                                 self.multi if whole else
                                                 [i for i in self.multi if lo <= i < hi])))):
                return [True] * (hi - lo)
        same = list(map(operator.is_, grads, objs))
        if not self._all_placed and any(map(_is_none, objs)):  # None is None: not pooled
            same = [s and o is not None for s, o in zip(same, objs)]
        if not any(same):  # (every gradient foreign, or none)
            return same
        at = list(compress(range(lo, hi), same))  # some members' (frozen, unused, foreign)
        locals_ = list(map(self.locals.__getitem__, at))
        if ((not self.any_wrapped or all(map(operator.is_, map(local_of, map(self.objs.__getitem__, at)),  # type: ignore[arg-type]
                                             locals_)))
                and list(map(_data_ptr, locals_)) == list(map(self.addrs.__getitem__, at))  # type: ignore[arg-type]
                and all(map(_contiguous, compress(locals_, map(self._is_multi.__getitem__, at))))):  # type: ignore[arg-type]
            return same
        return [s and self._at_place(lo + k) for k, s in enumerate(same)]

    def _at_place(self, i: int) -> bool:
        obj, local = self.objs[i], self.locals[i]
        if obj is None or local is None:
            return False
        if self.wrapped[i] and local_tensor(obj) is not local:
            return False
        return _data_ptr(local) == self.addrs[i] and (not self._is_multi[i] or local.is_contiguous())

    def release(self) -> bool:
        """Drop the gradient pools and views when no member has a gradient (freed as torch's)."""
        if not all(map(_is_none, map(_grad_of, self.params))):
            return False
        self._all_placed = False
        self._pools.clear()
        self._flat.clear()
        self._handed.clear()
        n = len(self.members)
        self.locals = [None] * n
        self.objs = [None] * n
        self.addrs = [None] * n
        self.unwritten = ([], [])
        self._copy = None
        return True


def unpoolable(grad: torch.Tensor, m: Member) -> str | None:
    """Why a foreign gradient cannot be copied into ``m``'s place (torch steps it), or ``None``."""
    local = local_tensor(grad)
    if local.layout != torch.strided:
        return f"a {local.layout} gradient"
    if (local_tensor(m.param) is m.param) != (local is grad):
        return f"a {type(grad).__name__} gradient of a {type(m.param).__name__} parameter"
    if local.shape != m.shape or local.dtype != m.dtype or local.device != m.pool.device:
        return (f"a gradient of shape {tuple(local.shape)}, {local.dtype} on {local.device} "
                f"(the parameter: {tuple(m.shape)}, {m.dtype})")
    return None
