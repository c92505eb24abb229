"""grow() and compact(): the pool moves to a new storage, everything adopted follows in place,
and the old storage is proven dead (or everything rolls back)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from flatpool.testing import FailAt, set_fault_hook
from flatpool import (
    AdoptSpec,
    FlatPool,
    FreedSliceError,
    Holder,
    InvalidRequestError,
    PinnedStorageError,
    storage_of,
)


class Box:
    pass


def key(t: torch.Tensor) -> int:
    return int(storage_of(t)._cdata)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(3, 5, generator=g), torch.randn(3, 2, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def test_grow_keeps_handles_identity_and_training() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 2))
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    _train(model, opt, 2, 1)
    _train(ref, ref_opt, 2, 1)
    pool = FlatPool(capacity=4096, name="g")
    report = pool.adopt(list(model.parameters()))
    slices = pool.slices()
    ids = [id(p) for p in model.parameters()]
    old = StorageWeakRef(pool.storage)
    old_capacity = pool.capacity
    pool.grow(old_capacity * 4)
    assert old.expired() and pool.capacity == old_capacity * 4
    assert pool.slices() == slices == report.slices and all(s.is_live for s in slices)
    assert [id(p) for p in model.parameters()] == ids and pool.is_valid()
    for p, q, s in zip(model.parameters(), ref.parameters(), slices):
        assert pool.owns(p) and pool.slice_of(p) == s and torch.equal(p, q)
    assert pool.free_bytes >= old_capacity * 3
    _train(model, opt, 3, 2)
    _train(ref, ref_opt, 3, 2)
    for p, q, s in zip(model.parameters(), ref.parameters(), slices):
        assert torch.equal(p, q) and torch.equal(s.tensor(), q)
    # The new room is usable.
    extra = torch.randn(100)
    assert pool.adopt(extra).all_released


def test_grow_refuses_to_shrink_and_bad_types() -> None:
    pool = FlatPool(capacity=4096)
    pool.adopt(torch.randn(4))
    with pytest.raises(InvalidRequestError, match="shrink"):
        pool.grow(1024)
    with pytest.raises(TypeError):
        pool.grow(2.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="on_pinned"):
        pool.grow(8192, on_pinned="nope")  # type: ignore[arg-type]


def test_grow_a_planned_pool_moves_no_data() -> None:
    pool = FlatPool(name="planned", capacity=1024)
    s = pool.allocate(16, torch.float32)
    pool.grow(2048)
    assert not pool.is_materialized and pool.capacity == 2048 and pool.slices() == (s,)


def test_compact_packs_and_returns_new_handles() -> None:
    pool = FlatPool(capacity=8192, name="c")
    a, b, c = torch.randn(10), torch.randn(200), torch.randn(3, 4)
    base = torch.randn(12)
    window = torch.empty(0).set_(base.untyped_storage(), 2, (2, 3), (4, 1))  # strided view
    box = Box()
    box.v = base.narrow(0, 4, 6)  # type: ignore[attr-defined]
    report = pool.adopt([a, b, c, AdoptSpec(base, views=[window], holders=[Holder(box, "v")])])
    before = {n: t.clone() for n, t in {"a": a, "c": c, "base": base, "window": window,
                                          "v": box.v}.items()}  # type: ignore[attr-defined]
    sa, sb, sc, sbase = report.slices
    pool.disown(sb)
    pool.free(sb)
    del b
    window_rel = window.storage_offset() * 4 - sbase.offset
    old = StorageWeakRef(pool.storage)
    mapping = pool.compact()
    assert old.expired()
    assert set(mapping) == {sa.slice_id, sc.slice_id, sbase.slice_id}
    for s in (sa, sc, sbase):
        assert not s.is_live
        with pytest.raises(FreedSliceError):
            s.tensor()
    new = [mapping[s.slice_id] for s in (sa, sc, sbase)]
    assert [s.offset for s in new] == [0, 512, 1024] and pool.capacity == 1536
    assert pool.slices() == tuple(new)
    for name, t in {"a": a, "c": c, "base": base, "window": window, "v": box.v}.items():  # type: ignore[attr-defined]
        assert pool.owns(t) and torch.equal(t, before[name]), name
    assert window.stride() == (4, 1) and window.storage_offset() * 4 - new[2].offset == window_rel
    assert pool.slice_of(a) == new[0] and pool.is_valid()
    base[5] = 3.0
    assert box.v[1] == 3.0 and window[0, 3 - 1] == base[4]  # type: ignore[attr-defined]
    base[6] = 4.0
    assert window[1, 0] == 4.0


def test_relocation_moves_dtensor_and_wrapper(
    dtensor_from_local: Callable[[torch.Tensor], torch.Tensor],
    hp_wrap: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    d = torch.nn.Parameter(dtensor_from_local(torch.randn(4, 3)))
    w = hp_wrap(torch.randn(5))
    pool = FlatPool(capacity=4096)
    pool.adopt([d, w])
    dl = d._local_tensor.clone()  # type: ignore[attr-defined]
    wl = w._local_tensor.clone()  # type: ignore[attr-defined]
    old = StorageWeakRef(pool.storage)
    pool.grow(8192)
    pool.compact()
    assert old.expired() and pool.is_valid()
    assert pool.owns(d._local_tensor) and torch.equal(d._local_tensor, dl)  # type: ignore[attr-defined]
    assert pool.owns(w._local_tensor) and torch.equal(w._local_tensor, wl)  # type: ignore[attr-defined]
    with torch._C.DisableTorchFunctionSubclass():
        assert int(w.untyped_storage()._cdata) == int(pool.storage._cdata)


def _state(pool: FlatPool, tensors: list[torch.Tensor]) -> tuple[Any, ...]:
    return (
        pool.describe(),
        pool.slices(),
        int(pool.storage._cdata),
        [key(t) for t in tensors],
        [t.storage_offset() for t in tensors],
        [t.clone() for t in tensors],
        [id(t) for t in tensors],
    )


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    assert a[0] == b[0] and a[1] == b[1] and a[2] == b[2] and a[3] == b[3] and a[4] == b[4]
    assert a[6] == b[6] and all(torch.equal(x, y) for x, y in zip(a[5], b[5]))


@pytest.mark.parametrize("op", ["grow", "compact"])
def test_a_kept_view_of_the_old_storage_pins_it(op: str) -> None:
    pool = FlatPool(capacity=4096, name="pin")
    ts = [torch.randn(8), torch.randn(3)]
    report = pool.adopt(ts)
    pool.allocate(50, torch.float32)  # a gap-maker for compact
    flat = pool.flat()
    state = _state(pool, ts)

    def run(**kw: Any) -> Any:
        return pool.grow(8192, **kw) if op == "grow" else pool.compact(**kw)

    with pytest.raises(PinnedStorageError, match="local variable 'flat'"):
        run()
    _same(state, _state(pool, ts))
    assert all(s.is_live for s in report.slices)
    with pytest.warns(UserWarning, match="flat"):
        run(on_pinned="warn")
    assert all(pool.owns(t) for t in ts) and not pool.owns(flat)
    assert all(torch.equal(t, v) for t, v in zip(ts, state[5]))


def _scenario() -> tuple[FlatPool, list[torch.Tensor], Box]:
    pool = FlatPool(capacity=4096, name="fi")
    model = torch.nn.Linear(3, 2)
    base = torch.randn(6)
    box = Box()
    box.model = model  # type: ignore[attr-defined]
    box.v = base.narrow(0, 1, 3)  # type: ignore[attr-defined]
    pool.adopt([model.weight, model.bias, AdoptSpec(base, holders=[Holder(box, "v")])])
    gap = pool.allocate(40, torch.float32)
    pool.free(gap)
    return pool, [model.weight, model.bias, base, box.v], box  # type: ignore[attr-defined]


@pytest.mark.parametrize("exc_type", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("op", ["grow", "compact"])
def test_fault_at_every_relocation_step(op: str, exc_type: type[BaseException]) -> None:
    def run(pool: FlatPool) -> Any:
        return pool.grow(8192) if op == "grow" else pool.compact()

    counted: list[str] = []
    pool, _, _ = _scenario()
    set_fault_hook(counted.append)
    run(pool)
    set_fault_hook(None)
    assert "copy" in counted and "release" in counted
    for k in range(len(counted)):
        pool, tensors, box = _scenario()
        state = _state(pool, tensors)
        set_fault_hook(FailAt(k, exc_type))
        with pytest.raises(exc_type, match="injected"):
            run(pool)
        set_fault_hook(None)
        _same(state, _state(pool, tensors))
        assert box.v is tensors[3] and pool.is_valid()  # type: ignore[attr-defined]
        old = StorageWeakRef(pool.storage)
        del state
        run(pool)
        assert old.expired() and pool.is_valid()
        assert all(pool.owns(t) for t in tensors)
