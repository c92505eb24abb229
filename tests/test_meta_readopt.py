"""Meta flows: plan from meta, materialize_into the pool with no second storage, and re-adopt
after a framework re-materialized on its own (to_empty, load_state_dict)."""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from flatpool.testing import FailAt, set_fault_hook
from flatpool import (
    AdoptSpec,
    FlatPool,
    InvalidRequestError,
    PinnedStorageError,
    census,
    storage_of,
)


class CountAllocations(TorchDispatchMode):
    """Counts every op output on a storage none of the op's inputs had: a new allocation."""

    def __init__(self) -> None:
        super().__init__()
        self.allocations: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            int(a.untyped_storage()._cdata)
            for a in tree_flatten((args, kwargs))[0]
            if isinstance(a, torch.Tensor) and not a.is_meta
        }
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor) and not o.is_meta:
                s = o.untyped_storage()
                if int(s._cdata) not in inputs and s.nbytes() > 0:
                    self.allocations.append((str(func), s.nbytes()))
        return out


def _meta_model() -> torch.nn.Module:
    with torch.device("meta"):
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _init(model: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.reset_parameters()


def test_plan_from_meta_materialize_into_allocates_nothing_but_the_pool() -> None:
    model = _meta_model()
    params = list(model.parameters())
    ids = [id(p) for p in params]
    pool = FlatPool(name="meta")
    slices = [pool.allocate_like(p) for p in params]  # plans only
    assert not pool.is_materialized
    with CountAllocations() as counter:
        got = pool.materialize_into(params, slices)
        _init(model, 0)
    assert got == tuple(slices)
    nbytes = [n for _, n in counter.allocations]
    assert nbytes == [pool.capacity], counter.allocations  # the pool's one buffer, nothing else
    assert [id(p) for p in model.parameters()] == ids
    for p, slc in zip(model.parameters(), slices):
        assert isinstance(p, torch.nn.Parameter) and p.requires_grad and p.is_leaf
        assert pool.slice_of(p) == slc and not p.is_meta
    # reset_parameters initialized in place: the same values as an eager model with that seed.
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    _init(eager, 0)
    for p, q in zip(model.parameters(), eager.parameters()):
        assert torch.equal(p, q)
    c = census(model, pools=[pool])
    assert len(c.records) == 1 and c.records[0].pool == "meta"
    assert pool.is_valid()


def test_materialize_into_allocates_slices_and_trains_like_eager() -> None:
    model = _meta_model()
    pool = FlatPool(name="auto")
    pool.materialize_into(list(model.parameters()))
    _init(model, 5)
    eager = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    _init(eager, 5)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_opt = torch.optim.Adam(eager.parameters(), lr=0.01)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    for m, o in ((model, opt), (eager, ref_opt)):
        for _ in range(3):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
    for p, q in zip(model.parameters(), eager.parameters()):
        assert torch.equal(p, q) and pool.owns(p)


def test_materialize_into_dtensor_parameter(single_rank_mesh: Any) -> None:
    from torch.distributed.tensor import DTensor, Shard

    with torch.device("meta"):
        local = torch.empty(6, 3)
    p = torch.nn.Parameter(DTensor.from_local(local, single_rank_mesh, [Shard(0)], run_check=False))
    del local
    ident = id(p)
    pool = FlatPool(name="dmeta")
    (slc,) = pool.materialize_into(p)
    assert id(p) == ident and isinstance(p, DTensor) and isinstance(p, torch.nn.Parameter)
    inner = p._local_tensor  # type: ignore[attr-defined]
    assert not inner.is_meta and pool.slice_of(inner) == slc
    with torch.no_grad():
        inner.copy_(torch.arange(18.0).view(6, 3))
    assert torch.equal(slc.tensor(), torch.arange(18.0).view(6, 3))
    assert pool.is_valid()


def test_materialize_into_rejects_and_rolls_back() -> None:
    pool = FlatPool(capacity=4096, name="rb")
    with torch.device("meta"):
        a, b = torch.nn.Parameter(torch.empty(4)), torch.nn.Parameter(torch.empty(3))
    with pytest.raises(InvalidRequestError, match="meta"):
        pool.materialize_into([a, torch.nn.Parameter(torch.randn(2))])
    with pytest.raises(InvalidRequestError, match="twice"):
        pool.materialize_into([a, a])
    with pytest.raises(InvalidRequestError, match="slices"):
        pool.materialize_into([a, b], [pool.allocate(4, torch.float32)])
    given = [pool.allocate(4, torch.float32), pool.allocate(5, torch.float32)]  # 5 != 3
    before = pool.describe()
    with pytest.raises(InvalidRequestError, match="slice"):
        pool.materialize_into([a, b], given)
    assert a.is_meta and b.is_meta and pool.describe() == before
    assert not pool.registry.holds(given[0])


@pytest.mark.parametrize("exc_type", [RuntimeError, KeyboardInterrupt])
def test_materialize_into_fault_at_every_step(exc_type: type[BaseException]) -> None:
    steps: list[str] = []
    with torch.device("meta"):
        probe = [torch.nn.Parameter(torch.empty(4)), torch.nn.Parameter(torch.empty(2, 2))]
    set_fault_hook(steps.append)
    FlatPool(capacity=4096).materialize_into(probe)
    set_fault_hook(None)
    assert steps
    for k in range(len(steps)):
        with torch.device("meta"):
            params = [torch.nn.Parameter(torch.empty(4)), torch.nn.Parameter(torch.empty(2, 2))]
        ids = [id(p) for p in params]
        pool = FlatPool(capacity=4096)
        before = pool.describe()
        set_fault_hook(FailAt(k, exc_type))
        with pytest.raises(exc_type):
            pool.materialize_into(params)
        set_fault_hook(None)
        assert [id(p) for p in params] == ids and all(p.is_meta for p in params)
        assert pool.slices() == () and pool.describe().splitlines()[1:] == before.splitlines()[1:]
        pool.materialize_into(params)  # and then it succeeds
        assert all(pool.owns(p) for p in params)


# -- re-adoption after a framework re-materialized -------------------------------------------
def _adopted_model(seed: int = 0) -> tuple[torch.nn.Module, FlatPool]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    pool = FlatPool(capacity=1 << 14, name="re")
    assert pool.adopt(list(model.parameters())).all_released
    return model, pool


def test_readopt_after_to_empty_leaves_only_the_pool() -> None:
    model, pool = _adopted_model()
    sd = copy.deepcopy(model.state_dict())
    ids = [id(p) for p in model.parameters()]
    slices = pool.slices()
    model.to_empty(device="cpu")  # new storages for the same Parameter objects
    assert [id(p) for p in model.parameters()] == ids
    assert not pool.is_valid() and set(pool.moved()) == set(slices)
    model.load_state_dict(sd)  # values land in the new storages, not in the pool
    refs = [StorageWeakRef(storage_of(p)) for p in model.parameters()]
    report = pool.readopt()
    assert report.all_released and all(r.expired() for r in refs)
    assert pool.is_valid() and pool.moved() == [] and pool.slices() == slices
    assert [id(p) for p in model.parameters()] == ids
    for (k, v), p in zip(sd.items(), model.parameters()):
        assert torch.equal(p, v) and pool.owns(p)
    gc.collect()
    c = census(model, pools=[pool])
    assert len(c.records) == 1 and c.records[0].pool == "re"
    # Idempotent: nothing moved, nothing happens.
    desc = pool.describe()
    again = pool.readopt()
    assert again.items == () and pool.describe() == desc


def test_readopt_after_reset_parameters_elsewhere() -> None:
    model, pool = _adopted_model(1)
    lin = model[0]
    assert isinstance(lin, torch.nn.Linear)
    lin.weight.data = torch.zeros(6, 4)  # a framework installed a new storage
    assert pool.moved() == [pool.slices()[0]]
    report = pool.readopt()
    assert report.all_released and len(report.items) == 1
    assert pool.owns(lin.weight) and torch.equal(lin.weight, torch.zeros(6, 4))


def test_readopt_after_load_state_dict_assign_with_specs() -> None:
    model, pool = _adopted_model(2)
    slices = pool.slices()
    sd = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    expected = {k: v.clone() for k, v in sd.items()}
    model.load_state_dict(sd, assign=True)  # new Parameter objects: the registry cannot see them
    assert all(not pool.owns(p) for p in model.parameters())
    specs = [AdoptSpec(p, slice=s) for p, s in zip(model.parameters(), slices)]
    with pytest.raises(PinnedStorageError, match=r"\['0.weight'\]"):
        pool.readopt(specs)  # the state dict still holds the tensors the parameters wrap
    del sd
    report = pool.readopt(specs)
    assert report.all_released
    for (k, v), p in zip(expected.items(), model.parameters()):
        assert torch.equal(p, v) and pool.owns(p)
    assert pool.is_valid() and pool.readopt().items == ()


def test_readopt_pinned_rolls_back() -> None:
    model, pool = _adopted_model(3)
    sd = copy.deepcopy(model.state_dict())
    model.to_empty(device="cpu")
    model.load_state_dict(sd)
    w = model[0].weight
    keep = {"old": w.detach()}
    key = int(storage_of(w)._cdata)
    desc = pool.describe()
    with pytest.raises(PinnedStorageError, match=r"\['old'\]"):
        pool.readopt()
    assert int(storage_of(w)._cdata) == key and not pool.owns(w) and torch.equal(w, keep["old"])
    assert pool.describe() == desc and not pool.is_valid()
    with pytest.warns(UserWarning):
        report = pool.readopt(on_pinned="warn")
    assert not report.all_released and pool.is_valid()


def test_readopt_refuses_a_changed_shape() -> None:
    model, pool = _adopted_model(4)
    model[1].bias.data = torch.zeros(5)
    with pytest.raises(InvalidRequestError, match="changed"):
        pool.readopt()


def test_meta_then_to_empty_then_readopt() -> None:
    """FSDP2-style deferred init: the pool was planned and bound by materialize_into, then the
    framework's own to_empty moved everything out; readopt brings it back, no leftovers."""
    model = _meta_model()
    pool = FlatPool(name="defer")
    pool.materialize_into(list(model.parameters()))
    model.to_empty(device="cpu")
    assert not pool.is_valid()
    _init(model, 9)
    values = [p.detach().clone() for p in model.parameters()]
    refs = [StorageWeakRef(storage_of(p)) for p in model.parameters()]
    assert pool.readopt().all_released and all(r.expired() for r in refs)
    for p, v in zip(model.parameters(), values):
        assert torch.equal(p, v) and pool.owns(p)
    c = census(model, pools=[pool])
    assert len(c.records) == 1 and c.records[0].pool == "defer"


def test_readopt_fault_injection() -> None:
    counted: list[str] = []

    def make() -> tuple[torch.nn.Module, FlatPool, list[torch.Tensor]]:
        model, pool = _adopted_model(6)
        sd = copy.deepcopy(model.state_dict())
        model.to_empty(device="cpu")
        model.load_state_dict(sd)
        return model, pool, list(model.parameters())

    model, pool, params = make()
    set_fault_hook(counted.append)
    pool.readopt()
    set_fault_hook(None)
    for exc_type in (RuntimeError, KeyboardInterrupt):
        for k in range(len(counted)):
            model, pool, params = make()
            keys = [int(storage_of(p)._cdata) for p in params]
            values = [p.detach().clone() for p in params]
            slice_bytes = [s.bytes().clone() for s in pool.slices()]
            desc = pool.describe()
            set_fault_hook(FailAt(k, exc_type))
            with pytest.raises(exc_type):
                pool.readopt()
            set_fault_hook(None)
            assert [int(storage_of(p)._cdata) for p in params] == keys
            assert all(torch.equal(p, v) for p, v in zip(params, values))
            assert all(torch.equal(s.bytes(), b) for s, b in zip(pool.slices(), slice_bytes))
            assert pool.describe() == desc and not pool.is_valid()
            assert pool.readopt().all_released and pool.is_valid()
