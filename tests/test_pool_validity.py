"""``FlatPool.is_valid()`` says True exactly when nothing moved and no slice is orphaned.

A pool holds bindings of every kind (plain tensors, parameters adopted without holders, module
parameters found through their attribute, a dict item, a view); then some bound objects are
moved the ways users and frameworks move them, including the cases a pointer-based check got
wrong: ``.data`` onto another storage at the same address (``torch.from_numpy(t.numpy())``),
and the pool's storage shrunk or ``resize_(0)``-ed through a member. ``moved()`` must name
exactly the slices whose objects left (all the slices past the end of a shrunk storage),
``is_valid()`` must agree with it, whatever the member count, with another thread alive and
under ``sys.settrace`` / ``sys.setprofile``; nothing may read the freed bytes.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from flatpool import AdoptSpec, FlatPool, Holder
from flatpool import _torch_compat as tc
from flatpool.ownership._validity import orphaned
from check_contexts import CONTEXTS, context


class World:
    """A pool and what was adopted into it: ``bound[i]`` gives the object binding ``i`` holds
    now, ``slices[i]`` its slice."""

    def __init__(self, plain: int) -> None:
        self.model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        self.unheld = nn.Linear(2, 2)
        self.box = {"k": torch.randn(4, 3)}
        base = torch.randn(6)
        self.base, self.view = base, base[1:5]
        self.plain = [torch.randn(5) for _ in range(plain)]
        specs: list[Any] = [AdoptSpec(getattr(m, name), holders=[Holder(m, name)])
                            for m in self.model for name in ("weight", "bias")]
        specs += [AdoptSpec(self.box["k"], holders=[Holder(self.box, "k", item=True)]),
                  AdoptSpec(base, views=[self.view]), *self.unheld.parameters(), *self.plain]
        self.pool = FlatPool("cpu", alignment=64)
        report = self.pool.adopt(specs)
        self.slices = list(report.slices)
        holders: list[Callable[[], torch.Tensor]] = [
            (lambda m=m, n=n: getattr(m, n)) for m in self.model for n in ("weight", "bias")]
        holders.append(lambda: self.box["k"])
        holders.append(lambda: self.base)
        holders += [(lambda p=p: p) for p in self.unheld.parameters()]
        holders += [(lambda t=t: t) for t in self.plain]
        self.bound = holders
        self.held_by = ["holder"] * 5 + ["plain", "unheld", "unheld"] + ["plain"] * plain


def _set(t: torch.Tensor, storage: torch.UntypedStorage, offset: int,
         size: tuple[int, ...], stride: tuple[int, ...]) -> None:
    with tc.no_torch_function(), torch.no_grad():
        tc.impl_set_(t, storage, offset, size, stride)


# ---- changes of one bound object: each says whether its slice now counts as moved -----------
def same_address_alias(w: World, i: int) -> bool:
    t = w.bound[i]()
    t.data = torch.from_numpy(t.detach().numpy())  # another StorageImpl, the same address
    return True


def moved_elsewhere(w: World, i: int) -> bool:
    t = w.bound[i]()
    _set(t, t.detach().clone().untyped_storage(), 0, tuple(t.shape), tuple(t.stride()))
    return True


def copied_storage_same_place(w: World, i: int) -> bool:
    t = w.bound[i]()
    _set(t, t.untyped_storage().clone(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
    return True


def one_further(w: World, i: int) -> bool:
    t = w.bound[i]()
    _set(t, t.untyped_storage(), t.storage_offset() + 1, tuple(t.shape), tuple(t.stride()))
    return True


def reshaped(w: World, i: int) -> bool:
    t = w.bound[i]()
    flat = t.dim() == 1
    _set(t, t.untyped_storage(), t.storage_offset(), (t.numel(),), (1,))
    return not flat


def other_dtype(w: World, i: int) -> bool:
    t = w.bound[i]()
    t.requires_grad_(False)
    with torch.no_grad():
        t.data = t.data.view(torch.int32)  # same bytes, pointer, shape and stride
    return True


def swapped_out(w: World, i: int) -> bool:
    t = w.bound[i]()
    if weakref.getweakrefcount(t):
        return False  # swap_tensors refuses such a tensor: nothing changes
    other = torch.zeros_like(t.detach())
    if isinstance(t, nn.Parameter):
        other = nn.Parameter(other, requires_grad=t.requires_grad)
    torch.utils.swap_tensors(t, other)
    return True


def replaced_in_holder(w: World, i: int) -> bool:
    if w.held_by[i] != "holder":
        return False
    if i == 4:  # the dict item
        w.box["k"] = w.box["k"].clone()
        return True
    m, name = w.model[i // 2], ("weight", "bias")[i % 2]
    old = getattr(m, name)
    setattr(m, name, nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad))
    return True


def values_written(w: World, i: int) -> bool:
    with torch.no_grad():
        w.bound[i]().add_(1)  # an optimizer step: in place, still valid
    return False


CHANGES: dict[str, Callable[[World, int], bool]] = {
    "same-address alias on another storage": same_address_alias,
    "moved elsewhere": moved_elsewhere, "copied storage, same place": copied_storage_same_place,
    "one element further": one_further, "reshaped in place": reshaped,
    "other dtype, same bytes": other_dtype, "swap_tensors out": swapped_out,
    "replaced in its holder": replaced_in_holder, "values written in place": values_written,
}


def _verdict(w: World, where: str) -> tuple[bool, set[int], list[Any]]:
    with context(where):
        valid = w.pool.is_valid()
        ids = {s.slice_id for s in w.pool.moved()}
        lost = orphaned(w.pool)
    return valid, ids, lost


@settings(max_examples=60, deadline=None)
@given(plain=st.sampled_from([0, 3, 200]),
       changes=st.lists(st.tuples(st.integers(0, 10 ** 6), st.sampled_from(sorted(CHANGES))),
                        max_size=3),
       where=st.sampled_from(CONTEXTS))
def test_is_valid_is_exactly_nothing_moved(plain: int, changes: list[tuple[int, str]],
                                           where: str) -> None:
    w = World(plain)
    assert _verdict(w, where) == (True, set(), [])
    expect: set[int] = set()
    changed: set[int] = set()
    for pick, change in changes:
        i = pick % len(w.bound)
        if i in changed:  # (one change a binding: a second may not fit where the first put it)
            continue
        changed.add(i)
        if CHANGES[change](w, i):
            expect.add(w.slices[i].slice_id)
    valid, ids, lost = _verdict(w, where)
    assert ids == expect, (changes, ids, expect)
    assert valid == (not ids and not lost)


@pytest.mark.parametrize("where", CONTEXTS)
@pytest.mark.parametrize("plain", [3, 200])
@pytest.mark.parametrize("half", [False, True], ids=["resize_(0)", "halved"])
def test_a_shrunk_pool_storage_is_reported_never_read(where: str, plain: int, half: bool) -> None:
    """Every slice past the new end is moved; ``readopt`` and ``grow`` refuse with a typed
    error (reading those bytes would read freed memory, a segfault); nothing crashes."""
    w = World(plain)
    keep = w.pool.capacity // 2 if half else 0
    assert any(s.end <= keep for s in w.slices) == half
    past = {s.slice_id for s in w.slices if s.end > keep}
    w.plain[0].untyped_storage().resize_(keep) if plain else w.base.untyped_storage().resize_(keep)
    valid, ids, _ = _verdict(w, where)
    assert not valid and ids == past
    with pytest.raises(Exception) as err:
        w.pool.readopt()
    assert "holds only" in str(err.value)
    with pytest.raises(Exception) as err:
        w.pool.grow(w.pool.capacity * 2)
    assert "resize_" in str(err.value)
    assert not w.pool.is_valid()


def test_parameters_their_model_dropped_are_orphaned_not_valid() -> None:
    m = nn.Linear(4, 3)
    pool = FlatPool("cpu")
    pool.adopt(list(m.parameters()))
    assert pool.is_valid()
    m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, assign=True)
    assert not pool.is_valid() and not pool.moved() and orphaned(pool)


def test_registry_and_storage_changes_keep_the_answer_right() -> None:
    w = World(3)
    w.pool.grow(w.pool.capacity + 1024)  # a new storage: every place changed
    assert w.pool.is_valid()
    extra = torch.randn(5)
    w.pool.adopt([extra])
    assert w.pool.is_valid()
    _set(extra, torch.zeros(5).untyped_storage(), 0, (5,), (1,))
    assert not w.pool.is_valid() and len(w.pool.moved()) == 1
    del w.plain[1]  # a dead binding has nothing to keep in place
    w.pool.readopt()
    assert w.pool.is_valid()
