"""Fault injection: every checkpoint of every multi-step operation raises in turn.

For each operation (batch adoption, adoption into existing slices, re-adoption, grow, compact,
materialization from meta) a hook installed with :func:`flatpool.set_fault_hook` raises at the
k-th checkpoint, for k = 0, 1, ... until the operation completes without the hook firing. After
each injected failure the rollback must restore every tensor's storage, geometry, values and
identity, every holder's object, the pool's layout, bytes and registry, and free every slice
the operation took; the same operation must then succeed, with every original released.
``KeyboardInterrupt`` is injected as well as an ordinary exception.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from flatpool import AdoptSpec, FlatPool
from flatpool.testing import FailAt, set_fault_hook

from .scenarios import World, batch_world, ints, meta_world, values_of
from .state import Snapshot, check_layout


class InjectedFault(RuntimeError):
    pass


def _prepare_adopt(w: World) -> Callable[[], Any]:
    return lambda: w.pool.adopt(w.targets)


def _prepare_adopt_growing(w: World) -> Callable[[], Any]:
    assert w.pool.grows and w.pool.is_materialized  # the batch does not fit: adopt grows it
    return lambda: w.pool.adopt(w.targets)


def _prepare_adopt_into_slices(w: World) -> Callable[[], Any]:
    pool = w.pool
    plain, base = w.tensors["plain"], w.tensors["base"]
    s1 = pool.allocate(tuple(plain.shape), plain.dtype)
    s2 = pool.allocate(tuple(base.shape), base.dtype)
    s1.tensor().fill_(-1.0)  # bytes a failed adoption must leave as they were
    s2.tensor().fill_(-2.0)
    targets = list(w.targets)
    targets[2] = AdoptSpec(plain, slice=s1)
    targets[3] = AdoptSpec(base, views=targets[3].views, slice=s2)
    w.keep += [s1, s2]
    return lambda: pool.adopt(targets)


def _prepare_readopt(w: World) -> Callable[[], Any]:
    w.pool.adopt(w.targets)
    # A framework re-materializes behind the pool's back (to_empty, load_state_dict(assign)).
    for name in ("weight", "bias", "plain", "idx"):
        t = w.tensors[name]
        t.data = t.data.clone() + 1
    return lambda: w.pool.readopt()


def _prepare_grow(w: World) -> Callable[[], Any]:
    w.pool.adopt(w.targets)
    return lambda: w.pool.grow(w.pool.capacity * 2)


def _prepare_compact(w: World) -> Callable[[], Any]:
    pool = w.pool
    hole = pool.allocate((64,), torch.float64)
    w.pool.adopt(w.targets)
    pool.free(hole)  # a gap for compact() to squeeze out
    return lambda: pool.compact()


def _prepare_materialize(w: World) -> Callable[[], Any]:
    return lambda: w.pool.materialize_into(w.targets)


OPERATIONS: dict[str, tuple[Callable[[], World], Callable[[World], Callable[[], Any]]]] = {
    "adopt-batch": (batch_world, _prepare_adopt),
    "adopt-into-slices": (batch_world, _prepare_adopt_into_slices),
    "adopt-growing": (lambda: batch_world(capacity=None), _prepare_adopt_growing),
    "readopt": (batch_world, _prepare_readopt),
    "grow": (batch_world, _prepare_grow),
    "compact": (batch_world, _prepare_compact),
    "materialize-into": (meta_world, _prepare_materialize),
}


def _check_after_success(op: str, w: World, before: dict[str, torch.Tensor]) -> None:
    pool = w.pool
    check_layout(pool)
    assert pool.is_valid()
    if op == "materialize-into":
        for t in w.tensors.values():
            assert not t.is_meta and pool.slice_of(t) is not None
        return
    for name, t in w.tensors.items():
        assert torch.equal(t.detach(), before[name]), name
        assert pool.owns(t), f"{name} does not alias the pool"
    shard = w.keep[1]
    assert pool.owns(shard.local) and torch.equal(shard.local, before["data"][:10])
    # The optimizer still steps the very objects the module holds.
    assert w.opt is not None
    lin = w.keep[0]
    w.opt.zero_grad()
    lin(torch.ones(1, 4)).sum().backward()
    w.opt.step()
    assert pool.owns(lin.weight) and not torch.equal(lin.weight.detach(), before["weight"])


def sweep(op: str, exc_type: type[BaseException]) -> int:
    """Raise at every checkpoint of ``op`` in turn; returns the number of faults injected."""
    build, prepare = OPERATIONS[op]
    k = 0
    while True:
        w = build()
        run = prepare(w)
        before = values_of(w)
        snap = Snapshot(w.pools, w.tensors, w.places)
        hook = FailAt(k, exc_type)
        calls = hook.steps
        set_fault_hook(hook)
        try:
            run()
        except exc_type as exc:
            assert str(exc).startswith("injected"), exc
        else:
            set_fault_hook(None)
            assert len(calls) == k, (op, k, calls)
            _check_after_success(op, w, before)
            return k
        finally:
            set_fault_hook(None)
        problems = snap.diff()
        assert not problems, f"{op}: fault at checkpoint {k} ({calls[-1]}) left:\n" + "\n".join(
            problems
        )
        for p in w.pools:
            check_layout(p)
        # The same operation succeeds after the rollback.
        run()
        _check_after_success(op, w, before)
        k += 1


@pytest.mark.parametrize("exc_type", [InjectedFault, KeyboardInterrupt], ids=["error", "ctrl-c"])
@pytest.mark.parametrize("op", list(OPERATIONS))
def test_every_checkpoint_rolls_back(op: str, exc_type: type[BaseException]) -> None:
    faults = sweep(op, exc_type)
    assert faults >= 3, f"{op} passed only {faults} checkpoints"


def test_rollback_keeps_originals_and_releases_them_after_retry() -> None:
    """A failed adoption leaves each tensor on its *original* storage (same StorageImpl), and
    the retry then proves every original dead."""
    w = batch_world()
    snap = Snapshot(w.pools, w.tensors, w.places)

    def hook(step: str) -> None:
        if step == "release":
            raise InjectedFault("injected at release")

    set_fault_hook(hook)
    try:
        with pytest.raises(InjectedFault):
            w.pool.adopt(w.targets)
    finally:
        set_fault_hook(None)
    snap.assert_unchanged()
    weak = [st.ident[1] for _, st in snap.tensors.values() if st.ident is not None]
    report = w.pool.adopt(w.targets)
    assert report.all_released
    assert all(ref.expired() for ref in weak)


def test_regression_readopt_rollback_restores_slice_bytes() -> None:
    """Bug found by the fault sweep: a failed readopt() left the new values in the slice
    (the copy into the pool was never undone), so pool.flat() disagreed with the rolled-back
    tensors."""
    pool = FlatPool(alignment=64)
    t = ints(4)
    pool.adopt(t)
    t.data = ints(4, start=10)
    flat_before = pool.flat().clone()

    def hook(step: str) -> None:
        if step == "release":
            raise InjectedFault("injected")

    set_fault_hook(hook)
    try:
        with pytest.raises(InjectedFault):
            pool.readopt()
    finally:
        set_fault_hook(None)
    assert torch.equal(pool.flat(), flat_before)
    assert torch.equal(t, ints(4, start=10))
    pool.readopt()
    assert pool.owns(t) and torch.equal(pool.flat()[:4], ints(4, start=10))


def test_regression_adopt_into_slice_rollback_restores_slice_bytes() -> None:
    """Same bug for adopt(AdoptSpec(t, slice=s)): the failed adoption overwrote ``s``."""
    pool = FlatPool(alignment=64)
    s = pool.allocate(4, torch.float32)
    s.tensor().fill_(7.0)
    t = ints(4)

    def hook(step: str) -> None:
        if step == "rebind":
            raise KeyboardInterrupt

    set_fault_hook(hook)
    try:
        with pytest.raises(KeyboardInterrupt):
            pool.adopt(AdoptSpec(t, slice=s))
    finally:
        set_fault_hook(None)
    assert torch.equal(s.tensor(), torch.full((4,), 7.0))
