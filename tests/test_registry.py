"""The registry of a batch: each slice's bindings say where its member sits and find it again,
through unbinding, re-binding, freeing, snapshots, rollback and relocation; a plain tensor or
parameter alone on its original is referred to without a weak reference."""

from __future__ import annotations

import gc

import pytest
import torch

from flatpool import AdoptSpec, FlatPool
from flatpool.errors import PinnedStorageError
from flatpool._registry import ParamRef, TensorRef


N = 70


def _pair(
    n: int = N, capacity: int | None = None
) -> tuple[FlatPool, list[torch.Tensor], FlatPool, list[torch.Tensor]]:
    lean = [torch.randn(i % 7 + 1, 3) for i in range(n)]
    general = [t.clone() for t in lean]
    p1, p2 = FlatPool(capacity=capacity), FlatPool(capacity=capacity)
    p1.adopt(lean)  # bare tensors: each alone on its original
    p2.adopt([AdoptSpec(t, views=[t.view(t.shape)]) for t in general])  # a view each
    return p1, lean, p2, general


def _view(pool: FlatPool) -> list[tuple[int, tuple[object, ...]]]:
    """The registry as (slice id, records without their refs, bound object ids)."""
    return sorted((sid, tuple((tuple(b[1:]), id(b.current())) for b in bound))
                  for sid, bound in pool.registry.items())


def test_a_batch_s_bindings_say_where_each_member_sits() -> None:
    p1, lean, p2, general = _pair()
    reg = p1.registry
    assert len(reg) == len(p2.registry) == N
    ids = [s.slice_id for s in p1.slices()]
    for sid, t in zip(ids, lean):
        (b,) = reg.bindings(sid)
        assert b.current() is t and tuple(b[1:]) == (0, tuple(t.shape), t.stride(), t.dtype,
                                                     None, None, False, True)
        assert (b.byte_offset, b.shape, b.stride, b.dtype, b.primary) == (
            0, tuple(t.shape), t.stride(), t.dtype, True)
        assert type(b.ref) is TensorRef and b.holder() is None
        assert reg.holds(sid) and reg.bindings(sid)[0] is b
    for s in p2.slices():  # a view each: two members, referred to weakly
        assert len(p2.registry.bindings(s.slice_id)) == 2
    assert reg.bindings(10**9) == () and not reg.holds(10**9)


def test_unbind_rebind_free_and_dead_tensors_in_a_run() -> None:
    p1, lean, _, _ = _pair()
    reg = p1.registry
    slices = p1.slices()
    p1.disown(slices[1])  # unbinds one id of the run
    assert not reg.holds(slices[1].slice_id) and reg.bindings(slices[1].slice_id) == ()
    assert len(reg) == N - 1 and slices[1].slice_id not in {sid for sid, _ in reg.items()}
    p1.free(slices[1])
    with pytest.raises(Exception):
        p1.free(slices[2])  # still backs a tensor of the run
    del lean[2]
    gc.collect()
    assert not reg.holds(slices[2].slice_id)
    p1.free(slices[2])  # its tensor died: the binding goes with the slice
    assert len(reg) == N - 2 and p1.is_valid()
    version = reg.version
    reg.bind(slices[0].slice_id, list(reg.bindings(slices[0].slice_id)))  # bound anew
    assert reg.version > version and len(reg) == N - 2
    assert [sid for sid, _ in reg.items()].count(slices[0].slice_id) == 1


def test_a_failed_second_adoption_restores_the_run() -> None:
    p1, lean, _, _ = _pair(capacity=1 << 16)  # room for a second batch (placed one by one)
    before = _view(p1)
    pinned = torch.randn(4)
    keep = pinned.view(2, 2)  # a view the adoption is not told about pins the original
    with pytest.raises(PinnedStorageError):
        p1.adopt([torch.randn(3), pinned])
    assert _view(p1) == before and len(p1.registry) == N
    del keep
    p1.adopt([torch.randn(3), pinned])
    assert len(p1.registry) == N + 2 and p1.is_valid()


def test_relocation_keeps_a_runs_bindings() -> None:
    p1, lean, p2, general = _pair()
    values = [t.clone() for t in lean]
    p1.disown(p1.slices()[0])
    p1.free(p1.slices()[0])
    lean, values = lean[1:], values[1:]
    p1.compact()  # new handles: the bindings move to the new ids
    assert len(p1.registry) == N - 1 and p1.is_valid()
    for t, v in zip(lean, values):
        assert torch.equal(t, v) and p1.slice_of(t) is not None


def test_batches_bound_one_after_another_are_all_found() -> None:
    pool = FlatPool(capacity=1 << 22)
    batches = [[torch.randn(2) for _ in range(k)] for k in (3, 64, 64)]
    for batch in batches:
        pool.adopt(batch)
    reg = pool.registry
    assert len(reg) == 3 + 64 + 64
    for s, t in zip(pool.slices(), [t for b in batches for t in b]):
        assert reg.bindings(s.slice_id)[0].current() is t
    params = [torch.nn.Parameter(torch.randn(2)) for _ in range(3)]
    pool.adopt(params)
    assert all(type(reg.bindings(pool.slice_of(p).slice_id)[0].ref) is ParamRef  # type: ignore[union-attr]
               for p in params)


@pytest.mark.parametrize("kind", ["parameters", "tensors"])
def test_a_dropped_member_taken_out_of_the_registry_does_not_pin_a_relocation(kind: str) -> None:
    """``disown`` + ``free`` of one member of a batch, its owner then drops it: the registry
    must have let go of it, or ``compact()`` finds the old storage held by its binding
    (``PinnedStorageError``, "held by: a ParamRef object", for parameters)."""
    make = torch.nn.Parameter if kind == "parameters" else (lambda t: t)
    ts = [make(torch.randn(3)) for _ in range(N)]
    pool = FlatPool()
    pool.adopt(ts)
    first = pool.slices()[0]
    pool.disown(first)
    pool.free(first)
    ts = ts[1:]  # the only other holder of the first member lets go
    gc.collect()
    values = [t.detach().clone() for t in ts]
    pool.compact()
    assert pool.is_valid() and len(pool.registry) == N - 1
    assert all(torch.equal(t.detach(), v) and pool.owns(t) for t, v in zip(ts, values))


def test_a_plain_tensor_alone_is_not_weakly_referenced_and_can_be_swapped() -> None:
    """Issue 20: a binding of a plain tensor alone on its original is a ``TensorRef``;
    ``swap_tensors`` refuses a tensor with a weak reference, and works here."""
    import weakref

    ts = [torch.randn(4) for _ in range(N)]
    pool = FlatPool()
    pool.adopt(ts)
    assert weakref.getweakrefcount(ts[5]) == 0
    other = torch.zeros(4)
    torch.utils.swap_tensors(ts[5], other)
    assert not pool.is_valid()  # the swapped-out tensor no longer aliases its slice
