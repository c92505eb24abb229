"""flatpool.optim on plain modules: flat steps bit-identical to torch's foreach step, pooled
gradients and state (one storage per kind), re-adoption, refusals and fallbacks."""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from flatpool import FlatPool, census
from flatpool.errors import FlatStepWarning
from flatpool.memory import WatchedStorages
from flatpool.optim import (
    FlatOptimizer,
    FlatStepError,
    LostPlaceError,
    UnsupportedOptimizerError,
)

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adam_amsgrad_maximize": (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, maximize=True,
                                                     weight_decay=0.01)),
    "sgd_momentum_dampening": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1,
                                                     weight_decay=0.01)),
    "sgd_nesterov": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    "sgd_plain": (torch.optim.SGD, dict(lr=0.05)),
}


def mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4)).to(dtype)


def batch(step: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(step)).to(dtype)


def train_step(model: nn.Module, step: int, accumulate: int = 2) -> torch.Tensor:
    x = batch(step, next(model.parameters()).dtype)
    total = torch.zeros(())
    for micro in range(accumulate):
        loss = model(x[micro::accumulate]).square().mean()
        loss.backward()
        total = total + loss.detach()
    return total


def pair(name: str, *, alignment: int = 512, dtype: torch.dtype = torch.float32,
         **extra: Any) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, torch.optim.Optimizer,
                                FlatOptimizer, FlatPool]:
    cls, kw = OPTIMIZERS[name]
    kw = {**kw, **extra}
    ref, flat = mlp(dtype=dtype), mlp(dtype=dtype)
    pool = FlatPool(alignment=alignment, name="params")
    pool.adopt(list(flat.parameters()))
    o_ref = cls(ref.parameters(), foreach=True, **kw)
    o_flat = cls(flat.parameters(), foreach=True, **kw)
    return ref, o_ref, flat, o_flat, FlatOptimizer(o_flat, [pool], module=flat), pool


def assert_same(ref: nn.Module, o_ref: torch.optim.Optimizer, flat: nn.Module,
                o_flat: torch.optim.Optimizer) -> None:
    for a, b in zip(ref.parameters(), flat.parameters()):
        assert torch.equal(a, b)
    s_ref, s_flat = o_ref.state_dict()["state"], o_flat.state_dict()["state"]
    assert sorted(s_ref) == sorted(s_flat)
    for k in s_ref:
        assert sorted(s_ref[k]) == sorted(s_flat[k])
        for kind in s_ref[k]:
            assert torch.equal(s_ref[k][kind], s_flat[k][kind]), (k, kind)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("alignment", [1, 512])
def test_flat_step_is_bit_identical_to_foreach(name: str, alignment: int) -> None:
    ref, o_ref, flat, o_flat, fo, _ = pair(name, alignment=alignment)
    assert len(fo.segments) == 1 and not fo.fallback
    for step in range(8):
        l_ref, l_flat = train_step(ref, step), train_step(flat, step)
        assert torch.equal(l_ref, l_flat)
        n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, foreach=True)
        n_flat = fo.clip_grad_norm_(0.05)
        assert torch.equal(n_ref, n_flat)
        o_ref.step()
        fo.step()
        o_ref.zero_grad()
        o_flat.zero_grad(set_to_none=step % 2 == 0)  # both modes
        assert_same(ref, o_ref, flat, o_flat)


def test_one_storage_per_kind_and_no_per_parameter_storage() -> None:
    ref, o_ref, flat, o_flat, fo, pool = pair("adamw")
    for step in range(3):
        train_step(flat, step)
        fo.clip_grad_norm_(1.0)
        fo.step()
        if step < 2:
            o_flat.zero_grad()
    c = census(flat, o_flat)
    by_role: dict[str, set[str | None]] = {}
    for r in c.records:
        for role in r.roles:
            by_role.setdefault(role, set()).add(r.pool)
    assert by_role["parameter"] == {"params"}
    assert by_role["grad"] == {"params/grad"}
    assert by_role["optimizer state"] == {"params/exp_avg", "params/exp_avg_sq", "params/step"}
    assert len(c.records) == 5  # params, grad, exp_avg, exp_avg_sq, step: nothing per parameter


def test_gradients_autograd_made_die_at_the_step() -> None:
    model = mlp()
    pool = FlatPool()
    pool.adopt(list(model.parameters()))
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    train_step(model, 0)  # before flatpool: autograd makes one gradient storage per parameter
    watch = WatchedStorages({"grad": [p.grad for p in model.parameters() if p.grad is not None]})
    assert len(watch) == 6
    fo = FlatOptimizer(opt, [pool])  # no module: the step absorbs what autograd made
    assert watch.alive_storages() == []  # copied into the pool at setup; the originals died
    fo.step()
    opt.zero_grad()
    train_step(model, 1)  # no forward hook: autograd makes new storages again ...
    watch = WatchedStorages({"grad": [p.grad for p in model.parameters()]})
    assert len(watch) == 6
    fo.step()  # ... and the step moves them into the pool
    assert watch.alive_storages() == []
    assert all(fo.grads.buffer(pool).owns(p.grad) for p in model.parameters())


def test_no_gradient_storage_is_made_with_the_module_hook() -> None:
    _, _, flat, o_flat, fo, pool = pair("adamw")
    grad_pool = fo.grads.buffer(pool)
    for step in range(3):
        train_step(flat, step)
        assert all(grad_pool.owns(p.grad) for p in flat.parameters())  # backward wrote there
        fo.step()
        o_flat.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in flat.parameters())


def test_state_dict_save_load_resume_is_identical() -> None:
    ref, o_ref, flat, o_flat, fo, pool = pair("adamw")
    for step in range(3):
        for m, o, s in ((ref, o_ref, o_ref.step), (flat, o_flat, fo.step)):
            train_step(m, step)
            s()
            o.zero_grad()
    buf = io.BytesIO()
    torch.save({"model": flat.state_dict(), "opt": o_flat.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    # resume into a fresh model and optimizer; the state is loaded before and after setup
    for before in (True, False):
        model = mlp(seed=1)
        model.load_state_dict(saved["model"])
        p2 = FlatPool()
        p2.adopt(list(model.parameters()))
        opt = torch.optim.AdamW(model.parameters(), foreach=True, lr=1e-2, weight_decay=0.1)
        if before:
            opt.load_state_dict(copy.deepcopy(saved["opt"]))
            fo2 = FlatOptimizer(opt, [p2], module=model)
        else:
            fo2 = FlatOptimizer(opt, [p2], module=model)
            opt.load_state_dict(copy.deepcopy(saved["opt"]))  # re-adopted at the next step
        r2 = mlp()
        r2.load_state_dict(ref.state_dict())
        o_r2 = torch.optim.AdamW(r2.parameters(), foreach=True, lr=1e-2, weight_decay=0.1)
        o_r2.load_state_dict(copy.deepcopy(o_ref.state_dict()))  # load_state_dict shares tensors
        for step in range(3, 6):
            train_step(model, step)
            train_step(r2, step)
            fo2.step()
            o_r2.step()
            opt.zero_grad()
            o_r2.zero_grad()
        assert_same(r2, o_r2, model, opt)
        assert fo2.replans == (0 if before else 1)
        records = census(model, opt).records  # grads are None after zero_grad()
        assert len(records) == 4 and all(r.pool is not None for r in records)


def test_torch_step_on_pooled_state_is_refused() -> None:
    _, _, flat, o_flat, fo, _ = pair("adamw")
    train_step(flat, 0)
    before = [p.detach().clone() for p in flat.parameters()]
    with pytest.raises(FlatStepError, match="FlatOptimizer.step"):
        o_flat.step()
    assert all(torch.equal(a, b) for a, b in zip(before, flat.parameters()))
    fo.close()  # per parameter from now on: each parameter has its own step count again
    o_flat.step()
    steps = {id(o_flat.state[p]["step"].untyped_storage()) for p in flat.parameters()}
    assert len(steps) == 6


def test_non_elementwise_optimizer_is_refused() -> None:
    model = mlp()
    pool = FlatPool()
    pool.adopt(list(model.parameters()))
    for opt in (torch.optim.LBFGS(model.parameters()), torch.optim.Adagrad(model.parameters())):
        with pytest.raises(UnsupportedOptimizerError, match="no flat rule"):
            FlatOptimizer(opt, [pool])
        assert all(p.grad is None for p in model.parameters())


def _fallback_case(setup: Callable[[nn.Module, list[dict[str, Any]]], None], match: str) -> None:
    """A group flatpool cannot step flat is stepped per parameter, with a warning, and the
    result still equals the reference."""
    ref, flat = mlp(), mlp()
    pool = FlatPool()
    pool.adopt(list(flat[0].parameters()) + list(flat[2].parameters()))  # flat[4] stays out
    groups_ref: list[dict[str, Any]] = [{"params": list(ref[0].parameters()) + list(ref[2].parameters())},
                                        {"params": list(ref[4].parameters())}]
    groups_flat: list[dict[str, Any]] = [{"params": list(flat[0].parameters()) + list(flat[2].parameters())},
                                         {"params": list(flat[4].parameters())}]
    setup(ref, groups_ref)
    setup(flat, groups_flat)
    o_ref = torch.optim.AdamW(groups_ref, foreach=True, lr=1e-2)
    o_flat = torch.optim.AdamW(groups_flat, foreach=True, lr=1e-2)
    with pytest.warns(FlatStepWarning, match=match):
        fo = FlatOptimizer(o_flat, [pool], module=flat)
    assert fo.fallback == [1] and len(fo.segments) == 1
    for step in range(4):
        train_step(ref, step)
        train_step(flat, step)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, foreach=True)
        fo.clip_grad_norm_(0.05)
        o_ref.step()
        fo.step()
        o_ref.zero_grad()
        o_flat.zero_grad()
    assert_same(ref, o_ref, flat, o_flat)


def test_parameters_outside_the_pools_fall_back() -> None:
    _fallback_case(lambda m, g: None, "in none of the given pools")


def test_different_step_counts_fall_back() -> None:
    ref, flat = mlp(), mlp()
    pool = FlatPool()
    pool.adopt(list(flat.parameters()))
    opts = []
    for model in (ref, flat):
        o = torch.optim.AdamW(model.parameters(), foreach=True, lr=1e-2)
        for step in range(2):
            train_step(model, step)
            if step:
                model[4].weight.grad = None  # torch skips it: its step count stays behind
            o.step()
            o.zero_grad()
        opts.append(o)
    with pytest.warns(FlatStepWarning, match="different step counts"):
        fo = FlatOptimizer(opts[1], [pool], module=flat)
    assert fo.fallback == [0]
    for step in range(2, 4):
        train_step(ref, step)
        train_step(flat, step)
        opts[0].step()
        fo.step()
    assert_same(ref, opts[0], flat, opts[1])


def test_a_missing_gradient_dissolves_the_group() -> None:
    ref, o_ref, flat, o_flat, fo, _ = pair("adamw")
    for step in range(4):
        train_step(ref, step)
        train_step(flat, step)
        if step == 2:
            ref[4].bias.grad = None
            flat[4].bias.grad = None
            with pytest.warns(FlatStepWarning, match="no gradient"):
                fo.step()
        else:
            fo.step()
        o_ref.step()
        o_ref.zero_grad()
        o_flat.zero_grad()
    assert fo.fallback == [0] and not fo.segments
    assert_same(ref, o_ref, flat, o_flat)


def test_capturable_and_complex_fall_back() -> None:
    model = mlp()
    pool = FlatPool()
    pool.adopt(list(model.parameters()))
    opt = torch.optim.Adam(model.parameters(), foreach=True, capturable=True)
    with pytest.warns(FlatStepWarning, match="capturable"):
        fo = FlatOptimizer(opt, [pool])
    assert fo.fallback == [0]
    z = nn.Parameter(torch.randn(4, dtype=torch.complex64))
    p2 = FlatPool()
    p2.adopt(z)
    with pytest.warns(FlatStepWarning, match="complex"):
        FlatOptimizer(torch.optim.Adam([z], foreach=True), [p2])


def test_a_parameter_that_left_the_pool_is_refused_until_readopted() -> None:
    ref, o_ref, flat, o_flat, fo, pool = pair("adamw")
    for m, o, s in ((ref, o_ref, o_ref.step), (flat, o_flat, fo.step)):
        train_step(m, 0)
        s()
        o.zero_grad()
    w = flat[2].weight
    with torch.no_grad():
        w.set_(w.detach().clone())  # a framework re-materialized it elsewhere
    train_step(ref, 1)
    train_step(flat, 1)
    before = [p.detach().clone() for p in flat.parameters()]
    with pytest.raises(LostPlaceError, match="left its place"):
        fo.step()
    assert all(torch.equal(a, b) for a, b in zip(before, flat.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the clone we made above is kept alive by nobody
        pool.readopt()
    assert pool.owns(w)
    fo.step()
    o_ref.step()
    assert_same(ref, o_ref, flat, o_flat)


def test_other_slices_in_the_pool_are_not_touched() -> None:
    ref, flat = mlp(), mlp()
    buf = torch.randn(10)
    pool = FlatPool()
    params = list(flat.parameters())
    pool.adopt(params[:2] + [buf] + params[2:])  # a non-parameter between the parameters
    before = buf.clone()
    o_ref = torch.optim.AdamW(ref.parameters(), foreach=True, weight_decay=0.5)
    o_flat = torch.optim.AdamW(flat.parameters(), foreach=True, weight_decay=0.5)
    fo = FlatOptimizer(o_flat, [pool], module=flat)
    assert len(fo.segments) == 2
    for step in range(3):
        train_step(ref, step)
        train_step(flat, step)
        o_ref.step()
        fo.step()
    assert torch.equal(buf, before)
    assert_same(ref, o_ref, flat, o_flat)


def test_fused_groups_get_the_foreach_math_with_a_warning() -> None:
    ref, o_ref, flat, _, _, pool = pair("adamw")
    o_flat = torch.optim.AdamW(flat.parameters(), fused=True, lr=1e-2, weight_decay=0.1)
    with pytest.warns(FlatStepWarning, match="foreach math"):
        fo = FlatOptimizer(o_flat, [pool], module=flat)
    for step in range(3):
        train_step(ref, step)
        train_step(flat, step)
        o_ref.step()
        fo.step()
    for a, b in zip(ref.parameters(), flat.parameters()):
        assert torch.equal(a, b)  # bit-identical to foreach=True, not to fused


def test_fused_policy_runs_the_fused_kernel_within_its_bound() -> None:
    ref, flat = mlp(), mlp()
    pool = FlatPool()
    pool.adopt(list(flat.parameters()))
    o_ref = torch.optim.AdamW(ref.parameters(), fused=True, lr=1e-2)
    o_flat = torch.optim.AdamW(flat.parameters(), fused=True, lr=1e-2)
    fo = FlatOptimizer(o_flat, [pool], module=flat, fused="fused")
    for step in range(5):
        train_step(ref, step)
        train_step(flat, step)
        o_ref.step()
        fo.step()
        o_ref.zero_grad()
        o_flat.zero_grad()
    for a, b in zip(ref.parameters(), flat.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bad_arguments_are_typed_and_change_nothing() -> None:
    from flatpool import InvalidTypeError
    model = mlp()
    pool = FlatPool()
    pool.adopt(list(model.parameters()))
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    with pytest.raises(InvalidTypeError):
        FlatOptimizer(model, [pool])  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError):
        FlatOptimizer(opt, [model.parameters()])  # type: ignore[list-item]
    with pytest.raises(InvalidTypeError):
        FlatOptimizer(opt, [pool], fused="yes")  # type: ignore[arg-type]
    assert not opt.state and all(p.grad is None for p in model.parameters())
