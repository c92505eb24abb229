"""Re-adoption through the registry of objects a framework re-pointed: an autograd view whose
base stays outside the pool, and a wrapper subclass whose ``detach()`` answers for another
tensor. Both used to fail (the first pinned its original through a leftover local variable,
the second copied through the subclass and raised)."""

from __future__ import annotations

import torch

from flatpool import AdoptSpec, FlatPool, Holder
from flatpool import _torch_compat as tc


class Owner:
    pass


def test_registry_readopt_of_a_view_whose_base_stays_behind() -> None:
    owner = Owner()
    owner.t = torch.arange(6.0)
    pool = FlatPool("cpu", alignment=1)
    pool.adopt(AdoptSpec(owner.t, holders=(Holder(owner, "t"),)))
    outside = torch.arange(10.0, 22.0)
    owner.t = outside[:6]  # a view: its base pins the storage unless the impl is swapped
    del outside
    assert not pool.is_valid()
    report = pool.readopt()
    assert report.all_released and pool.is_valid()
    assert torch.equal(owner.t, torch.arange(10.0, 16.0)) and owner.t._base is None


class LyingDetach(torch.Tensor):
    """A storage-sharing wrapper whose detach() returns something else (HyperParallel's
    DTensor detaches its local tensor)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> "LyingDetach":
        return torch.Tensor._make_subclass(cls, data)  # type: ignore[no-any-return]

    def detach(self) -> torch.Tensor:  # type: ignore[override]
        return torch.full(tuple(tc.impl_size(self)), -1.0)


def test_registry_readopt_copies_the_objects_own_bytes() -> None:
    w = LyingDetach(torch.arange(4.0))
    pool = FlatPool("cpu", alignment=1)
    pool.adopt(w)
    elsewhere = torch.arange(4.0) + 100
    with tc.no_torch_function(), torch.no_grad():
        tc.impl_set_(w, elsewhere.untyped_storage(), 0, (4,), (1,))
    del elsewhere
    assert pool.readopt().all_released and pool.is_valid()
    with tc.no_torch_function():
        assert torch.equal(torch.Tensor(w).as_subclass(torch.Tensor), torch.arange(4.0) + 100)
