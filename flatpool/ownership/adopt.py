"""``adopt``: move original storages into pool slices, move every view, prove release.

One batch is one transaction: validate everything, plan and allocate slices, copy all bytes,
move every named tensor object (journaled first), check the pool's invariants, then prove that
each original storage died. Any failure, including an interrupt at any bytecode and a pinned
original in the default mode, puts every tensor and the pool back where they were.

Plain batches (exact ``torch.Tensor``/``nn.Parameter`` targets, one storage each, nothing else
named) take the lean path in :mod:`flatpool.ownership.fastpath`, and batches of sharded
parameters (a plain shard, a memory-less wrapper over a local tensor on it, a holder: what a
fusion group passes) the one in :mod:`flatpool.ownership.sharded`, with the same guarantees.
"""

from __future__ import annotations


import torch

from .. import torch_compat as tc
from .._warn import warn
from ..errors import AdoptionError, ExternalMemoryWarning, InvalidRequestError, InvalidTypeError
from ..registry import Record, make_record
from ..state import PoolState
from .copying import COPY_CHUNK, copy_all
from .faults import checkpoint
from .fastpath import adopt_plain, plain_targets
from .moves import ImplSwap, ImplSwaps, Place, SetMove, counter_group, fresh_like, place_many, swap_many
from .plan import SET, SWAP, WRAP, Member, Plan, discover_members, plan_all
from .proof import held_outside_python
from .sharded import SpecColumns, adopt_sharded, sharded_specs
from .settle import (
    Outside,
    Pins,
    Placed,
    check_placed,
    keep_unreleased,
    outside_by_key,
    release,
    settle_pins,
)
from .spec import AdoptedItem, AdoptionReport, AdoptSpec, OnPinned
from .transaction import Transaction, atomic, byte_view
from .validate import AdoptTargets, normalize


def check_policy(on_pinned: object) -> OnPinned:
    if on_pinned not in ("raise", "warn", "force"):
        raise InvalidRequestError(f"on_pinned must be 'raise', 'warn' or 'force', got {on_pinned!r}")
    return on_pinned


def check_not_in_backward() -> None:
    if tc.in_backward():
        raise AdoptionError(
            "cannot move storages while autograd's backward pass is running (called from a "
            "backward hook?); adopt before forward or after backward and the optimizer step"
        )


def adopt(
    pool: PoolState,
    targets: AdoptTargets | SpecColumns,
    *,
    discover: bool = False,
    on_pinned: OnPinned = "raise",
    into_bound: bool = False,
) -> AdoptionReport:
    """Move ``targets`` into ``pool``; see :meth:`FlatPool.adopt`.

    ``into_bound`` lets specs name slices that already have bindings, which the adoption then
    replaces (re-adoption with explicit specs, :meth:`FlatPool.readopt`).
    """
    check_policy(on_pinned)
    if not isinstance(discover, bool):
        raise InvalidTypeError(f"discover must be a bool, got {discover!r}")
    check_not_in_backward()
    lean = not (discover or into_bound or on_pinned == "force")
    columns = targets if isinstance(targets, SpecColumns) else None
    plain = plain_targets(targets) if lean and columns is None else None
    sharded = ((columns if columns is not None else sharded_specs(targets))
               if lean and plain is None else None)

    def body(txn: Transaction) -> AdoptionReport:
        if plain is not None:
            report = adopt_plain(pool, plain, txn, on_pinned)
            if report is not None:
                return report
        if sharded is not None:
            report = adopt_sharded(pool, sharded, txn, on_pinned)
            if report is not None:
                return report
        given = columns.specs() if columns is not None else targets
        return _adopt(pool, normalize(given), txn, discover, on_pinned, into_bound)  # type: ignore[arg-type]

    return atomic(pool, body)


def _adopt(
    pool: PoolState, specs: list[AdoptSpec], txn: Transaction, discover: bool, on_pinned: OnPinned,
    into_bound: bool,
) -> AdoptionReport:
    plans = plan_all(pool, specs, txn.track, discover, into_bound)
    todo = [p for p in plans if p.slice is None]
    for _ in todo:
        checkpoint("allocate")
    for p, slc in zip(todo, pool.allocate_many([(p.primary.shape, p.primary.dtype) for p in todo])):
        p.slice, p.allocated = slc, True
    _copy(pool, plans, txn)
    members = [m for p in plans for m in p.members]
    outside = _outside(plans, members)
    placed = _move(pool, plans, txn, members)
    del members
    check_placed(pool, placed)
    keys = list(dict.fromkeys(p.key for p in plans))
    by_key: dict[int, Plan] = {}
    for p in plans:
        by_key.setdefault(p.key, p)

    def label(key: int) -> str:
        return by_key[key].label

    def ours() -> list[object]:
        return [plans, *plans, *(p.members for p in plans), *(m for p in plans for m in p.members)]


    def force(pins: Pins) -> None:
        """Also move every Python-visible tensor left on a pinned original."""
        known = {id(r.obj) for r in txn.journal if isinstance(r, (SetMove, ImplSwap))}
        known.update(id(o) for r in txn.journal if isinstance(r, ImplSwaps) for o in r.objs)
        extra: list[Member] = []
        for p in plans:
            if p.key in pins:
                found = discover_members(p.key, p.extent, known)
                p.members += found
                extra += found
        # The tensors found explain links they add to moved impls (a view's base): judge again.
        found_in = [p for p in plans if any(id(m) in {id(e) for e in extra} for m in p.members)]
        held = _outside(found_in, [m for p in found_in for m in p.members])
        for p in found_in:
            outside.pop(p.key, None)
        outside.update(held)
        check_placed(pool, _move(pool, plans, txn, extra))

    pins = settle_pins(txn, keys, label, outside, on_pinned, ours, force)
    keep_unreleased(pool, txn, label, pins, outside)
    pool.registry.bind_many((p.slice.slice_id, _records(p)) for p in plans if p.slice is not None)
    counts = {id(p): len(p.members) for p in plans}
    for p in plans:
        p.members = []  # drop our references before the proof
    expired, late = release(txn, label, pins, on_pinned)
    external = [p.label for p in plans if p.primary.external]
    if external:
        warn(_external_message(external), ExternalMemoryWarning)
    items = []
    for p in plans:
        assert p.slice is not None
        items.append(AdoptedItem(
            slice=p.slice, original_nbytes=txn.nbytes[p.key], released=expired[p.key],
            rebound=counts[id(p)], pinned_by=pins.get(p.key, late.get(p.key, ())),
            external=p.primary.external,
        ))
    return AdoptionReport(tuple(items))


def _outside(plans: list[Plan], members: list[Member]) -> Outside:
    """Members about to be ``set_`` whose impl something outside Python holds (pre-move)."""
    want = {id(m) for m in members}
    sets = [m.obj for m in members if m.kind == SET]
    held = held_outside_python(sets, [m.obj for p in plans for m in p.members])
    return outside_by_key(((p.key, m.obj) for p in plans for m in p.members if id(m) in want),
                          held)


def _copy(pool: PoolState, plans: list[Plan], txn: Transaction) -> None:
    """Copy every original's extent into its slice, in chunks (byte views cost host memory)."""
    flat = pool.byte_buffer()
    checkpoint("copy")
    for first in range(0, len(plans), COPY_CHUNK):
        chunk = plans[first:first + COPY_CHUNK]
        dst = [flat.narrow(0, p.slice.offset, p.extent.nbytes) for p in chunk if p.slice is not None]
        for p, view in zip(chunk, dst):
            if not p.allocated:  # an existing slice: a rollback must give it its old bytes back
                txn.save_bytes(view)
        src = [byte_view(txn.originals[p.key], p.extent.start, p.extent.nbytes) for p in chunk]
        copy_all(dst, src)
        del dst, src


def _move(pool: PoolState, plans: list[Plan], txn: Transaction, members: list[Member]) -> list[Placed]:
    """Journal, then perform, the move of ``members`` (of ``plans``) onto the pool."""
    target = pool.storage
    want = {id(m) for m in members}
    places: list[Place] = []
    swaps: list[tuple[torch.Tensor, torch.Tensor]] = []
    versions: list[tuple[torch.Tensor, int]] = []
    placed: list[Placed] = []
    records: list[SetMove | ImplSwap] = []
    with tc.no_torch_function():
        # Every counter before any move: a view shares its base's counter.
        before = {id(m.obj): tc.impl_version(m.obj) for m in members if not tc.impl_is_meta(m.obj)}
        # Tensors that share a version counter (views of one base, and the base) must still
        # share one after the move: a set_ keeps an impl's counter; a swapped view's new impl
        # takes the counter of the first member of its group.
        counters: dict[int, torch.Tensor] = {}
        for m in members:
            if m.kind == SET:
                counters.setdefault(counter_group(m.obj), m.obj)
        for p in plans:
            assert p.slice is not None
            lo, hi = p.slice.offset, p.slice.end
            for m in p.members:
                if id(m) not in want:
                    continue
                item = tc.impl_element_size(m.obj)
                new = lo + m.byte_offset - p.extent.start
                if new % item:
                    raise AdoptionError(
                        f"cannot place a {tc.impl_dtype(m.obj)} view of {p.label} at byte {new} "
                        f"of the pool: not a multiple of its element size {item}"
                    )
                offset = new // item
                if m.kind == SWAP or m.kind == WRAP:
                    grad = tc.impl_requires_grad(m.obj) and tc.impl_is_leaf(m.obj)
                    if m.kind == WRAP:  # keep the wrapper class's dispatch keys on its new impl
                        fresh = tc.subclass_alias(type(m.obj), fresh_like(
                            m.obj, target, offset, m.size, m.stride, tc.impl_dtype(m.obj)), grad)
                        tc.copy_tensor_flags(m.obj, fresh)
                    else:
                        group = counter_group(m.obj)
                        fresh = fresh_like(m.obj, target, offset, m.size, m.stride,
                                           tc.impl_dtype(m.obj), grad, counters.get(group))
                        counters.setdefault(group, fresh)
                    key = None if m.kind == WRAP else p.key
                    records.append(ImplSwap(
                        m.obj, fresh, key, before.get(id(m.obj), -1),
                        (m.byte_offset // item, m.size, m.stride), tc.impl_dtype(m.obj)))
                    swaps.append((m.obj, fresh))
                    if m.kind == SWAP and id(m.obj) in before:  # its counter reads as before
                        versions.append((m.obj, before[id(m.obj)]))
                else:
                    records.append(SetMove(m.obj, p.key, m.byte_offset // item, m.size, m.stride,
                                           before[id(m.obj)]))
                    places.append((m.obj, target, offset, m.size, m.stride))
                    versions.append((m.obj, before[id(m.obj)]))
                placed.append((m.obj, lo, hi))
    checkpoint("rebind")
    txn.journal.extend(records)  # write-ahead: the record exists before the move
    place_many(places)
    swap_many(swaps)
    tc.set_versions([t for t, _ in versions], [v for _, v in versions])
    return placed


def _records(p: Plan) -> list[Record]:
    assert p.slice is not None
    out = []
    with tc.no_torch_function():
        for m in p.members:
            out.append(make_record(m.obj, m.byte_offset - p.extent.start, m.size, m.stride, tc.impl_dtype(m.obj), m.holder,
                                   m.primary))
    return out


def _external_message(labels: list[str]) -> str:
    return (
        f"{', '.join(labels)}: the original memory belongs to another owner (torch.from_numpy, "
        "torch.frombuffer, shared memory); after adoption the tensor no longer shares it: "
        "writes to the array or buffer are not seen by the tensor, and that owner still holds "
        "its memory (the report counts none of it as freed)"
    )


__all__ = ["adopt", "check_not_in_backward", "check_policy"]
