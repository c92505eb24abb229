"""Which tensor objects move with each original, and how (the general adoption path).

A primary brings along its local tensor (DTensor), a wrapper sharing its storage
(HyperParallel's ``_make_subclass`` DTensor), the views and holders the caller named, and with
``discover=True`` every other Python tensor on the original. Each member moves in one of three
ways (see :mod:`flatpool.ownership.moves`): ``set_`` in place, an impl swap for an autograd view
(its ``_base`` would pin the original), or an impl swap that gives a storage-less wrapper (a
meta ``_make_subclass`` wrapper after lazy init) the place of its local tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from .. import torch_compat as tc
from ..aliasing import ByteRange, extent_of, own_storage
from ..errors import AliasingError, InvalidRequestError, InvalidTypeError
from ..holder import Holder
from ..slices import Slice
from ..state import PoolState
from .pins import name_referrers, tensors_on_storage
from .spec import AdoptSpec
from .validate import Primary, validate

Track = Callable[[torch.UntypedStorage], int]
"""Registers an original storage with the transaction and returns its key."""

SET, SWAP, WRAP = 0, 1, 2
"""Member kinds: ``set_`` in place; impl swap (an autograd view); impl swap of a storage-less
wrapper onto its local tensor's place."""


class Member:
    """A tensor object to move, how, and where it sits now (its TensorImpl geometry)."""

    __slots__ = ("obj", "holder", "primary", "kind", "byte_offset", "size", "stride")
    obj: torch.Tensor
    holder: Holder | None
    primary: bool
    kind: int
    byte_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def __init__(
        self, obj: torch.Tensor, holder: Holder | None, primary: bool, kind: int,
        byte_offset: int, size: tuple[int, ...], stride: tuple[int, ...],
    ) -> None:
        self.obj, self.holder, self.primary, self.kind = obj, holder, primary, kind
        self.byte_offset, self.size, self.stride = byte_offset, size, stride


class Plan:
    """One original: its validated primary, storage key, members and slice."""

    __slots__ = ("primary", "key", "members", "slice", "allocated")
    primary: Primary
    key: int
    allocated: bool

    def __init__(self, primary: Primary, key: int) -> None:
        self.primary = primary
        self.key = key
        self.members: list[Member] = []
        self.slice: Slice | None = primary.spec.slice
        self.allocated = False

    @property
    def spec(self) -> AdoptSpec:
        return self.primary.spec

    @property
    def extent(self) -> ByteRange:
        return self.primary.extent

    @property
    def label(self) -> str:
        return self.primary.label


def _on_key(t: torch.Tensor, key: int) -> bool:
    s = own_storage(t)
    return s is not None and tc.storage_key(s) == key


def _member(obj: torch.Tensor, holder: Holder | None, primary: bool, key: int) -> Member:
    with tc.no_torch_function():
        base = tc.impl_base(obj)
        kind = SWAP if base is not None and _on_key(base, key) else SET
        item = tc.impl_element_size(obj)
        result = Member(obj, holder, primary, kind, tc.impl_storage_offset(obj) * item,
                        tuple(tc.impl_size(obj)), tuple(tc.impl_stride(obj)))
        return result  # not `return f()`: see flatpool.ownership.interrupts


def expand(obj: torch.Tensor, key: int, primary: bool) -> list[Member]:
    """The objects behind ``obj`` that move with storage ``key``: itself, its local tensor,
    or (a storage-less ``_make_subclass`` wrapper) itself onto its local tensor's place."""
    out: list[Member] = []
    on_key = _on_key(obj, key)
    if on_key:
        out.append(_member(obj, None, primary, key))
    inner = getattr(obj, "_local_tensor", None)
    if isinstance(inner, torch.Tensor) and inner is not obj and _on_key(inner, key):
        local = _member(inner, Holder(obj, "_local_tensor"), primary, key)
        out.append(local)
        if not on_key:
            with tc.no_torch_function():
                meta = tc.impl_is_meta(obj)
            if meta:  # a wrapper that lost its storage (deferred init): give it the local's
                out.append(Member(obj, None, primary, WRAP, local.byte_offset, local.size,
                                  local.stride))
    return out


def _check_holder(h: Holder, p: Plan) -> torch.Tensor:
    """A holder's tensor, after checking that it can be read *and* assigned (without writing)."""
    try:
        value = h.get()
    except (AttributeError, KeyError, IndexError, TypeError) as exc:
        raise InvalidRequestError(f"holder {h.describe()} of {p.label} cannot be read: {exc}") from exc
    if not isinstance(value, torch.Tensor):
        raise InvalidRequestError(
            f"holder {h.describe()} of {p.label} holds a {type(value).__name__}, not a tensor"
        )
    why = h.unassignable()  # from the owner's type: writing would run the place's setter
    if why is not None:
        raise InvalidTypeError(
            f"holder {h.describe()} of {p.label} cannot be assigned ({why}): name a place "
            "flatpool can write (an attribute, a list or dict item), not a read-only property "
            "or a tuple slot"
        )
    return value


def discover_members(key: int, extent: ByteRange, known: Iterable[int]) -> list[Member]:
    """Every Python-visible tensor on storage ``key`` inside ``extent`` (a gc scan) that is
    safe to move.

    Not safe: on a storage torch marked non-resizable (``t.numpy()``, ``numpy.asarray(t)``,
    ``torch.from_numpy``), a tensor nothing gc can see refers to. ``t.numpy()`` makes exactly
    such a tensor, the ndarray's base, and the ndarray reads the storage through a raw
    pointer: moving its base would free the memory under it. It stays, and pins the original.
    """
    found: list[Member] = []
    candidates = tensors_on_storage(key, set(known))
    for t in candidates:
        with tc.no_torch_function():
            if not extent.contains(extent_of(t)):
                continue
        if not _resizable(t) and not name_referrers(t, {id(candidates)}):
            continue
        found.append(_member(t, None, False, key))
    del candidates
    return found


def _resizable(t: torch.Tensor) -> bool:
    storage = own_storage(t)
    return storage is None or storage.resizable()


def plan_all(
    pool: PoolState, specs: list[AdoptSpec], track: Track, discover: bool, into_bound: bool
) -> list[Plan]:
    """Validate every spec and work out its members; nothing is changed."""
    plans: list[Plan] = []
    seen: set[int] = set()
    for i, spec in enumerate(specs):
        primary = validate(pool, spec, i)
        if id(primary.inner) in seen:
            raise InvalidRequestError(f"{primary.label} was given twice; name it once")
        seen.add(id(primary.inner))
        assert primary.storage is not None
        key = track(primary.storage)
        primary.storage = None
        plan = Plan(primary, key)
        if spec.slice is not None:
            pool.check_live(spec.slice)
            if spec.slice.nbytes != plan.extent.nbytes or spec.slice.dtype != primary.dtype:
                raise InvalidRequestError(
                    f"{plan.label} needs {plan.extent.nbytes} bytes of {primary.dtype}; slice "
                    f"{spec.slice.slice_id} has {spec.slice.nbytes} bytes of {spec.slice.dtype}"
                )
            if not into_bound and pool.registry.holds(spec.slice.slice_id):
                raise InvalidRequestError(
                    f"slice {spec.slice.slice_id} already backs adopted tensors; use readopt()"
                )
        plans.append(plan)
    _check_disjoint(plans)

    for p in plans:
        members = expand(p.spec.tensor, p.key, True)
        for v in p.spec.views:
            more = expand(v, p.key, False)
            if not more:
                raise InvalidRequestError(f"a view given for {p.label} does not share its storage")
            members += more
        for h in p.spec.holders:
            more = expand(_check_holder(h, p), p.key, False)
            if not more:
                raise InvalidRequestError(
                    f"holder {h.describe()} of {p.label} does not hold a tensor on its storage"
                )
            members += [Member(m.obj, m.holder or h, m.primary, m.kind, m.byte_offset, m.size,
                               m.stride) for m in more]
        unique: dict[int, Member] = {}
        for m in members:  # one member per object; keep a holder and primary-ness if any had it
            prev = unique.get(id(m.obj))
            if prev is not None:
                m.holder = m.holder or prev.holder
                m.primary = m.primary or prev.primary
            unique[id(m.obj)] = m
        if discover:
            unique.update((id(m.obj), m) for m in discover_members(p.key, p.extent, unique))
        _keep_views_with_their_base(unique.values())
        for m in unique.values():
            with tc.no_torch_function():  # a subclass may route element_size() and raise
                nbytes = _span(m) * tc.impl_element_size(m.obj)
            if m.kind != WRAP and not p.extent.contains(
                    ByteRange(m.byte_offset, m.byte_offset + nbytes)):
                raise InvalidRequestError(
                    f"a view of {p.label} reaches bytes outside it ({m.byte_offset}.."
                    f"{m.byte_offset + nbytes} vs {p.extent.start}..{p.extent.end}); adopt the "
                    "tensor it is a view of instead"
                )
        p.members = list(unique.values())
    return plans


def _keep_views_with_their_base(members: Iterable[Member]) -> None:
    """A view whose base moves in place can move in place too (its ``_base`` then points into
    the pool): that keeps its impl, which an autograd graph may have saved. Only a view whose
    base stays behind needs the impl swap."""
    members = list(members)
    moving = {tc.impl_address(m.obj) for m in members if m.kind == SET}
    with tc.no_torch_function():
        for m in members:
            if m.kind == SWAP:
                base = tc.impl_base(m.obj)
                if base is not None and tc.impl_address(base) in moving:
                    m.kind = SET
                del base


def _span(m: Member) -> int:
    if any(s == 0 for s in m.size):
        return 0
    return 1 + sum((s - 1) * abs(st) for s, st in zip(m.size, m.stride))


def _check_disjoint(plans: list[Plan]) -> None:
    """Primaries on one storage must not overlap, and no slice may be used twice."""
    by_key: dict[int, list[Plan]] = {}
    for p in plans:
        by_key.setdefault(p.key, []).append(p)
    for group in by_key.values():
        if len(group) == 1:
            continue
        group.sort(key=lambda p: p.extent.start)
        for a, b in zip(group, group[1:]):
            if a.extent.intersects(b.extent):
                raise AliasingError(
                    f"{a.label} and {b.label} share bytes of one storage; adopt one and pass the "
                    "other in its AdoptSpec.views",
                    [(a.label, b.label)],
                )
    given = [p.slice.slice_id for p in plans if p.slice is not None]
    if len(given) != len(set(given)):
        raise InvalidRequestError("two AdoptSpecs name the same target slice")

__all__ = ["Member", "Plan", "SET", "SWAP", "WRAP", "discover_members", "expand", "plan_all"]
