"""``adopt``: move original storages into pool slices, rebind every view, prove release.

One batch is one transaction: validate everything, plan and allocate slices, copy all bytes in
one ``torch._foreach_copy_``, rebind every named tensor object, then prove that each original
storage died. Any failure, including a pinned original in the default mode, rolls every tensor
and the pool back to where they were.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Union

import torch

from ..aliasing import ByteRange, byte_range, local_tensor
from ..errors import (
    AdoptionError,
    AliasingError,
    FlatPoolError,
    InvalidRequestError,
    InvalidTypeError,
    PinnedStorageError,
)
from ..slices import Slice
from .copying import COPY_CHUNK, copy_all
from .faults import checkpoint
from .gcpause import gc_paused
from .pins import name_pins, tensors_on_storage
from .rebind import autograd_base, own_storage
from .registry import Binding, Geometry
from .spec import AdoptedItem, AdoptionReport, AdoptSpec, Holder, OnPinned
from .transaction import InPlace, Replaced, Transaction, byte_view
from .weak import upgrade

if TYPE_CHECKING:
    from ..pool import FlatPool

Adoptable = Union[torch.Tensor, AdoptSpec]
AdoptTargets = Union[Adoptable, Sequence[Adoptable]]


class _Member:
    """A tensor object to move: in place, or by replacing it at ``holder``."""

    __slots__ = ("obj", "holder", "primary")

    def __init__(self, obj: torch.Tensor, holder: Holder | None, primary: bool) -> None:
        self.obj, self.holder, self.primary = obj, holder, primary


class _Plan:
    __slots__ = (
        "spec", "key", "extent", "shape", "dtype", "members", "slice", "allocated", "index",
        "rebound",
    )

    def __init__(self, spec: AdoptSpec, key: int, extent: ByteRange, index: int) -> None:
        self.spec, self.key, self.extent, self.index = spec, key, extent, index
        self.shape: tuple[int, ...] = ()
        self.dtype: torch.dtype = torch.uint8
        self.members: list[_Member] = []
        self.slice: Slice | None = spec.slice
        self.allocated = False
        self.rebound = 0

    @property
    def label(self) -> str:
        """How errors name this original (built only when one is raised)."""
        return _label(self.spec.tensor, self.index)


def _check_not_in_backward() -> None:
    if torch._C._current_graph_task_id() != -1:
        raise AdoptionError(
            "cannot move storages while autograd's backward pass is running (called from a "
            "backward hook?); adopt before forward or after backward and the optimizer step"
        )


def _self_overlapping(t: torch.Tensor) -> bool:
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1)
    span = 1
    for st, sz in dims:
        if st < span:
            return True
        span = st * sz
    return False


def _normalize(targets: AdoptTargets) -> list[AdoptSpec]:
    if isinstance(targets, (torch.Tensor, AdoptSpec)):
        items: Sequence[Adoptable] = [targets]
    elif isinstance(targets, (list, tuple)):
        items = targets
    else:
        raise InvalidTypeError(
            "adopt() takes a tensor, an AdoptSpec, or a sequence of them, got "
            f"{type(targets).__name__}"
        )
    specs = [t if isinstance(t, AdoptSpec) else AdoptSpec(t) for t in items]
    for s in specs:
        if not isinstance(s.tensor, torch.Tensor):
            raise InvalidTypeError(f"AdoptSpec.tensor must be a tensor, got {type(s.tensor).__name__}")
    if not specs:
        raise InvalidRequestError("adopt() was given nothing to adopt")
    return specs


def _label(t: torch.Tensor, i: int) -> str:
    return f"#{i} {type(t).__name__}{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"


def _validate_primary(
    pool: FlatPool, spec: AdoptSpec, i: int, pool_keys: dict[int, FlatPool]
) -> tuple[torch.Tensor, torch.UntypedStorage, ByteRange]:
    """Check one primary; return its data tensor, that tensor's storage and its byte extent.

    ``pool_keys`` maps the storage key of every materialized pool to the pool. Messages are
    built only on failure: this runs once per tensor of a batch.
    """
    inner = local_tensor(spec.tensor)

    def label() -> str:
        return _label(spec.tensor, i)

    with torch._C.DisableTorchFunctionSubclass():
        if inner.is_meta:
            raise InvalidRequestError(
                f"{label()} is a meta tensor and has no data to adopt; use "
                "pool.materialize_into() to give it pool storage"
            )
        if inner.device != pool.device:
            raise InvalidRequestError(
                f"{label()} is on {inner.device} but pool {pool.name!r} is on {pool.device}; "
                "move it to the pool's device first or use a pool on its device"
            )
        numel = inner.numel()
        if numel == 0:
            raise InvalidRequestError(f"{label()} is empty: zero-size tensors stay outside the pool")
        if inner.is_inference():
            raise InvalidRequestError(
                f"{label()} is an inference tensor (made under torch.inference_mode()); it "
                "cannot be rebound in place: adopt a clone() made outside inference mode"
            )
        contiguous = inner.is_contiguous()
        if not contiguous and _self_overlapping(inner):
            raise InvalidRequestError(
                f"{label()} overlaps itself (an expanded/broadcast view, strides "
                f"{tuple(inner.stride())}); adopt the tensor it was expanded from"
            )
        storage = inner.untyped_storage()
        if contiguous:
            item = inner.element_size()
            start = int(inner.storage_offset()) * item
            extent = ByteRange(start, start + numel * item)
        else:
            extent = byte_range(inner)
    if inner is not spec.tensor:
        wrapper = own_storage(spec.tensor)
        if wrapper is not None and int(wrapper._cdata) != int(storage._cdata):
            raise InvalidRequestError(
                f"{label()} has a storage of its own that is not its _local_tensor's: the "
                "wrapper does not view its shard, and adopting the local tensor would leave the "
                "wrapper reading other memory; rebuild the wrapper around its local tensor"
            )
        del wrapper
    owner = pool_keys.get(int(storage._cdata))
    if owner is not None and extent.end <= owner.capacity:
        where = "this pool" if owner is pool else f"pool {owner.name!r}"
        raise InvalidRequestError(
            f"{label()} already lives in {where}; use readopt() to bring moved members back"
        )
    return inner, storage, extent


def _expand(obj: torch.Tensor, key: int, primary: bool) -> list[_Member]:
    """The objects behind ``obj`` that sit on storage ``key``: itself and/or its local tensor."""
    out: list[_Member] = []
    own = own_storage(obj)
    if own is not None and int(own._cdata) == key:
        out.append(_Member(obj, None, primary))
    inner = getattr(obj, "_local_tensor", None)
    if isinstance(inner, torch.Tensor) and inner is not obj:
        s = own_storage(inner)
        if s is not None and int(s._cdata) == key:
            out.append(_Member(inner, Holder(obj, "_local_tensor"), primary))
    return out


def _discover(key: int, extent: ByteRange, known: set[int]) -> list[_Member]:
    """Every Python-visible tensor on storage ``key`` inside ``extent``, with holders for views."""
    found: list[_Member] = []
    candidates = tensors_on_storage(key, known)
    for t in candidates:
        if not extent.contains(byte_range(t)):
            continue
        holder: Holder | None = None
        if autograd_base(t) is not None:
            for ref in gc.get_referrers(t):
                if ref is candidates:  # our own list, not the holder to replace it in
                    continue
                if isinstance(ref, dict):
                    k = next(k for k, v in ref.items() if v is t)
                    owner = next(
                        (o for o in gc.get_referrers(ref) if getattr(o, "__dict__", None) is ref),
                        None,
                    )
                    holder = Holder(owner, k) if owner is not None else Holder(ref, k, item=True)
                    break
                if isinstance(ref, list):
                    holder = Holder(ref, next(i for i, v in enumerate(ref) if v is t), item=True)
                    break
        found.append(_Member(t, holder, False))
    return found


def _plan(
    pool: FlatPool, specs: list[AdoptSpec], txn: Transaction, discover: bool, into_bound: bool
) -> list[_Plan]:
    from ..pool import live_pools

    plans: list[_Plan] = []
    seen_primary: set[int] = set()
    pool_keys = {  # only materialized pools can own a tensor
        int(p._buffer.untyped_storage()._cdata): p for p in live_pools() if p._buffer is not None
    }
    for i, spec in enumerate(specs):
        inner, storage, extent = _validate_primary(pool, spec, i, pool_keys)
        if id(inner) in seen_primary:
            raise InvalidRequestError(f"{_label(spec.tensor, i)} was given twice; name it once")
        seen_primary.add(id(inner))
        key = txn.track(storage)
        del storage
        plan = _Plan(spec, key, extent, i)
        if inner.is_contiguous():
            plan.shape, plan.dtype = tuple(inner.shape), inner.dtype
        else:
            plan.shape, plan.dtype = (extent.nbytes // inner.element_size(),), inner.dtype
        if spec.slice is not None:
            pool.check_live(spec.slice)
            if spec.slice.nbytes != plan.extent.nbytes or spec.slice.dtype != plan.dtype:
                raise InvalidRequestError(
                    f"{plan.label} needs {plan.extent.nbytes} bytes of {plan.dtype}; slice "
                    f"{spec.slice.slice_id} has {spec.slice.nbytes} bytes of {spec.slice.dtype}"
                )
            if not into_bound and pool.registry.holds(spec.slice):
                raise InvalidRequestError(
                    f"slice {spec.slice.slice_id} already backs adopted tensors; use readopt()"
                )
        plans.append(plan)

    # Primaries on one storage must not overlap, and no slice may be used twice.
    by_key: dict[int, list[_Plan]] = {}
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

    # Members: primary (and its local/wrapper), views, holders, discovered tensors.
    for p in plans:
        t = p.spec.tensor
        if not (discover or p.spec.views or p.spec.holders) and local_tensor(t) is t:
            p.members = [_Member(t, None, True)]  # a plain tensor alone: on its storage, in range
            continue
        members = _expand(t, p.key, True)
        for v in p.spec.views:
            members += _expand(v, p.key, False) or _foreign(v, p)
        for h in p.spec.holders:
            try:
                value = h.get()
            except (AttributeError, KeyError, IndexError, TypeError) as exc:
                raise InvalidRequestError(f"holder {h.describe()} of {p.label}: {exc}") from exc
            if not isinstance(value, torch.Tensor) or not _expand(value, p.key, False):
                raise InvalidRequestError(
                    f"holder {h.describe()} of {p.label} does not hold a tensor on its storage"
                )
            members += [_Member(m.obj, h if m.holder is None else m.holder, m.primary)
                        for m in _expand(value, p.key, False)]
        unique: dict[int, _Member] = {}
        for m in members:
            prev = unique.get(id(m.obj))
            if prev is None or (prev.holder is None and m.holder is not None):
                unique[id(m.obj)] = _Member(m.obj, m.holder or (prev.holder if prev else None),
                                            m.primary or (prev.primary if prev else False))
        if discover:
            unique.update({id(m.obj): m for m in _discover(p.key, p.extent, set(unique))})
        for m in unique.values():
            if not p.extent.contains(byte_range(m.obj)):
                raise InvalidRequestError(
                    f"a view of {p.label} reaches bytes outside it ({byte_range(m.obj)} vs "
                    f"{p.extent}); adopt the tensor it is a view of instead"
                )
        p.members = list(unique.values())
    return plans


def _foreign(v: torch.Tensor, p: _Plan) -> list[_Member]:
    raise InvalidRequestError(f"a view given for {p.label} does not share its storage")


def adopt(
    pool: FlatPool,
    targets: AdoptTargets,
    *,
    discover: bool = False,
    on_pinned: OnPinned = "raise",
    into_bound: bool = False,
) -> AdoptionReport:
    """Move ``targets`` into ``pool``; see :meth:`FlatPool.adopt`.

    ``into_bound`` lets specs name slices that already have bindings, which the adoption then
    replaces (re-adoption with explicit specs, :meth:`FlatPool.readopt`).
    """
    if on_pinned not in ("raise", "warn", "force"):
        raise InvalidRequestError(f"on_pinned must be 'raise', 'warn' or 'force', got {on_pinned!r}")
    if not isinstance(discover, bool):
        raise InvalidTypeError(f"discover must be a bool, got {discover!r}")
    _check_not_in_backward()
    specs = _normalize(targets)
    with gc_paused(), pool.lock:
        txn = Transaction(pool)
        plans: list[_Plan] = []
        try:
            plans = _plan(pool, specs, txn, discover, into_bound)
            return _execute(pool, plans, txn, on_pinned)
        except BaseException:
            txn.rollback()
            for p in plans:  # the traceback keeps these frames: let them pin nothing
                p.members = []
            raise


def _execute(pool: FlatPool, plans: list[_Plan], txn: Transaction, on_pinned: OnPinned) -> AdoptionReport:
    todo = [p for p in plans if p.slice is None]
    for _ in todo:
        checkpoint("allocate")
    for p, slc in zip(todo, pool._allocate_many([(p.shape, p.dtype) for p in todo])):
        p.slice, p.allocated = slc, True
    flat = pool._materialized_buffer()  # the pool's bytes as one 1-D uint8 tensor
    target = flat.untyped_storage()
    checkpoint("copy")
    # In chunks: the byte views cost ~1 KiB of host memory each, and a batch of thousands
    # must not hold them all at once (adoption's peak is meant to be originals + pool).
    for first in range(0, len(plans), COPY_CHUNK):
        chunk = plans[first : first + COPY_CHUNK]
        dst = [flat.narrow(0, p.slice.offset, p.extent.nbytes) for p in chunk if p.slice is not None]
        for p, view in zip(chunk, dst):
            if not p.allocated:  # an existing slice: a rollback must give it its old bytes back
                txn.save_bytes(view)
        src = [byte_view(txn.storages[p.key], p.extent.start, p.extent.nbytes) for p in chunk]
        copy_all(dst, src)
        del dst, src
    del flat

    bindings = _rebind_all(plans, txn, target)
    del target

    pinned = _precheck(plans, txn)
    if pinned:  # unreachable cycles (a kept traceback) may be all that holds it: collect, retry
        gc.collect()
        pinned = _precheck(plans, txn)
    if pinned and on_pinned == "force":
        _force_rebind(pool, plans, txn, pinned, bindings)
        pinned = _precheck(plans, txn)
    if pinned and on_pinned == "raise":
        raise PinnedStorageError(_pinned_message(pinned), pinned)
    if pinned:
        warnings.warn(_pinned_message(pinned, kept=True), stacklevel=3)

    for p in plans:
        assert p.slice is not None
        pool.registry.bind(p.slice, bindings[p.slice.slice_id])
    _patch_specs(plans, txn)
    pinned_keys = {p.key for p in plans if p.label in pinned} if pinned else set()
    for p in plans:
        p.rebound = len(p.members)
        p.members = []  # drop our references to replaced tensors before the proof
    expired = txn.commit_release()
    if not all(expired.values()):  # as above: cyclic garbage is no pin
        gc.collect()
        expired = {k: w.expired() for k, w in txn.weak.items()}
    late_keys = [k for k, dead in expired.items() if not dead and k not in pinned_keys]
    late: dict[str, tuple[str, ...]] = {}
    if late_keys:
        # Something we could not count (a Python reference to a tensor we replaced) kept an
        # original alive. Undo first so the holders are back on the original and nameable.
        if on_pinned == "raise":
            txn.rollback()
        labels = {p.key: p.label for p in plans}
        for k in late_keys:
            alive = upgrade(txn.weak[k])
            if alive is not None:
                late[labels[k]] = name_pins(alive, txn.own_ids())
            del alive
        if on_pinned == "raise":
            raise PinnedStorageError(_pinned_message(late), late)
        warnings.warn(_pinned_message(late, kept=True), stacklevel=3)
    return AdoptionReport(
        tuple(
            AdoptedItem(
                slice=p.slice,
                original_nbytes=txn.nbytes[p.key],
                released=expired[p.key],
                rebound=p.rebound,
                pinned_by=pinned.get(p.label, late.get(p.label, ())) if pinned or late else (),
            )
            for p in plans
            if p.slice is not None
        )
    )


def _rebind_all(
    plans: list[_Plan], txn: Transaction, target: torch.UntypedStorage
) -> dict[int, list[Binding]]:
    """Move every member onto ``target``; a function of its own so its locals die with it.

    The hot loop of a batch: one ``set_`` per tensor under a single no-grad, no-subclass
    context, and the version counters ``set_`` bumps restored in one call at the end (also
    when a rebind fails half-way, so a rollback finds the counters as they were).
    """
    bindings: dict[int, list[Binding]] = {}
    moved: list[torch.Tensor] = []
    versions: list[int] = []
    journal = txn.journal
    with torch._C.DisableTorchFunctionSubclass():
        # Read every counter before any set_: a view shares its base's counter, so reading it
        # after the base's set_ would record the bumped value.
        before = {id(m.obj): int(m.obj._version) for p in plans for m in p.members}
    try:
        with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
            for p in plans:
                assert p.slice is not None
                out = bindings.setdefault(p.slice.slice_id, [])
                for m in p.members:
                    obj = m.obj
                    item = obj.element_size()
                    off = int(obj.storage_offset()) * item
                    shape, stride = tuple(obj.shape), tuple(obj.stride())
                    rel = off - p.extent.start
                    geometry = Geometry(rel, shape, stride, obj.dtype)
                    new_offset = p.slice.offset + rel
                    if m.holder is not None and obj._base is not None:
                        placed = txn.move_by_holder(m.holder, obj, p.key, target, new_offset)
                    else:
                        checkpoint("rebind")
                        if new_offset % item:
                            raise AdoptionError(
                                f"cannot place a {obj.dtype} view at byte {new_offset} of the "
                                f"pool: not a multiple of its element size {item}"
                            )
                        obj.set_(target, new_offset // item, shape, stride)
                        moved.append(obj)
                        versions.append(before[id(obj)])
                        journal.append(InPlace(obj, p.key, off, shape, stride))
                        placed = obj
                    out.append(Binding.make(placed, geometry, m.holder, m.primary))
    finally:
        if moved:
            torch._C._autograd._unsafe_set_version_counter(tuple(moved), tuple(versions))
    return bindings


def _patch_specs(plans: list[_Plan], txn: Transaction) -> None:
    """Point AdoptSpecs at the replacements of tensors they named, so they pin nothing."""
    replaced = {id(r.old): r for r in txn.journal if isinstance(r, Replaced)}
    if not replaced:
        return
    for p in plans:
        spec = p.spec
        rec = replaced.get(id(spec.tensor))
        if rec is not None:
            txn.patch(spec, "tensor", rec.new, rec)
        if any(id(v) in replaced for v in spec.views):
            views = tuple(replaced[id(v)].new if id(v) in replaced else v for v in spec.views)
            undo = tuple(replaced.get(id(v), v) for v in spec.views)
            txn.patch(spec, "views", views, undo)


def _precheck(plans: list[_Plan], txn: Transaction) -> dict[str, tuple[str, ...]]:
    """Originals something else still uses, each with the names of its holders."""
    checkpoint("release")
    pinned: dict[str, tuple[str, ...]] = {}
    by_key: dict[int, list[InPlace | Replaced]] = {}  # one pass over the journal, not one per key
    for rec in txn.journal:
        by_key.setdefault(rec.key, []).append(rec)
    for key in {p.key for p in plans}:
        based: list[str] = []
        records = by_key.get(key, [])
        with torch._C.DisableTorchFunctionSubclass():
            for rec in records:
                if not isinstance(rec, InPlace):
                    continue
                base = rec.obj._base  # set_ moved the view, but its autograd base stays put
                if base is None:
                    continue
                bs = own_storage(base)
                if bs is not None and int(bs._cdata) == key:
                    based.append(f"tensor {tuple(rec.obj.shape)} named in the adoption")
        if based or txn.unaccounted_users(key, records):
            label = next(p.label for p in plans if p.key == key)
            pinned[label] = name_pins(txn.storages[key], txn.own_ids(), based)
    return pinned


def _force_rebind(
    pool: FlatPool, plans: list[_Plan], txn: Transaction, pinned: dict[str, tuple[str, ...]],
    bindings: dict[int, list[Binding]],
) -> None:
    """``on_pinned="force"``: also move every Python-visible tensor left on a pinned original,
    through the same rebinding loop as the named members."""
    skip = {id(r.obj) for r in txn.journal if isinstance(r, InPlace)}
    found: list[_Plan] = []
    named: list[list[_Member]] = []
    for p in plans:
        if p.label in pinned and p.slice is not None:
            extra = _discover(p.key, p.extent, skip)
            if extra:
                found.append(p)
                named.append(p.members)
                p.members = extra
    try:
        for slice_id, more in _rebind_all(found, txn, pool.storage).items():
            bindings[slice_id].extend(more)
    finally:
        for p, members in zip(found, named):
            p.members = members + p.members


def _pinned_message(pinned: dict[str, tuple[str, ...]], *, kept: bool = False) -> str:
    lines = [f"{len(pinned)} original storage(s) are still referenced after rebinding:"]
    for label, holders in pinned.items():
        lines.append(f"  {label} is held by: " + "; ".join(holders))
    if kept:  # on_pinned="warn"/"force": the move stands, the originals live on
        lines.append(
            "The move was kept (on_pinned='warn'/'force'); each original is freed when its "
            "holders drop it."
        )
        return "\n".join(lines)
    lines.append(
        "Pass those tensors in AdoptSpec.views (or their places in AdoptSpec.holders), drop the "
        "references, or use on_pinned='warn'/'force'. Nothing was changed."
    )
    return "\n".join(lines)


__all__ = ["AdoptTargets", "Adoptable", "adopt", "FlatPoolError"]
