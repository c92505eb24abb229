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


def _step_both(opt: torch.optim.Optimizer, pool: FlatPool, ps: list[nn.Parameter],
               o_ref: torch.optim.Optimizer, ref: list[nn.Parameter], steps: int) -> FlatOptimizer:
    """``steps`` steps of the flat optimizer over ``opt`` and of torch's ``o_ref``, the same
    gradients each; the parameters torch.equal after them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FlatStepWarning)
        fo = FlatOptimizer(opt, [pool])
        for step in range(steps):
            _grads(ps, ref, step)
            fo.step()
            o_ref.step()
    for p, r in zip(ps, ref):
        assert torch.equal(p, r)
    return fo


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
    fo = _step_both(opt, pool, ps, o_ref, ref, 4)
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
    with pytest.warns(UserWarning, match="duplicate parameters"):  # torch's own word on it
        o_ref = cls([ref[0], ref[1], ref[0], ref[2]], **kw)
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = cls([ps[0], ps[1], ps[0], ps[2]], **kw)
    fo = _step_both(opt, pool, ps, o_ref, ref, 5)
    for k, v in o_ref.state_dict()["state"].items():
        for kind, t in v.items():
            assert torch.equal(t, opt.state_dict()["state"][k][kind])
    assert "listed twice" in fo.reasons[0]
    assert fo.fallback == [0]


def _mlp(seed: int, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 13), nn.Tanh(), nn.Linear(13, 5)).to(dtype)


def _train(model: nn.Module, step: int) -> None:
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
    model(x.to(next(model.parameters()).dtype)).float().square().mean().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_group_is_torchs_fused_step(dtype: torch.dtype) -> None:
    """Before: a ``fused=True`` group ran the foreach math flat (up to 2 ulp from the user's own
    fused run). float32 AdamW has no flat fused step equal to torch's: torch's fused step runs it
    over the pooled state, said once, by the first step. bfloat16's flat fused step is exact: it
    runs flat, silently."""
    ref, flat = _mlp(0, dtype), _mlp(0, dtype)
    pool = FlatPool(name="params")
    pool.adopt(list(flat.parameters()))
    o_ref = torch.optim.AdamW(ref.parameters(), fused=True, lr=1e-2, weight_decay=0.1)
    o_flat = torch.optim.AdamW(flat.parameters(), fused=True, lr=1e-2, weight_decay=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlatStepWarning)
        fo = FlatOptimizer(o_flat, [pool], module=flat)
    exact = dtype == torch.bfloat16
    assert (0 in fo.reasons) != exact
    for step in range(20):
        for m, o in ((ref, o_ref), (flat, o_flat)):
            _train(m, step)
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                o.step()
            o.zero_grad()
            if o is o_flat:
                told = [str(w.message) for w in said if w.category is FlatStepWarning]
                assert len(told) == (1 if step == 0 and not exact else 0), told
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), flat.parameters()))
    s_ref, s_flat = o_ref.state_dict()["state"], o_flat.state_dict()["state"]
    assert all(torch.equal(s_ref[k][n], s_flat[k][n]) for k in s_ref for n in s_ref[k])
    assert len(fo.buffers()["state"]) > 0  # the state is pooled either way


def test_a_flat_fused_sgd_step_is_exact_where_the_table_says() -> None:
    """float32 SGD without momentum: the flat fused step equals torch's fused step per parameter
    (measured), so it runs flat; with momentum it does not, so torch's fused step runs it."""
    for momentum, flat_expected in ((0.0, True), (0.9, False)):
        ref, flat = _mlp(1, torch.float32), _mlp(1, torch.float32)
        pool = FlatPool()
        pool.adopt(list(flat.parameters()))
        kw = dict(lr=0.1, momentum=momentum, weight_decay=0.01, fused=True)
        o_ref = torch.optim.SGD(ref.parameters(), **kw)
        o_flat = torch.optim.SGD(flat.parameters(), **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FlatStepWarning)
            fo = FlatOptimizer(o_flat, [pool], module=flat)
            for step in range(10):
                for m, o in ((ref, o_ref), (flat, o_flat)):
                    _train(m, step)
                    o.step()
        assert (0 not in fo.reasons) == flat_expected
        assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), flat.parameters()))


def test_torchtitans_order_warns_only_about_steps_torch_runs() -> None:
    """torchtitan's order: the optimizer and the flat optimizer are built before the parameters
    are in their pool, and the first forward puts them there (the plan is made again). Before:
    setup warned that the group "is stepped per parameter by torch's own step", though every
    step was flat. Now ``reasons`` says why meanwhile, and nothing is said; a group that torch
    does step warns once, at its first step."""
    ref, flat = _mlp(2, torch.float32), _mlp(2, torch.float32)
    extra = nn.Parameter(torch.linspace(-1, 1, 6))  # never pooled: torch steps its group
    ref_extra = nn.Parameter(extra.detach().clone())
    pool = FlatPool(name="params")
    o_ref = torch.optim.AdamW([{"params": list(ref.parameters())}, {"params": [ref_extra]}],
                              foreach=True, lr=1e-2, weight_decay=0.1)
    o_flat = torch.optim.AdamW([{"params": list(flat.parameters())}, {"params": [extra]}],
                               foreach=True, lr=1e-2, weight_decay=0.1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        fo = FlatOptimizer(o_flat, [pool], module=flat)
        assert "in none of the given pools" in fo.reasons[0]
        pool.adopt(list(flat.parameters()))  # what the framework does before the first forward
        for step in range(3):
            for m, o, e in ((ref, o_ref, ref_extra), (flat, o_flat, extra)):
                _train(m, step)
                e.grad = torch.full_like(e, 0.5)
                o.step()
            told = [str(w.message) for w in said if w.category is FlatStepWarning]
            assert len(told) == 1 and "param_groups[1]" in told[0], told
    assert fo.replans == 1 and 0 not in fo.reasons and fo.fallback == [1]
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), flat.parameters()))
    assert torch.equal(extra, ref_extra)
