"""Planning the flat step: the bytes a flat kernel writes, parameters listed twice, the kernel a
``fused=True`` group asked for, and when a FlatStepWarning is said."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from flatpool import FlatPool
from flatpool.errors import FlatStepWarning
from flatpool.optim import FlatOptimizer


def _grads(ps: list[torch.Tensor], refs: list[torch.Tensor], step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for p, r in zip(ps, refs):
        grad = torch.randn(p.shape, generator=g).to(p.dtype)
        p.grad, r.grad = grad.clone(), grad.clone()


def _shared_slice() -> tuple[FlatPool, list[nn.Parameter], torch.Tensor]:
    """``a`` and ``c`` on one adopted tensor's slice, ``b`` in the next slice; ``big`` lives."""
    big, other = torch.linspace(-1, 1, 30), torch.linspace(2, 3, 8)
    pool = FlatPool(alignment=1, name="params")
    pool.adopt([big, other])
    return pool, [nn.Parameter(big[:10]), nn.Parameter(other), nn.Parameter(big[10:])], big


@pytest.mark.parametrize("foreach", [True, False])
def test_a_parameter_sharing_a_members_slice_is_stepped_once(foreach: bool) -> None:
    """Before: the flat segment over ``a..b`` spanned ``c``'s bytes, which torch's own step also
    stepped: ``c`` was decayed twice (c/c0 = 0.9025 where torch gives 0.95)."""
    pool, ps, _ = _shared_slice()
    ref = [nn.Parameter(p.detach().clone()) for p in ps]
    opt = torch.optim.AdamW(ps, lr=0.5, weight_decay=0.1, foreach=foreach)
    o_ref = torch.optim.AdamW(ref, lr=0.5, weight_decay=0.1, foreach=foreach)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FlatStepWarning)
        fo = FlatOptimizer(opt, [pool])
        for step in range(4):
            _grads(ps, ref, step)
            fo.step()
            o_ref.step()
    for p, r in zip(ps, ref):
        assert torch.equal(p, r)
    s_ref, s_flat = o_ref.state_dict()["state"], opt.state_dict()["state"]
    assert list(s_ref) == list(s_flat)  # torch's order, though torch's part of the group ran first
    assert all(torch.equal(s_ref[k][n], s_flat[k][n]) for k in s_ref for n in s_ref[k])
    assert "shares slice" in fo.reasons[0]
    # each flat range holds only bytes of the parameters it steps
    assert all(s.end - s.start == sum(m.end - m.offset for m in s.members) for s in fo.segments)


def test_a_live_view_of_a_members_slice_is_not_written() -> None:
    """``rest`` (no parameter) views the bytes of ``a``'s slice that ``a`` does not hold; before,
    the flat segment over ``a..b`` decayed them at every step."""
    pool, ps, big = _shared_slice()
    rest = big[10:]
    before = rest.clone()
    opt = torch.optim.AdamW(ps[:2], lr=0.5, weight_decay=0.1, foreach=True)
    fo = FlatOptimizer(opt, [pool])
    for step in range(3):
        _grads(ps[:2], [p.detach().clone() for p in ps[:2]], step)
        fo.step()
    assert torch.equal(rest, before)
    assert [len(s.members) for s in fo.segments] == [1, 1]


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.SGD])
def test_a_parameter_listed_twice_in_a_group_is_torchs(foreach: bool,
                                                       cls: type[torch.optim.Optimizer]) -> None:
    """torch steps a parameter listed twice twice a step. Before (since 7368f06): the flat run
    holding it read its step count after torch's step of the second listing had advanced it, so
    the run's other members were bias-corrected with the wrong step."""
    torch.manual_seed(0)
    ref = [nn.Parameter(torch.randn(n)) for n in (5, 7, 3)]
    ps = [nn.Parameter(p.detach().clone()) for p in ref]
    pool = FlatPool(alignment=1)
    pool.adopt(ps)
    kw = dict(lr=1e-2, weight_decay=0.1, foreach=foreach)
    if cls is torch.optim.SGD:
        kw.update(momentum=0.9)
    o_ref = cls([ref[0], ref[1], ref[0], ref[2]], **kw)
    opt = cls([ps[0], ps[1], ps[0], ps[2]], **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FlatStepWarning)
        fo = FlatOptimizer(opt, [pool])
        for step in range(5):
            _grads(ps, ref, step)
            fo.step()
            o_ref.step()
    for p, r in zip(ps, ref):
        assert torch.equal(p, r)
    for k, v in o_ref.state_dict()["state"].items():
        for kind, t in v.items():
            assert torch.equal(t, opt.state_dict()["state"][k][kind])
    assert "listed twice" in fo.reasons[0]
    assert fo.fallback == [0]
