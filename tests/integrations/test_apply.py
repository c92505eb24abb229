"""``nn.Module._apply`` and parameter replacement on plain modules adopted into a pool (issues
17 and 18): flatpool keeps no weak reference on a Parameter, so ``swap_tensors`` works, and a
pool whose adopted parameters were all replaced says so."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from flatpool import AdoptSpec, FlatPool, InvalidRequestError
from flatpool.errors import OrphanedSliceWarning


@pytest.fixture
def swap_on_conversion() -> Iterator[None]:
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def test_adopted_parameters_have_no_weak_reference() -> None:
    m = nn.Linear(4, 3)
    FlatPool(capacity=4096).adopt(list(m.parameters()))
    assert [weakref.getweakrefcount(p) for p in m.parameters()] == [0, 0]


def test_module_conversions_swap_adopted_parameters(swap_on_conversion: None) -> None:
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    before = [p.detach().clone() for p in m.parameters()]
    pool = FlatPool(capacity=4096)
    pool.adopt(list(m.parameters()))
    w = m.weight
    m.double()  # swap_tensors: refused ("Couldn't swap Linear.weight") with a weakref
    assert m.weight is w and w.dtype == torch.float64
    assert torch.equal(w, before[0].double())
    assert not pool.is_valid() and pool.moved() == list(pool.slices())
    with pytest.raises(InvalidRequestError, match="float64"):
        pool.readopt()  # a slice keeps its dtype
    m.float()
    report = pool.readopt()
    assert report.all_released and pool.is_valid()
    assert all(pool.owns(p) for p in m.parameters())
    assert [torch.equal(p, b) for p, b in zip(m.parameters(), before)] == [True, True]
    m.to_empty(device="cpu")
    m.cpu()
    m.requires_grad_(False)
    assert not pool.is_valid()  # to_empty gave new storages
    pool.readopt()
    assert pool.is_valid() and not any(p.requires_grad for p in m.parameters())


def test_a_pool_does_not_keep_a_dropped_parameter() -> None:
    m = nn.Linear(4, 3)
    pool = FlatPool(capacity=4096)
    slices = pool.adopt(list(m.parameters())).slices
    ref = weakref.ref(m)
    del m
    gc.collect()
    assert ref() is None
    assert not any(pool.registry.holds(s) for s in slices)  # let go at the first look
    for s in slices:
        pool.free(s)


def test_load_state_dict_assign_leaves_the_pool_invalid_and_readopt_says_so() -> None:
    m = nn.Linear(4, 3)
    pool = FlatPool(capacity=4096)
    slices = pool.adopt(list(m.parameters())).slices
    assert pool.is_valid()
    sd = {k: v.clone() + 1 for k, v in m.state_dict().items()}
    m.load_state_dict(sd, assign=True)  # new Parameter objects, none in the pool
    del sd
    assert not any(pool.owns(p) for p in m.parameters())
    assert not pool.is_valid()
    with pytest.warns(OrphanedSliceWarning, match=r"slice\(s\) 0, 1 are gone.*AdoptSpec") as got:
        assert pool.readopt().items == ()
    assert got[0].filename == __file__  # attributed to this call
    expected = [p.detach().clone() for p in m.parameters()]
    report = pool.readopt([AdoptSpec(p, slice=s) for p, s in zip(m.parameters(), slices)])
    assert report.all_released and pool.is_valid()
    assert all(pool.owns(p) and torch.equal(p, e) for p, e in zip(m.parameters(), expected))
