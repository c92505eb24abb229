"""The release pre-check: does anything but the transaction still use an original?

Run after every move and before the commit, so that a pinned original is found while the
rollback can still be exact. Three kinds of user are counted:

* TensorImpls and storage objects on the original (``storage_users``) beyond the ones the
  transaction knows (the storage object it holds, old impls of swapped views, their bases);
* Python references to the storage object, or to a known base, beyond the transaction's own;
* owners of a moved tensor's *TensorImpl* that Python cannot see (a DLPack consumer, an
  autograd graph that saved it): ``set_`` moved that impl, but a DLPack consumer kept a raw
  pointer into the original, which would die under it. torch cannot tell such an owner from a
  graph's saved tensor, so both are reported as "held outside Python"; only a leaf's grad
  accumulator (held by any live graph, and harmless) is told apart and allowed.

The weak-reference proof after :meth:`Transaction.release` is what finally says "released";
this check only makes its failures rare and early.
"""

from __future__ import annotations

import math
import operator
import os
import time
from collections.abc import Callable, Iterable, Sized
from itertools import repeat
from typing import TypeVar, cast

import torch

from .. import torch_compat as tc
from ..errors import InvalidRequestError, InvalidTypeError
from .moves import ImplSwap, ImplSwaps
from .transaction import Transaction

_H = TypeVar("_H", bound=Sized)

OUTSIDE_PYTHON = (
    "held outside Python (a DLPack consumer such as numpy.from_dlpack, or a C++ holder such as "
    "an autograd graph that saved it): moving it would free memory that holder may still read"
)


def old_impls(txn: Transaction) -> dict[int, list[torch.Tensor]]:
    """Per original key, the old impls the transaction holds (views moved off their base):
    one pass over the journal for every key to look up."""
    out: dict[int, list[torch.Tensor]] = {}
    for rec in txn.journal:
        if isinstance(rec, ImplSwap) and rec.other is not None and rec.key is not None:
            out.setdefault(rec.key, []).append(rec.other)
        elif isinstance(rec, ImplSwaps):
            keys, others = rec.keys, rec.others
            if (not any(map(operator.is_, others, repeat(None)))
                    and not any(map(out.__contains__, keys)) and len(set(keys)) == len(keys)):
                held = cast("list[torch.Tensor]", others)  # (none is None: checked above)
                out.update(zip(keys, map(list, zip(held))))  # (one C-level pass: new keys)
                continue
            for key, other in zip(keys, others):
                if other is not None:
                    out.setdefault(key, []).append(other)
    return out


def swapped_held_once(txn: Transaction, olds: dict[int, list[torch.Tensor]]) -> bool:
    """What :func:`storage_pinned` says of every original when none is pinned, for a batch
    whose moved views left one old impl each (FSDP2's padded shards), in C-level passes: an
    original with no old impl is used by our storage object alone; one with an old impl by
    that, the old impl (nothing else owns it) and the old impl's base (on the same storage,
    which nothing in Python references). ``False`` only means "count each one"."""
    originals = txn.originals
    plain: list[torch.UntypedStorage] = []
    swapped: list[torch.UntypedStorage] = []
    moved_off: list[torch.Tensor] = []
    keys, stores = originals.key_column(), list(originals.values())  # (the same order)
    founds = list(map(olds.get, keys))
    if len(stores) == len(keys) and not any(map(operator.is_, founds, repeat(None))):
        every = cast("list[list[torch.Tensor]]", founds)  # (every original moved a view off)
        if set(map(len, every)) != {1}:
            return False
        swapped, moved_off = stores, list(map(operator.itemgetter(0), every))
        del every
    else:
        for store, found in zip(stores, founds):
            if found is None:
                plain.append(store)
            elif len(found) == 1:
                swapped.append(store)
                moved_off.append(found[0])
            else:
                return False
    del founds, stores
    if not (tc.storages_used_as(plain, 1, 1)
            and tc.storages_used_as(swapped, 3, 1 + tc.PRESERVED_STORAGE_REF)):
        return False
    del plain
    keys = list(map(tc.storage_key_of, swapped))
    del swapped
    with tc.no_torch_function():
        if not all(map(operator.eq, map(tc.tensor_impl_users, moved_off), repeat(1))):
            return False  # an old impl someone else also owns stays on the original
        if list(map(tc.storage_address, moved_off)) != keys:
            return False
        bases = list(map(tc.impl_base, moved_off))
        if any(map(operator.is_, bases, repeat(None))) or list(  # (not `None in`: == per tensor)
                map(tc.storage_address, bases)) != keys:  # type: ignore[arg-type]
            return False
        # a view's base is owned by the view too: torch then holds its Python object as well
        if not all(map(operator.lt, repeat(1), map(tc.tensor_impl_users, bases))):  # type: ignore[arg-type]
            return False
    return tc.tensors_referenced(bases, tc.PRESERVED_TENSOR_REF)  # type: ignore[arg-type]


def storage_pinned(txn: Transaction, key: int, olds: list[torch.Tensor] | None = None) -> bool:
    """Original ``key`` has a user the transaction cannot account for (before release).

    ``olds``: the old impls the transaction holds on it (:func:`old_impls`).
    """
    known: dict[int, torch.Tensor] = {}
    bases: dict[int, torch.Tensor] = {}
    address, is_meta, base_of = tc.storage_address, tc.impl_is_meta, tc.impl_base
    with tc.no_torch_function():  # every old impl and its base in one block (meta: none)
        for old in olds or ():
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


# A collective's worker thread can hold a tensor it just wrote for a moment after the caller's
# wait() returned (gloo's runLoop drops its Work, and the tensors in it, only afterwards):
# measured on a loaded 2-core machine, adopting right after distribute_tensor, where 16 ms of
# looking again was not enough. Such owners go away by themselves; a DLPack consumer does not.
# So look again with a doubling back-off, up to a bounded total.
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
    """The total time (seconds) an adoption waits for an owner outside Python to let go of a
    tensor before it counts as a pin (:data:`DEFAULT_CXX_HOLDER_WAIT_S`, or
    ``$FLATPOOL_CXX_HOLDER_WAIT_S`` at import, or :func:`set_cxx_holder_wait`)."""
    return _wait_s


def set_cxx_holder_wait(seconds: float) -> float:
    """Set :func:`cxx_holder_wait` (0: look once more after a bare yield only); returns the
    previous value. Raise it on a heavily loaded machine, lower it where a DLPack consumer or
    autograd graph that saved a tensor is expected and the wait is wasted."""
    global _wait_s
    value = _checked_wait(seconds, "the C++ holder wait")
    previous, _wait_s = _wait_s, value
    return previous


LOAD_SCALE_MAX = 8.0
"""The most a loaded machine stretches the wait by (2 s at the default 0.25 s)."""


def load_factor(load: float | None = None, cpus: int | None = None) -> float:
    """How many times longer to wait on a loaded machine: the 1-minute load average per CPU
    this process may run on, between 1 and :data:`LOAD_SCALE_MAX` (1 where the load is
    unknown). The holder is usually a thread that only needs a time slice (gloo's worker
    dropping a finished collective's tensor); with N runnable threads per CPU it waits about N
    times longer for one."""
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
    """The sleeps of one wait: a bare yield, then 0.5 ms doubling up to 32 ms a sleep, until
    they add up to ``limit`` (default :func:`effective_cxx_holder_wait`)."""
    total = effective_cxx_holder_wait() if limit is None else limit
    out = [0.0]
    left, delay = total, _FIRST_DELAY_S
    while left > 1e-9:
        step = min(delay, left)
        out.append(step)
        left -= step
        delay = min(delay * 2, _MAX_DELAY_S)
    return out


def held_outside_python(
    candidates: Iterable[torch.Tensor], views: Iterable[torch.Tensor] = ()
) -> list[torch.Tensor]:
    """The ``candidates`` (tensors about to be ``set_`` elsewhere) whose TensorImpl has owners
    beyond its Python object, the autograd links of the known ``views`` (each view's impl keeps
    its base's; pass every tensor the operation moves), and a live graph's grad accumulator.

    Call it *before* the move: ``set_`` detaches a leaf from its grad accumulator, after which
    the two can no longer be told apart. An extra owner must still be there after looking again
    with a doubling back-off for :func:`cxx_holder_wait` seconds in all (default 0.25 s; only
    a tensor that has such an owner pays it), stretched on a loaded machine by
    :func:`load_factor` (up to 8x).
    """
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


def look_again(held: _H, recheck: Callable[[_H], _H]) -> _H:
    """Re-check ``held`` (what an owner outside Python still holds) with the bounded back-off
    of :func:`settle_delays` until ``recheck(held)`` comes back empty or the wait is over; the
    last answer. Each sleep lets a holder's thread run (0: a bare yield)."""
    for delay in settle_delays():
        if not held:
            break
        time.sleep(delay)
        held = recheck(held)
    return held


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
    """A live autograd graph's AccumulateGrad node holds this leaf's impl (benign: gradients
    accumulate into the same impl wherever it points). Asking for the node creates it when it
    did not exist, and then the use count rises: that is how the two cases are told apart."""
    with tc.no_torch_function():
        if not (tc.impl_requires_grad(t) and tc.impl_is_leaf(t)):
            return False
    before = tc.tensor_impl_users(t)
    node = torch.autograd.graph.get_gradient_edge(t).node
    existed = tc.tensor_impl_users(t) == before
    del node
    return existed


__all__ = ["CXX_HOLDER_WAIT_ENV", "DEFAULT_CXX_HOLDER_WAIT_S", "OUTSIDE_PYTHON", "cxx_holder_wait",
           "effective_cxx_holder_wait", "held_outside_python", "load_factor", "look_again",
           "old_impls", "set_cxx_holder_wait", "settle_delays", "storage_pinned",
           "swapped_held_once"]
