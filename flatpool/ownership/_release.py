"""The end of every move: the pools' invariants, the pins, the commit and the release proof.

Every operation calls :func:`check_placed`, then :func:`finish`:

1. **pins**, before the commit while the rollback can still be exact: users of an original
   beyond the transaction's own, counted without a gc scan (:func:`storage_pinned`), plus
   owners of a moved member's TensorImpl Python cannot see, read before the move
   (:func:`held_outside_python`: a DLPack consumer and a graph that saved the tensor look
   alike, so both pin). Pinned originals are named by a gc scan; then ``on_pinned`` decides.
2. **the release proof**: commit, drop every reference to the originals, and ask a weak
   reference to each whether it died; under "raise" a survivor undoes the operation.
"""

from __future__ import annotations

import gc
import math
import operator
import os
import time
from collections.abc import Callable, Iterable, Sequence, Sized
from itertools import repeat
from typing import TypeVar

import torch

from .. import _torch_compat as tc
from .._aliasing import extent_of
from .._warn import warn
from ..errors import (
    InvalidRequestError, InvalidTypeError, OriginalKeptAliveWarning, PinnedStorageError,
    PoolInvariantError,
)
from .._state import PoolState
from .._unreleased import UnreleasedOriginal
from ._faults import checkpoint
from .._interrupts import run_undo
from ._moves import Member, Move
from ._pins import name_pins, only_cxx
from ._spec import OnPinned
from ._transaction import Transaction

_H = TypeVar("_H", bound=Sized)

Pins = dict[int, tuple[str, ...]]
"""Pinned originals: storage key -> what holds it."""
Labels = Callable[[int], str]
"""How messages name the original with a given storage key (built only when needed)."""
Placed = tuple[torch.Tensor, int, int, int, tuple[int, ...], tuple[int, ...]]
"""``(member, slice start, slice end)`` in bytes of the pool, and where the move put it:
``(element offset, size, stride)``."""
Outside = dict[int, list[torch.Tensor]]
"""Per original key, the moved members something outside Python holds (found before the move
by :func:`held_outside_python`)."""

OUTSIDE_PYTHON = (
    "held outside Python (a DLPack consumer such as numpy.from_dlpack, or a C++ holder such as "
    "an autograd graph that saved it): moving it would free memory that holder may still read"
)


# -- the pools' invariants -------------------------------------------------------------------
def check_placed(pool: PoolState, placed: Sequence[Placed]) -> None:
    """Raise :class:`PoolInvariantError` unless the pool is consistent and every moved member,
    read back from its TensorImpl, sits exactly where the move put it."""
    check_all_placed([(pool, placed)])


def check_all_placed(moved: Sequence[tuple[PoolState, Sequence[Placed]]]) -> None:
    """:func:`check_placed` for each ``(pool, placed)``, in one pass."""
    expected = []
    for pool, placed in moved:
        pool.check_invariants()
        key = pool.storage_key
        expected += [(key, offset, size, stride) for _, _, _, offset, size, stride in placed]
    objs = [p[0] for _, placed in moved for p in placed]
    with tc.no_torch_function():  # (one pass a fact over every member)
        landed = list(zip(map(tc.storage_address, objs), map(tc.impl_storage_offset, objs),
                          map(tuple, map(tc.impl_size, objs)),
                          map(tuple, map(tc.impl_stride, objs))))
    del objs
    if landed == expected:
        return
    for pool, placed in moved:
        _check_each(pool, placed)


def _check_each(pool: PoolState, placed: Sequence[Placed]) -> None:
    """The full verdict, member by member: where one landed instead."""
    key = pool.storage_key
    with tc.no_torch_function():
        for t, lo, hi, offset, size, stride in placed:
            rng = extent_of(t)
            start, end = rng.start, rng.end
            if tc.storage_address(t) != key or start < lo or end > hi:
                raise PoolInvariantError(
                    f"a {type(t).__name__} moved into pool {pool.name!r} would sit at bytes "
                    f"{start}..{end}, outside its slice {lo}..{hi} (its geometry is not what it "
                    "claimed): nothing was changed")
            if (tc.impl_storage_offset(t), tuple(tc.impl_size(t)),
                    tuple(tc.impl_stride(t))) != (offset, size, stride):
                raise PoolInvariantError(  # the geometry is in bounds, yet not what was asked
                    f"a {type(t).__name__} moved into pool {pool.name!r} does not sit where it "
                    "was placed: nothing was changed")


# -- owners outside Python, read before the move ---------------------------------------------
# A collective's worker thread can hold a tensor it just wrote for a moment after wait()
# returned (gloo), and goes away by itself; a DLPack consumer does not. So look again with a
# doubling back-off, up to a bounded total.
CXX_HOLDER_WAIT_ENV = "FLATPOOL_CXX_HOLDER_WAIT_S"
"""Environment variable that sets :func:`cxx_holder_wait` at import (seconds)."""
DEFAULT_CXX_HOLDER_WAIT_S = 0.25
"""How long, in total, a TensorImpl owner outside Python may take to go away by itself."""
_FIRST_DELAY_S = 0.0005
_MAX_DELAY_S = 0.032


def _checked_wait(seconds: object, what: str) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise InvalidTypeError(f"{what} must be a number of seconds, got {seconds!r}")
    value = float(seconds)
    if not math.isfinite(value) or value < 0:
        raise InvalidRequestError(f"{what} must be a finite number of seconds >= 0, got {seconds!r}")
    return value


def _wait_from_env() -> float:
    raw = os.environ.get(CXX_HOLDER_WAIT_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_CXX_HOLDER_WAIT_S
    try:
        return _checked_wait(float(raw), CXX_HOLDER_WAIT_ENV)
    except ValueError:
        raise InvalidRequestError(
            f"{CXX_HOLDER_WAIT_ENV}={raw!r} is not a number of seconds (e.g. 0.25)") from None


_wait_s = _wait_from_env()


def cxx_holder_wait() -> float:
    """Seconds an adoption waits for an owner outside Python to let go before it pins."""
    return _wait_s


def set_cxx_holder_wait(seconds: float) -> float:
    """Set :func:`cxx_holder_wait` (0: one bare yield only); returns the previous value."""
    global _wait_s
    value = _checked_wait(seconds, "the C++ holder wait")
    previous, _wait_s = _wait_s, value
    return previous


LOAD_SCALE_MAX = 8.0
"""The most a loaded machine stretches the wait by (2 s at the default 0.25 s)."""


def load_factor(load: float | None = None, cpus: int | None = None) -> float:
    """How many times longer to wait on a loaded machine (load average per usable CPU, 1 to
    :data:`LOAD_SCALE_MAX`): the holder is usually a thread that only needs a time slice."""
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (OSError, AttributeError):  # not on this platform
            return 1.0
    if cpus is None:
        affinity = getattr(os, "sched_getaffinity", None)
        cpus = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    return min(LOAD_SCALE_MAX, max(1.0, load / max(cpus, 1)))


def effective_cxx_holder_wait() -> float:
    """What one wait lasts now: :func:`cxx_holder_wait` times :func:`load_factor`."""
    return cxx_holder_wait() * load_factor()


def settle_delays(limit: float | None = None) -> list[float]:
    """The sleeps of one wait: a bare yield, then 0.5 ms doubling up to 32 ms, up to ``limit``."""
    total = effective_cxx_holder_wait() if limit is None else limit
    out = [0.0]
    left, delay = total, _FIRST_DELAY_S
    while left > 1e-9:
        step = min(delay, left)
        out.append(step)
        left -= step
        delay = min(delay * 2, _MAX_DELAY_S)
    return out


def look_again(held: _H, recheck: Callable[[_H], _H]) -> _H:
    """Re-check ``held`` with the back-off of :func:`settle_delays` until ``recheck(held)`` is
    empty or the wait is over; the last answer."""
    for delay in settle_delays():
        if not held:
            break
        time.sleep(delay)
        held = recheck(held)
    return held


def held_outside_python(
    candidates: Iterable[torch.Tensor], views: Iterable[torch.Tensor] = ()
) -> list[torch.Tensor]:
    """The ``candidates`` whose TensorImpl has owners beyond its Python object, the links of the
    known ``views`` and a live graph's grad accumulator, still there after :func:`look_again`.
    Call it *before* the move: ``set_`` detaches a leaf from its grad accumulator."""
    candidates = list(candidates)
    if all(map(operator.eq, map(tc.tensor_impl_users, candidates), repeat(1))):
        return []  # (every expected count is at least the Python object's own: none is held)
    children: dict[int, int] = {}
    with tc.no_torch_function():
        for v in views:
            base = tc.impl_base(v)
            if base is not None:
                a = tc.impl_address(base)
                children[a] = children.get(a, 0) + tc.view_links(v, base)
            del base
    out = _held(candidates, children)
    if out:
        out = look_again(out, lambda held: _held(held, children))
    return out


def _held(candidates: Iterable[torch.Tensor], children: dict[int, int]) -> list[torch.Tensor]:
    out = []
    for t in candidates:
        expected = 1 + children.get(tc.impl_address(t), 0)
        users = tc.tensor_impl_users(t)
        if users > expected and _accumulator_holds(t):
            expected += 1  # the grad accumulator of a live graph: it follows the move
        if users > expected:
            out.append(t)
    return out


def _accumulator_holds(t: torch.Tensor) -> bool:
    """A live graph's AccumulateGrad node holds this leaf's impl (benign). Asking for the node
    creates it when it did not exist, raising the use count: that tells the cases apart."""
    with tc.no_torch_function():
        if not (tc.impl_requires_grad(t) and tc.impl_is_leaf(t)):
            return False
    before = tc.tensor_impl_users(t)
    node = torch.autograd.graph.get_gradient_edge(t).node
    existed = tc.tensor_impl_users(t) == before
    del node
    return existed


def outside_by_key(pairs: Iterable[tuple[int, torch.Tensor]], held: Sequence[torch.Tensor]) -> Outside:
    """Group the ``held`` members by the original key they move from."""
    ids = {id(t) for t in held}
    out: Outside = {}
    if ids:
        for key, t in pairs:
            if id(t) in ids:
                out.setdefault(key, []).append(t)
    return out


# -- storage pins, counted after the move ----------------------------------------------------
def _old_impls(txn: Transaction) -> dict[int, list[torch.Tensor]]:
    """Per original key, the old impls the transaction holds (members swapped off their base)."""
    out: dict[int, list[torch.Tensor]] = {}
    for rec in txn.journal:
        if (isinstance(rec, Member) and rec.how is not Move.IN_PLACE and rec.key is not None
                and rec.fresh is not None):
            out.setdefault(rec.key, []).append(rec.fresh)
    return out


def storage_pinned(txn: Transaction, key: int, olds: Sequence[torch.Tensor] = ()) -> bool:
    """Original ``key`` has a user beyond ``olds``, the old impls the transaction holds on it."""
    known: dict[int, torch.Tensor] = {}
    bases: dict[int, torch.Tensor] = {}
    address, is_meta, base_of = tc.storage_address, tc.impl_is_meta, tc.impl_base
    with tc.no_torch_function():  # every old impl and its base in one block (meta: none)
        for old in olds:
            if not is_meta(old) and address(old) == key:
                known[tc.impl_address(old)] = old
                found = base_of(old)
                if found is not None and not is_meta(found) and address(found) == key:
                    bases.setdefault(tc.impl_address(found), found)
                found = None
    for addr in bases:  # a base that is also a known impl counts once
        known.pop(addr, None)
    storage = txn.originals[key]
    users = tc.storage_users(storage)
    extra = users - 1 - len(known) - len(bases)
    # An old impl someone else also owns (a graph that saved the view we moved off it) stays
    # on the original after we let go of it.
    extra += sum(max(0, tc.tensor_impl_users(old) - 1) for old in known.values())
    # Python references to the storage object: the originals entry and our local, plus the one
    # torch keeps while the storage has other users (PyObject preservation, torch 2.10+).
    extra += max(0, tc.python_refs(storage) - 2 - (tc.PRESERVED_STORAGE_REF if users > 1 else 0))
    del storage
    for addr in list(bases):
        base = bases[addr]
        # The bases entry and our local, plus preservation while views link to it.
        preserved = tc.PRESERVED_TENSOR_REF if tc.tensor_impl_users(base) > 1 else 0
        extra += max(0, tc.python_refs(base) - 2 - preserved)
        del base
    return extra > 0


def pinned_keys(txn: Transaction, keys: Iterable[int], outside: Outside) -> dict[int, bool]:
    """The pinned originals: key -> pinned by a storage user (else only outside Python)."""
    olds = _old_impls(txn)
    originals, users, refs = txn.originals, tc.storage_users, tc.python_refs
    out: dict[int, bool] = {}
    for key in keys:
        if key in olds:
            by_storage = storage_pinned(txn, key, olds[key])
        else:  # the common case, inline: only our storage object uses it
            storage = originals[key]
            by_storage = users(storage) != 1 or refs(storage) != 2
            del storage
            if by_storage:  # the full count says why (and sees bases)
                by_storage = storage_pinned(txn, key)
        if by_storage or key in outside:
            out[key] = by_storage
    return out


def own_ids(txn: Transaction, *more: object) -> set[int]:
    """Ids of objects the operation itself holds, for pin scans to skip."""
    ids = {id(txn.originals), id(txn.journal)} | {id(m) for m in more}
    for rec in txn.journal:
        ids.add(id(rec))
        if isinstance(rec, Member) and rec.fresh is not None:
            ids.add(id(rec.fresh))
    return ids


def _name_all(txn: Transaction, found: dict[int, bool], skip: Callable[[], Iterable[object]],
              ) -> Pins:
    """Name what holds each pinned original (a gc scan: only on this path)."""
    ours = own_ids(txn, *skip())
    # An unnamed view on the original also adds a link to its base's impl: when the storage
    # itself is pinned, the holders gc names explain both.
    return {key: name_pins(txn.originals[key], ours, [] if by_storage else [OUTSIDE_PYTHON])
            for key, by_storage in found.items()}


def _let_cxx_holders_go(txn: Transaction, outside: Outside, found: dict[int, bool], pins: Pins,
                        skip: Callable[[], Iterable[object]]) -> tuple[dict[int, bool], Pins]:
    """Wait (bounded) for the storage pins no Python object explains (a collective's worker
    thread, on another impl of the same storage); ``(found, pins)`` after it."""
    waiting = {k for k, by_storage in found.items() if by_storage and only_cxx(pins[k])}
    if not waiting:
        return found, pins
    left = look_again(waiting, lambda still: set(pinned_keys(txn, still, outside)))
    if left == waiting:
        return found, pins  # nothing let go: the names stand
    found = {k: v for k, v in found.items() if k not in waiting or k in left}
    return found, (_name_all(txn, found, skip) if found else {})


def settle_pins(txn: Transaction, label: Labels, outside: Outside, on_pinned: OnPinned,
                skip: Callable[[], Iterable[object]] = tuple,
                force: Callable[[Pins], None] | None = None) -> Pins:
    """Apply the ``on_pinned`` policy; returns what stays pinned (empty when all is clear)."""
    checkpoint("release")
    keys = list(txn.originals)
    found = pinned_keys(txn, keys, outside)
    if found:  # unreachable cycles (a kept traceback) may be all that holds it: collect, retry
        gc.collect()
        found = pinned_keys(txn, keys, outside)
    pins = _name_all(txn, found, skip) if found else {}
    if pins:
        found, pins = _let_cxx_holders_go(txn, outside, found, pins, skip)
    if found and on_pinned == "force" and force is not None:
        force(pins)
        found = pinned_keys(txn, keys, outside)
        pins = _name_all(txn, found, skip) if found else {}
    if not found:
        return {}
    if on_pinned == "raise":
        named = _labelled(pins, label)
        raise PinnedStorageError(pinned_message(named), named)
    warn(pinned_message(_labelled(pins, label), kept=True), OriginalKeptAliveWarning)
    return pins


def _labelled(pins: Pins, label: Labels) -> dict[str, tuple[str, ...]]:
    return {label(k): v for k, v in pins.items()}


def _keep_unreleased(txn: Transaction, label: Labels, pins: Pins, outside: Outside) -> None:
    """Record what a warn/force operation left alive; the pool keeps alive each original held
    outside Python until it lets go."""
    for key, reasons in pins.items():
        storage = txn.originals[key]
        # Kept only where nothing Python can see holds it: then the pool is all that does.
        held = outside.get(key, []) if OUTSIDE_PYTHON in reasons else []
        info = UnreleasedOriginal(
            label=label(key), nbytes=txn.nbytes[key], address=storage.data_ptr(),
            device=str(storage.device), kept_by_pool=bool(held))
        txn.into[key].trace_unreleased(info, storage, held[0] if held else None)
        del storage


def _prove(txn: Transaction, label: Labels, pinned: Pins, on_pinned: OnPinned,
           ) -> tuple[dict[int, bool], Pins]:
    """Commit, let go of the originals, prove which died; under "raise" a late survivor undoes
    the operation (dead originals rebuilt from the pool's copy) and raises."""
    checkpoint("release")
    txn.commit()
    expired = txn.release()
    if not all(expired.values()):  # cyclic garbage is no pin
        gc.collect()
        expired = txn.expired()
    late_keys = [k for k, dead in expired.items() if not dead and k not in pinned]
    if not late_keys:
        return expired, {}
    # Something we could not count (a Python reference to a moved object's old impl) kept an
    # original alive. Undo first so the holders are back on the original and nameable.
    survivors = {k: tc.weak_upgrade(txn.weak[k]) for k in late_keys}
    if on_pinned == "raise":
        run_undo(txn.rollback)
    late: Pins = {}
    for k, alive in survivors.items():
        if alive is not None:
            late[k] = name_pins(alive, own_ids(txn, survivors))
    del survivors, alive
    if on_pinned == "raise":
        named = _labelled(late, label)
        raise PinnedStorageError(pinned_message(named), named)
    warn(pinned_message(_labelled(late, label), kept=True), OriginalKeptAliveWarning)
    return expired, late


def finish(txn: Transaction, label: Labels, outside: Outside, on_pinned: OnPinned,
           bind: Callable[[], None], skip: Callable[[], Iterable[object]] = tuple,
           force: Callable[[Pins], None] | None = None) -> tuple[dict[int, bool], Pins]:
    """Settle the pins, apply the policy, ``bind()``, commit and prove the release: per original
    key, whether it died and what still holds it."""
    pins = settle_pins(txn, label, outside, on_pinned, skip, force)
    _keep_unreleased(txn, label, pins, outside)
    bind()
    expired, late = _prove(txn, label, pins, on_pinned)
    return expired, {**late, **pins}


def pinned_message(pinned: dict[str, tuple[str, ...]], *, kept: bool = False) -> str:
    lines = [f"{len(pinned)} original storage(s) are still referenced after rebinding:"]
    for lab, holders in pinned.items():
        lines.append(f"  {lab} is held by: " + "; ".join(holders))
    if kept:  # on_pinned="warn"/"force": the move stands, the originals live on
        lines.append(
            "The move was kept (on_pinned='warn'/'force'); each original is freed when its "
            "holders drop it (pool.unreleased_originals() lists them).")
        return "\n".join(lines)
    lines.append(
        "Pass those tensors in AdoptSpec.views (or their places in AdoptSpec.holders), drop the "
        "references, or use on_pinned='warn'/'force'. Nothing was changed.")
    return "\n".join(lines)
