"""``adopt``: one pipeline moves a batch of originals into pool slices and proves they died.

A batch is one transaction over one pool or several (:func:`adopt_many`): plan (validate every
spec from TensorImpls, work out each original's members; nothing changes), allocate, journal
and move every member, copy the bytes, then check invariants, bind the registry and prove each
original died (:mod:`flatpool.ownership._release`). Any failure, an interrupt included, rolls
everything back. Terms: [Note: flatpool terms] in :mod:`flatpool.ownership`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Protocol, Union

import torch

from .. import _torch_compat as tc
from .._npu_format import check_plain_format, formats_apply
from .._warn import warn
from .._aliasing import ByteRange, check_no_wrapper, check_strided, extent_of, local_tensor, own_storage
from ..errors import (AdoptionError, AliasingError, ExternalMemoryWarning, InvalidRequestError,
                      InvalidTypeError, PoolExhaustedError)
from .._holder import Holder
from .._registry import Binding, binding
from .._requests import check_dtype
from ..slices import Slice
from .._state import PoolState, pool_of_storage
from ._faults import checkpoint
from ._moves import COPY_CHUNK, Dest, Member, Move, byte_view, copy_all, member_of, move
from ._pins import movable_tensors_on
from ._relocate import grow_within
from ._release import (Outside, Pins, Placed, check_all_placed, finish, held_outside_python,
                       outside_by_key)
from ._spec import AdoptedItem, AdoptionReport, AdoptSpec, OnPinned, check_policy
from ._transaction import Transaction, atomic, check_not_in_backward

Adoptable = Union[torch.Tensor, AdoptSpec]
"""One target: a tensor (adopted as ``AdoptSpec(tensor)``, without making that spec), or a spec."""
AdoptTargets = Union[Adoptable, Sequence[Adoptable]]
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def adopt(pool: PoolState, targets: AdoptTargets, *, discover: bool = False,
          on_pinned: OnPinned = "raise", into_bound: bool = False) -> AdoptionReport:
    """See :meth:`FlatPool.adopt`; ``into_bound`` lets specs replace slices' bindings (readopt)."""
    check_policy(on_pinned)
    if not isinstance(discover, bool):
        raise InvalidTypeError(f"discover must be a bool, got {discover!r}")
    check_not_in_backward()
    specs = normalize(targets)
    reports = atomic(lambda txn: adopt_in(txn, [(pool, specs)], discover, on_pinned, into_bound),
                     pool)
    return reports[0]


class Pooled(Protocol):
    """What :func:`adopt_many` reads of a pool (a :class:`flatpool.FlatPool`): its state. The
    engine stands below ``flatpool.pool`` and does not import it."""

    @property
    def _state(self) -> PoolState: ...


def adopt_many(batches: Sequence[tuple[Pooled, Sequence[Adoptable]]], *,
               on_pinned: OnPinned = "raise") -> list[AdoptionReport]:
    """Adopt each batch into its pool, all in one transaction; one report per batch."""
    check_policy(on_pinned)
    check_not_in_backward()
    given = [(pool._state, normalize(list(specs))) for pool, specs in batches if len(specs)]
    pools = [pool for pool, _ in given]
    if not given:
        return [AdoptionReport(()) for _ in batches]
    done = iter(atomic(lambda txn: adopt_in(txn, given, False, on_pinned, False), *pools))
    return [next(done) if len(specs) else AdoptionReport(()) for _, specs in batches]


def normalize(targets: AdoptTargets) -> list[Adoptable]:
    """``targets`` as a list of checked targets (a tensor, a spec, or a list/tuple of them)."""
    if isinstance(targets, (torch.Tensor, AdoptSpec)):
        items: Sequence[Adoptable] = [targets]
    elif isinstance(targets, (list, tuple)):
        items = targets
    else:
        raise InvalidTypeError(
            "adopt() takes a tensor, an AdoptSpec, or a list/tuple of them, got "
            f"{type(targets).__name__}")
    specs: list[Adoptable] = []
    for i, t in enumerate(items):
        if isinstance(t, AdoptSpec):
            if not isinstance(t.tensor, torch.Tensor):
                raise InvalidTypeError(
                    f"target #{i}: AdoptSpec.tensor must be a tensor, got {type(t.tensor).__name__}"
                )
            specs.append(t)
        elif isinstance(t, torch.Tensor):
            specs.append(t)
        else:
            raise InvalidTypeError(
                f"target #{i} is a {type(t).__name__}; adopt() takes tensors or AdoptSpecs")
    if not specs:
        raise InvalidRequestError("adopt() was given nothing to adopt")
    return specs


# -- the pipeline ----------------------------------------------------------------------------
_NOWHERE = ByteRange(0, 0)
_NO_GEOMETRY: tuple[int, tuple[int, ...], tuple[int, ...]] = (0, (), ())


class Original:
    """One original of a batch: its target, bytes, members and slice."""

    __slots__ = ("pool", "tensor", "views", "holders", "index", "primary", "key", "extent",
                 "geometry", "shape", "dtype", "external", "members", "slice", "allocated")

    def __init__(self, pool: PoolState, target: Adoptable, index: int) -> None:
        self.pool, self.index = pool, index
        if isinstance(target, AdoptSpec):
            self.tensor, self.views, self.holders = target.tensor, target.views, target.holders
            self.slice: Slice | None = target.slice
        else:
            self.tensor, self.views, self.holders, self.slice = target, (), (), None
        self.primary: torch.Tensor = local_tensor(self.tensor)
        """The tensor that holds the data (a wrapper's local tensor, else the target's)."""
        self.key = 0
        self.extent = _NOWHERE
        """The bytes of the original the primary reaches (what the slice gets)."""
        self.geometry: tuple[int, tuple[int, ...], tuple[int, ...]] = _NO_GEOMETRY
        """The primary's element offset, size and stride on the original."""
        self.shape: tuple[int, ...] = ()
        """The slice's shape: the primary's when contiguous, else a flat run of its extent."""
        self.dtype = torch.uint8
        self.external = False
        self.members: list[Member] = []
        self.allocated = False

    @property
    def label(self) -> str:
        return label(self.tensor, self.index)

    def __str__(self) -> str:
        """How messages name it (built only when one is: validation names it per check)."""
        return self.label


def adopt_in(txn: Transaction, batches: Sequence[tuple[PoolState, list[Adoptable]]],
             discover: bool, on_pinned: OnPinned, into_bound: bool) -> list[AdoptionReport]:
    """The pipeline (see the module) in ``txn``, each step once over every batch's originals."""
    batch = plan(txn, batches, discover, into_bound)
    every = [o for originals in batch for o in originals]
    _check_disjoint(every)
    grown: dict[int, tuple[str, list[torch.Tensor]]] = {}  # old pool storage key -> name, held
    checkpoint("allocate")
    for (pool, _), originals in zip(batches, batch):
        todo = [o for o in originals if o.slice is None]
        if todo:
            requests = [(o.shape, o.dtype) for o in todo]
            try:
                slices = pool.allocate_many(requests)  # (all or nothing: a failure places none)
            except PoolExhaustedError:
                if not _grows_on_adopt(pool):
                    raise
                key, held = grow_within(txn, pool, requests)
                grown[key] = (f"pool {pool.name!r}'s old storage", held)
                slices = pool.allocate_many(requests)
            for o, slc in zip(todo, slices):
                o.slice, o.allocated = slc, True
    outside = _outside(every)
    outside.update((key, held) for key, (_, held) in grown.items() if held)
    with tc.no_torch_function():  # (before the move: they read the originals)
        aliases = [tc.impl_detach(o.primary) if _copies_into_itself(txn, o) else None
                   for o in every]
    check_all_placed(_move(txn, [(pool, originals) for (pool, _), originals
                                 in zip(batches, batch)]))
    _copy(txn, every, aliases)
    del aliases

    def force(pins: Pins) -> None:
        """Also move every Python-visible tensor left on a pinned original."""
        known = {id(r.obj) for r in txn.journal if isinstance(r, Member)}
        found_in = []
        for o in every:
            if o.key in pins:
                found = discover_members(o.key, o.extent, known)
                o.members += found
                if found:
                    found_in.append(o)
                    check_all_placed(_move(txn, [(o.pool, [o])], found))  # (the bytes are there)
        # The tensors found explain links they add to moved impls (a view's base): judge again.
        held = _outside(found_in)
        for o in found_in:
            outside.pop(o.key, None)
        outside.update(held)

    def bind() -> None:
        for (pool, _), originals in zip(batches, batch):
            pool.registry.bind_many([(o.slice.slice_id, _bindings(o))
                                     for o in originals if o.slice is not None])

    old_storages = {key: name for key, (name, _) in grown.items()}
    del grown  # (what it held must not pin the old storages through the release proof)

    def label_of(key: int) -> str:  # (only a message needs one)
        name = old_storages.get(key)
        return name if name is not None else next(o for o in every if o.key == key).label

    expired, pinned = finish(txn, label_of, outside, on_pinned, bind,
                             lambda: [batch, every, *every, *(o.members for o in every)], force)
    external = [o.label for o in every if o.external]
    if external:
        warn(_external_message(external), ExternalMemoryWarning)
    return [AdoptionReport(_items(txn, originals, expired, pinned)) for originals in batch]


def _items(txn: Transaction, originals: list[Original], expired: dict[int, bool],
           pinned: Pins) -> tuple[AdoptedItem, ...]:
    """What became of each original, in input order (one comprehension, no frame an item)."""
    nbytes = txn.nbytes
    items = [AdoptedItem(o.slice, nbytes[o.key], expired[o.key], len(o.members),
                         pinned.get(o.key, ()), o.external)
             for o in originals if o.slice is not None]
    assert len(items) == len(originals), "every original was given a slice"
    # (a tuple from a list, not from a generator: a tuple a generator fills is resized at its
    # end, which fails with SystemError if another thread's gc.get_objects(), a census, holds it)
    return tuple(items)


def _bindings(o: Original) -> list[Binding]:
    """What the registry keeps of ``o``'s members: each one's place relative to its slice."""
    start, alone = o.extent.start, len(o.members) == 1
    return [binding(m.obj, m.offset * m.dtype.itemsize - start, m.size, m.stride, m.dtype,
                    m.holder, m.primary, alone) for m in o.members]


def _grows_on_adopt(pool: PoolState) -> bool:
    """A materialized growing pool (made without ``capacity=``) that lacks room for a batch
    moves to a larger storage inside the adoption's transaction; a planned one never lacks
    room, a fixed one raises :class:`PoolExhaustedError`."""
    return pool.grows and pool.is_materialized


def _copies_into_itself(txn: Transaction, o: Original) -> bool:
    """``o``'s slice has no bytes to keep and holds exactly its plain contiguous primary: copy
    into the moved primary from a pre-move alias, with no byte views (they cost more than a small
    tensor's copy). Call under ``no_torch_function()``."""
    t = o.primary
    return ((o.allocated or not txn.had_storage(o.pool)) and type(t) in _PLAIN
            and tc.impl_is_contiguous(t) and not t.is_conj() and not t.is_neg())


def _copy(txn: Transaction, originals: list[Original], aliases: list[torch.Tensor | None]) -> None:
    """Copy every original's extent into its slice after the move, in chunks (views cost host
    memory); an existing slice's old bytes are saved first, for a rollback."""
    flats: dict[int, torch.Tensor] = {}  # each pool's bytes, taken once (byte copies only)
    checkpoint("copy")
    for first in range(0, len(originals), COPY_CHUNK):
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for o, alias in zip(originals[first:first + COPY_CHUNK], aliases[first:first + COPY_CHUNK]):
            assert o.slice is not None
            if alias is not None:
                dst.append(o.primary)
                src.append(alias)
                continue
            flat = flats.get(id(o.pool))
            if flat is None:
                flat = flats[id(o.pool)] = o.pool.byte_buffer()
            view = flat.narrow(0, o.slice.offset, o.extent.nbytes)
            if not o.allocated and txn.had_storage(o.pool):
                txn.save_bytes(view)
            dst.append(view)
            src.append(byte_view(txn.originals[o.key], o.extent.start, o.extent.nbytes))
        copy_all(dst, src)
        del dst, src
    del flats
    # Copying into a primary bumped its version counter; the values are the ones it had.
    counted = [m for o in originals for m in o.members if m.version >= 0 and m.obj is o.primary]
    tc.set_versions([m.obj for m in counted], [m.version for m in counted])


def _outside(originals: list[Original]) -> Outside:
    """Members about to be ``set_`` whose impl something outside Python holds (pre-move)."""
    moving = [m.obj for o in originals for m in o.members]
    sets = [m.obj for o in originals for m in o.members if m.how is Move.IN_PLACE]
    held = held_outside_python(sets, moving)
    return outside_by_key(((o.key, m.obj) for o in originals for m in o.members), held)


def _move(txn: Transaction, batches: Sequence[tuple[PoolState, Sequence[Original]]],
          members: list[Member] | None = None) -> list[tuple[PoolState, list[Placed]]]:
    """Journal, then perform, the move of ``members`` (default: all) of every batch; returns
    where each must land, per pool."""
    places: list[Dest] = []
    moving: list[Member] = []
    placed: list[tuple[PoolState, list[Placed]]] = []
    for pool, originals in batches:
        target = pool.storage
        bounds: list[Placed] = []
        for o in originals:
            assert o.slice is not None
            lo = o.slice.offset
            hi = lo + o.extent.nbytes  # (the slice's end: it holds the extent)
            start = o.extent.start
            for m in (o.members if members is None else members):
                item = m.dtype.itemsize
                at = lo + m.offset * item - start
                if at % item:
                    raise AdoptionError(
                        f"cannot place a {m.dtype} view of {o.label} at byte {at} of the pool: "
                        f"not a multiple of its element size {item}")
                moving.append(m)
                places.append((target, at // item, m.size, m.stride))
                bounds.append((m.obj, lo, hi, at // item, m.size, m.stride))
        placed.append((pool, bounds))
        del target
    move(txn.journal, moving, places)
    return placed


# -- planning: the rules, written once ---------------------------------------------------------
def plan(txn: Transaction, batches: Sequence[tuple[PoolState, list[Adoptable]]], discover: bool,
         into_bound: bool) -> list[list[Original]]:
    """Validate every target of every batch and work out its members; nothing is changed."""
    batch = [[Original(pool, target, i) for i, target in enumerate(targets)]
             for pool, targets in batches]
    facts = iter(read_facts([o.primary for originals in batch for o in originals]))
    for (pool, _), originals in zip(batches, batch):
        seen: set[int] = set()
        formats = formats_apply(pool.device)
        for o in originals:
            storage = validate(o, next(facts), formats)
            if id(o.primary) in seen:
                raise InvalidRequestError(f"{o.label} was given twice; name it once")
            seen.add(id(o.primary))
            txn.track(storage, pool, o.key)
            del storage
            slc = o.slice
            if slc is not None:
                pool.check_live(slc)
                if slc.nbytes != o.extent.nbytes or slc.dtype != o.dtype:
                    raise InvalidRequestError(
                        f"{o.label} needs {o.extent.nbytes} bytes of {o.dtype}; slice "
                        f"{slc.slice_id} has {slc.nbytes} bytes of {slc.dtype}")
                if not into_bound and pool.registry.holds(slc.slice_id):
                    raise InvalidRequestError(
                        f"slice {slc.slice_id} already backs adopted tensors; use readopt()")
    for originals in batch:
        for o in originals:
            o.members = members(o, discover)
    return batch


def members(o: Original, discover: bool) -> list[Member]:
    """The members that move with original ``o`` (primary, local tensor, views, what holders
    hold, with ``discover`` every Python tensor on it), each once."""
    if not discover and _moves_alone(o):
        # A plain tensor or parameter named alone (most batches): below would find only itself.
        return [Member(o.tensor, Move.IN_PLACE, o.key, *o.geometry, o.dtype,
                       tc.impl_version(o.tensor), None, True)]
    unique: dict[int, Member] = {}  # each object once, by identity

    def add(more: list[Member], holder: Holder | None = None) -> None:
        for m in more:
            prev = unique.setdefault(id(m.obj), m)
            prev.holder = prev.holder or m.holder or holder
            prev.primary = prev.primary or m.primary

    add(_expand(o.tensor, o.key, True))
    for v in o.views:
        if id(v) in unique:
            continue
        more = _expand(v, o.key, False)
        if not more:
            raise InvalidRequestError(f"a view given for {o.label} does not share its storage")
        add(more)
    for h in o.holders:
        held = _held(h, o)
        known = unique.get(id(held))
        if known is not None:  # (what a holder holds is often the primary itself)
            known.holder = known.holder or h
            continue
        more = _expand(held, o.key, False)
        if not more:
            raise InvalidRequestError(
                f"holder {h.describe()} of {o.label} does not hold a tensor on its storage")
        add(more, h)
    if discover:
        unique.update((id(m.obj), m) for m in discover_members(o.key, o.extent, unique))
    add(_computed_bases(o, unique.values()))
    _keep_views_with_their_base(unique.values())
    start, end = o.extent.start, o.extent.end
    for m in unique.values():
        lo = m.byte_offset
        hi = lo + _span(m.size, m.stride) * m.dtype.itemsize
        if m.how is not Move.ONTO_LOCAL and not start <= lo <= hi <= end:
            raise InvalidRequestError(
                f"a view of {o.label} reaches bytes outside it ({lo}..{hi} vs {start}..{end}); "
                "adopt the tensor it is a view of instead")
    return list(unique.values())


def _moves_alone(o: Original) -> bool:
    """``o``'s target is only an exact, non-view tensor or parameter: its one member is itself."""
    t = o.tensor
    return (type(t) in _PLAIN and o.primary is t and not o.views and not o.holders
            and tc.impl_base(t) is None)


def _on_key(t: torch.Tensor, key: int) -> bool:
    """``t``'s own storage is original ``key``. Call under ``no_torch_function()``."""
    try:
        return tc.storage_address(t) == key
    except (RuntimeError, NotImplementedError, TypeError):  # a layout with no one storage
        return False


def _member(obj: torch.Tensor, key: int, primary: bool, holder: Holder | None = None) -> Member:
    """``obj``'s record: it moves off its base when that base lies on the original too.
    Call under ``no_torch_function()``."""
    base = tc.impl_base(obj)
    how = Move.OFF_BASE if base is not None and _on_key(base, key) else Move.IN_PLACE
    del base
    return member_of(obj, how, key, holder, primary)


def _expand(obj: torch.Tensor, key: int, primary: bool) -> list[Member]:
    """The members behind ``obj`` that move with original ``key``: itself, its local tensor,
    or (a storage-less ``_make_subclass`` wrapper) itself onto its local tensor's place."""
    inner = getattr(obj, "_local_tensor", None)
    out: list[Member] = []
    with tc.no_torch_function():  # (every read below is of a TensorImpl)
        on_key = _on_key(obj, key)
        if on_key:
            out.append(_member(obj, key, primary))
        if isinstance(inner, torch.Tensor) and inner is not obj and _on_key(inner, key):
            local = _member(inner, key, primary, Holder(obj, "_local_tensor"))
            out.append(local)
            if not on_key and tc.impl_is_meta(obj):
                # a wrapper that lost its storage (deferred init): give it the local's place
                out.append(Member(obj, Move.ONTO_LOCAL, None, local.offset, local.size,
                                  local.stride, local.dtype, -1, None, primary))
    return out


def _held(h: Holder, o: Original) -> torch.Tensor:
    """A holder's tensor, after checking that it can be read *and* assigned (without writing)."""
    try:
        value = h.get()
    except (AttributeError, KeyError, IndexError, TypeError) as exc:
        raise InvalidRequestError(f"holder {h.describe()} of {o.label} cannot be read: {exc}") from exc
    if not isinstance(value, torch.Tensor):
        raise InvalidRequestError(
            f"holder {h.describe()} of {o.label} holds a {type(value).__name__}, not a tensor")
    why = h.unassignable()  # from the owner's type: writing would run the place's setter
    if why is not None:
        raise InvalidTypeError(
            f"holder {h.describe()} of {o.label} cannot be assigned ({why}): name a place "
            "flatpool can write (an attribute, a list or dict item), not a read-only property "
            "or a tuple slot")
    return value


def discover_members(key: int, extent: ByteRange, known: Iterable[int]) -> list[Member]:
    """Every Python-visible tensor on original ``key`` inside ``extent`` (a gc scan) that is
    safe to move (:func:`~._pins.movable_tensors_on`)."""
    found: list[Member] = []
    candidates = movable_tensors_on(key, known)
    for t in candidates:
        with tc.no_torch_function():
            if extent.contains(extent_of(t)):
                found.append(_member(t, key, False))
    del candidates
    return found


def _keep_views_with_their_base(members: Iterable[Member]) -> None:
    """A view whose base moves in place moves in place too, keeping the impl a graph may have
    saved; only a view whose base stays behind needs the impl swap."""
    members = list(members)
    off_base = [m for m in members if m.how is Move.OFF_BASE]
    if not off_base:
        return
    moving = {tc.impl_address(m.obj) for m in members if m.how is Move.IN_PLACE}
    with tc.no_torch_function():
        for m in off_base:
            base = tc.impl_base(m.obj)
            if base is not None and tc.impl_address(base) in moving:
                m.how, m.impl = Move.IN_PLACE, 0
            del base


def _computed_bases(o: Original, members: Iterable[Member]) -> list[Member]:
    """The *computed* bases (``(x * 2).view(-1)``'s product, often held only as ``._base``) of
    views that would move off them: each moves in place with its views, as if named in
    ``AdoptSpec.views``, so the views keep their ``grad_fn`` (the impl swap drops it, cutting
    the gradient to ``x``). A leaf base (HyperParallel's ``local.view(-1)``) has no history to
    lose and stays behind. A computed base reaching outside ``o`` cannot move: refused."""
    bases: dict[int, Member] = {}
    known = {id(m.obj) for m in members}
    with tc.no_torch_function():
        for m in members:
            base = tc.impl_base(m.obj) if m.how is Move.OFF_BASE else None
            if base is None or tc.impl_is_leaf(base) or id(base) in known or id(base) in bases:
                continue
            if not o.extent.contains(extent_of(base)):
                computed_by = type(base.grad_fn).__name__
                who = o.label if m.primary else f"a view named with {o.label}"
                raise InvalidRequestError(
                    f"{who} is a view of a computed tensor ({computed_by}) that reaches bytes "
                    "outside it, so that base cannot move with it, and moving the view off it "
                    "would cut its gradient; adopt the leaf it was computed from, or compute "
                    "the value without a graph (under torch.no_grad()) and adopt that")
            bases[id(base)] = _member(base, o.key, False)
            del base
    return list(bases.values())


def _span(size: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements from a tensor's first to its last (0 when it has none)."""
    span = 1
    for n, step in zip(size, stride):
        if n == 0:
            return 0
        span += (n - 1) * abs(step)
    return span


def _check_disjoint(originals: list[Original]) -> None:
    """Primaries on one storage must not overlap, and no slice may be used twice."""
    by_key: dict[int, list[Original]] = {}
    for o in originals:
        by_key.setdefault(o.key, []).append(o)
    for group in by_key.values():
        if len(group) == 1:
            continue
        group.sort(key=lambda o: o.extent.start)
        for a, b in zip(group, group[1:]):
            if a.extent.intersects(b.extent):
                raise AliasingError(
                    f"{a.label} and {b.label} share bytes of one storage; adopt one and pass the "
                    "other in its AdoptSpec.views",
                    [(a.label, b.label)])
    given = [(id(o.pool), o.slice.slice_id) for o in originals if o.slice is not None]
    if len(given) != len(set(given)):
        raise InvalidRequestError("two AdoptSpecs name the same target slice")


# -- validation: what may be adopted -------------------------------------------------------------
def label(t: torch.Tensor, i: int) -> str:
    """How errors name target ``i``: its type, local (TensorImpl) shape and dtype."""
    try:
        inner = local_tensor(t)
        with tc.no_torch_function():
            size, dtype = tuple(tc.impl_size(inner)), tc.impl_dtype(inner)
        return f"#{i} {type(t).__name__}{size} {str(dtype).replace('torch.', '')}"
    except Exception:  # a tensor too broken to describe still gets a name
        return f"#{i} {type(t).__name__}"


EXACT_OVERLAP_ELEMENTS = 1 << 22
"""Up to this many elements, strides that interleave (sizes (2, 3), strides (3, 2)) are checked
element by element; beyond it such a tensor is refused as unproven."""


def overlap(t: torch.Tensor) -> str | None:
    """Why two index tuples of ``t`` may reach one element (``"expanded"``, ``"shared"``,
    ``"unproven"``), else ``None``. Call under no_torch_function."""
    dims = sorted((st, sz) for sz, st in zip(tc.impl_size(t), tc.impl_stride(t)) if sz > 1)
    if any(st == 0 for st, _ in dims):
        return "expanded"
    span = 1
    for st, sz in dims:
        if st < span:
            break  # interleaved strides: nested spans no longer decide it
        span = st * sz
    else:
        return None
    n = math.prod(sz for _, sz in dims)
    if n > EXACT_OVERLAP_ELEMENTS:
        return "unproven"
    offsets = torch.zeros((), dtype=torch.int64)
    for st, sz in dims:
        offsets = (offsets.unsqueeze(-1) + torch.arange(sz, dtype=torch.int64) * st).flatten()
    return "shared" if int(torch.unique(offsets).numel()) < n else None


def data_storage(t: torch.Tensor, extent: ByteRange, what: object) -> torch.UntypedStorage:
    """The storage that holds ``t``'s bytes, refusing a placeholder or a storage smaller than
    ``t``'s extent (FSDP's ``resize_(0)``) before anything moves."""
    if type(t) in _PLAIN:  # (no __torch_function__ to stop)
        storage = tc.impl_untyped_storage(t)
    else:
        with tc.no_torch_function():
            storage = tc.impl_untyped_storage(t)
    if tc.is_functional(t):
        raise InvalidTypeError(
            f"{what} is a functional tensor (made by torch.func.functionalize or compile "
            "tracing): its storage is a placeholder and its data lives in the tensor it wraps; "
            "adopt the real tensor, outside the functionalized region")
    # (an exact tensor's storage is on its own device, not meta: only a subclass can say
    # otherwise of itself, a FakeTensor)
    if type(t) not in _PLAIN and storage.device.type == "meta":
        raise InvalidTypeError(
            f"{what} has only metadata (a {type(t).__name__} made under FakeTensorMode, or "
            "another tensor on a meta storage): there is no data to adopt; adopt real tensors "
            "outside the fake mode")
    if not tc.storage_pointer_valid(storage):
        raise InvalidTypeError(
            f"{what} ({type(t).__name__}) has no real storage (a placeholder that crashes when "
            "read): adopt the tensor that holds its data")
    if storage.nbytes() < extent.end:
        raise InvalidRequestError(
            f"{what} reaches byte {extent.end} of a storage that holds only "
            f"{storage.nbytes()} bytes (freed with untyped_storage().resize_(), as FSDP does "
            "for unsharded parameters): there is no data to adopt; resize the storage back "
            "(or let the framework re-materialize it) first, or adopt the tensor that has the data")
    return storage


Facts = tuple[bool, bool, torch.device, int, bool, torch.dtype, int, tuple[int, ...],
              tuple[int, ...], bool]
"""What the rules read of a primary's TensorImpl: quantized, meta, device, element count,
inference, dtype, storage offset, size, stride, contiguous."""
_READERS = (tc.impl_is_quantized, tc.impl_is_meta, tc.impl_device, tc.impl_numel,
            tc.impl_is_inference, tc.impl_dtype, tc.impl_storage_offset, tc.impl_size,
            tc.impl_stride, tc.impl_is_contiguous)


def read_facts(ts: list[torch.Tensor]) -> list[Facts | None]:
    """Each tensor's :data:`Facts` (``None`` when not strided), read a fact at a time over the
    batch: a C-level pass each, not a Python frame per tensor per fact."""
    with tc.no_torch_function():
        dense = [layout is torch.strided and not nested for layout, nested
                 in zip(map(tc.impl_layout, ts), map(tc.impl_is_nested, ts))]
        readable = [t for t, ok in zip(ts, dense) if ok]
        facts = zip(*[list(map(read, readable)) for read in _READERS])  # (sizes: torch.Size)
        result = [next(facts) if ok else None for ok in dense]
        return result  # not `return f()`: see flatpool._interrupts


def validate(o: Original, facts: Facts | None, formats: bool = True) -> torch.UntypedStorage:
    """Check ``o``'s primary against the rules, fill in what adoption needs, return its storage.
    ``formats``: the device may hold private storage formats (NPU)."""
    inner = o.primary
    if facts is None:
        check_strided(inner, o)
        raise AssertionError("read_facts reads every strided tensor")  # pragma: no cover
    if type(inner) not in _PLAIN:  # (an exact tensor or parameter is no wrapper subclass)
        check_no_wrapper(inner, o)
    quantized, meta, device, numel, inference, dtype, offset, size, stride, contiguous = facts
    if quantized:
        check_dtype(dtype, o)  # raises the same error as allocate()
    if meta:
        raise InvalidRequestError(
            f"{o} is a meta tensor (or a fake one) and has no data to adopt; use "
            "pool.materialize_into() to give it pool storage")
    pool = o.pool
    if device != pool.device:
        raise InvalidRequestError(
            f"{o} is on {device} but pool {pool.name!r} is on {pool.device}; "
            "move it to the pool's device first or use a pool on its device")
    if formats:  # (only an NPU has private storage formats, and o is on the pool's device)
        check_plain_format(inner, o, device)
    if numel == 0:
        raise InvalidRequestError(f"{o} is empty: zero-size tensors stay outside the pool")
    if inference:
        raise InvalidRequestError(
            f"{o} is an inference tensor (made under torch.inference_mode()); it "
            "cannot be rebound in place: adopt a clone() made outside inference mode")
    if not _leaf_or_view(o.tensor):
        with tc.no_torch_function():
            computed_by = type(o.tensor.grad_fn).__name__
        raise InvalidRequestError(
            f"{o} is not a leaf of autograd: it was computed "
            f"({computed_by}) from tensors that require grad, and its "
            "graph may still read its storage. Adopt the leaf it was computed from (a "
            "parameter, a buffer), or compute it without a graph (under torch.no_grad(), or "
            "adopt a .detach()ed value once nothing else refers to the original)")
    o.dtype = check_dtype(dtype, o)
    size, stride = tuple(size), tuple(stride)  # (torch.Size: plain tuples are kept)
    o.geometry = (offset, size, stride)
    item = dtype.itemsize
    if contiguous:  # (its span is its element count)
        o.extent = ByteRange(offset * item, (offset + numel) * item)
        o.shape = size
    else:
        with tc.no_torch_function():
            why = overlap(inner)
            o.extent = extent_of(inner)
        if why == "expanded":
            raise InvalidRequestError(
                f"{o} overlaps itself (an expanded/broadcast view, strides {stride}); adopt "
                "the tensor it was expanded from")
        if why == "shared":
            raise InvalidRequestError(
                f"{o} overlaps itself (strides {stride} over sizes {size} reach some elements "
                "twice: an as_strided view); adopt the tensor it views, or a contiguous() copy")
        if why == "unproven":
            raise InvalidRequestError(
                f"{o} has interleaved strides {stride} over sizes {size}: more than "
                f"{EXACT_OVERLAP_ELEMENTS} elements to check that no two share memory; adopt "
                "a contiguous() copy")
        o.shape = (o.extent.nbytes // item,)
    storage = data_storage(inner, o.extent, o)
    key = o.key = tc.storage_key(storage)
    if inner is not o.tensor:
        wrapper = own_storage(o.tensor)
        if wrapper is not None and tc.storage_key(wrapper) != key:
            raise InvalidRequestError(
                f"{o} has a storage of its own that is not its _local_tensor's: the "
                "wrapper does not view its shard, and adopting the local tensor would leave the "
                "wrapper reading other memory; rebuild the wrapper around its local tensor")
    owner = pool_of_storage(key)
    if owner is not None and o.extent.end <= owner.capacity:
        where = "this pool" if owner is pool else f"pool {owner.name!r}"
        raise InvalidRequestError(
            f"{o} already lives in {where}; use readopt() to bring moved members back")
    # Memory another owner may keep (from_numpy, frombuffer, share_memory_): torch marks it
    # non-resizable but does not say which allocator made a storage, so every non-resizable
    # storage counts as external (the safe answer: nothing is reported freed).
    o.external = not storage.resizable() or (device.type == "cpu" and storage.is_shared())
    return storage


def _leaf_or_view(t: torch.Tensor) -> bool:
    """Whether ``t`` is an autograd leaf or a view, not a computed value (``w * 2``): a graph
    that saved a view's data would hold the original, and the release proof would refuse."""
    if type(t) in _PLAIN:
        return tc.impl_is_leaf(t) or tc.impl_base(t) is not None
    with tc.no_torch_function():
        ok = tc.impl_is_leaf(t) or tc.impl_base(t) is not None
    return ok  # (not a return inside the block: see flatpool._interrupts)


def _external_message(labels: list[str]) -> str:
    return (
        f"{', '.join(labels)}: the original memory belongs to another owner (torch.from_numpy, "
        "torch.frombuffer, shared memory); after adoption the tensor no longer shares it: "
        "writes to the array or buffer are not seen by the tensor, and that owner still holds "
        "its memory (the report counts none of it as freed)"
    )
