"""flatpool.optim on plain modules: flat steps bit-identical to torch's foreach step, pooled
gradients and state (one storage per kind), re-adoption, refusals and fallbacks."""

from __future__ import annotations

import copy
import io
import warnings
from pathlib import Path
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


def test_gradients_autograd_made_stay_the_grads_and_die_as_with_torch() -> None:
    model = mlp()
    pool = FlatPool()
    pool.adopt(list(model.parameters()))
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    train_step(model, 0)  # before flatpool: autograd makes one gradient storage per parameter
    grads = [p.grad for p in model.parameters()]
    fo = FlatOptimizer(opt, [pool])  # no module: the step copies what autograd made
    fo.step()
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))  # not flatpool's: kept
    assert fo.grads.buffer(pool) is not None  # copied into the gradient pool for the step
    watch = WatchedStorages({"grad": grads})
    del grads
    opt.zero_grad()  # set_to_none=True: they die as with torch, and so does the pool
    assert watch.alive_storages() == [] and fo.grads.buffer(pool) is None


def test_no_gradient_storage_is_made_with_the_module_hook() -> None:
    _, _, flat, o_flat, fo, pool = pair("adamw")
    assert fo.grads.buffer(pool) is None  # no gradient memory before a backward, as with torch
    for step in range(3):
        train_step(flat, step)
        grad_pool = fo.grads.buffer(pool)  # one block per backward (released by zero_grad)
        assert grad_pool is not None
        assert all(grad_pool.owns(p.grad) for p in flat.parameters())  # backward wrote there
        fo.step()
        o_flat.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in flat.parameters())
        assert fo.grads.buffer(pool) is None


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


def test_optimizer_step_is_the_flat_step_and_close_gives_torchs_back() -> None:
    """Issue 30: ``optimizer.step()`` itself runs the flat step, with the optimizer's step hooks
    once a step; ``close()`` leaves no attribute behind and each parameter keeps a step tensor
    of its own, so torch's step goes on identically. (Until issue 30 ``optimizer.step()`` on
    pooled Adam state raised ``FlatStepError``: one step count was shared by a segment.)"""
    ref, o_ref, flat, o_flat, fo, _ = pair("adamw")
    calls: list[str] = []
    o_flat.register_step_pre_hook(lambda *a: calls.append("pre"))
    o_flat.register_step_post_hook(lambda *a: calls.append("post"))
    for step in range(5):
        if step == 3:
            fo.close()
            assert "step" not in o_flat.__dict__ and "zero_grad" not in o_flat.__dict__
        train_step(ref, step)
        train_step(flat, step)
        o_ref.step()
        o_flat.step()
        o_ref.zero_grad()
        o_flat.zero_grad()
        assert_same(ref, o_ref, flat, o_flat)
    assert calls == ["pre", "post"] * 5
    steps = {id(o_flat.state[p]["step"]) for p in flat.parameters()}
    assert len(steps) == 6 and {float(o_flat.state[p]["step"]) for p in flat.parameters()} == {5.0}


def test_non_elementwise_optimizer_is_refused() -> None:
    model = mlp()
    pool = FlatPool()
    pool.adopt(list(model.parameters()))
    for opt in (torch.optim.LBFGS(model.parameters()), torch.optim.Adagrad(model.parameters())):
        with pytest.raises(UnsupportedOptimizerError, match="no flat rule"):
            FlatOptimizer(opt, [pool])
        assert all(p.grad is None for p in model.parameters())


def _fallback_case(setup: Callable[[nn.Module, list[dict[str, Any]]], None], match: str) -> None:
    """A group flatpool cannot step flat is stepped per parameter, with a warning from its first
    step (setup only notes the reason), and the result still equals the reference."""
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
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlatStepWarning)
        fo = FlatOptimizer(o_flat, [pool], module=flat)
    assert fo.fallback == [1] and len(fo.segments) == 1 and match in fo.reasons[1]
    for step in range(4):
        train_step(ref, step)
        train_step(flat, step)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, foreach=True)
        fo.clip_grad_norm_(0.05)
        o_ref.step()
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            fo.step()
        assert [match in str(w.message) for w in said] == ([True] if step == 0 else [])
        o_ref.zero_grad()
        o_flat.zero_grad()
    assert_same(ref, o_ref, flat, o_flat)


def test_parameters_outside_the_pools_fall_back() -> None:
    _fallback_case(lambda m, g: None, "in none of the given pools")


def test_different_step_counts_step_flat() -> None:
    """Each parameter has its own step count (issue 30): counts that differ split a segment into
    runs of equal counts, still flat (until issue 30 the group fell back)."""
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
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlatStepWarning)
        fo = FlatOptimizer(opts[1], [pool], module=flat)
        assert not fo.fallback
        for step in range(2, 4):
            train_step(ref, step)
            train_step(flat, step)
            opts[0].step()
            opts[1].step()
    assert_same(ref, opts[0], flat, opts[1])
    assert float(opts[1].state[flat[4].weight]["step"]) == 3.0


def test_a_missing_gradient_is_skipped_as_torch_skips_it() -> None:
    """A parameter without a gradient is skipped (no weight decay, no step count), the rest of
    its segment steps flat (until issue 30 the group fell back for good)."""
    ref, o_ref, flat, o_flat, fo, _ = pair("adamw")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlatStepWarning)
        for step in range(4):
            train_step(ref, step)
            train_step(flat, step)
            if step == 2:
                ref[4].bias.grad = None
                flat[4].bias.grad = None
            o_ref.step()
            o_flat.step()
            o_ref.zero_grad()
            o_flat.zero_grad()
    assert not fo.fallback and len(fo.segments) == 1
    assert_same(ref, o_ref, flat, o_flat)
    assert float(o_flat.state[flat[4].bias]["step"]) == 3.0


def test_capturable_and_complex_fall_back() -> None:
    model = mlp()
    pool = FlatPool()
    pool.adopt(list(model.parameters()))
    opt = torch.optim.Adam(model.parameters(), foreach=True, capturable=True)
    fo = FlatOptimizer(opt, [pool])
    assert fo.fallback == [0] and "capturable" in fo.reasons[0]
    train_step(model, 0)
    with pytest.warns(FlatStepWarning, match="capturable"), \
            pytest.raises(AssertionError, match="capturable"):  # torch's own step, on CPU
        fo.step()
    z = nn.Parameter(torch.randn(4, dtype=torch.complex64))
    p2 = FlatPool()
    p2.adopt(z)
    fo2 = FlatOptimizer(torch.optim.Adam([z], foreach=True), [p2])
    z.grad = torch.ones_like(z)
    with pytest.warns(FlatStepWarning, match="complex"):
        fo2.step()


def test_a_parameter_that_left_the_pool_is_stepped_by_torch_until_readopted() -> None:
    """A member that left its pooled place is stepped by torch's own step (a warning says so),
    and flat again once re-adopted (until issue 30 the step raised ``LostPlaceError``)."""
    ref, o_ref, flat, o_flat, fo, pool = pair("adamw")
    for m, o in ((ref, o_ref), (flat, o_flat)):
        train_step(m, 0)
        o.step()
        o.zero_grad()
    w = flat[2].weight
    with torch.no_grad():
        w.set_(w.detach().clone())  # a framework re-materialized it elsewhere
    train_step(ref, 1)
    with pytest.warns(FlatStepWarning, match="in none of the given pools"):
        train_step(flat, 1)  # the forward's check finds it
        o_flat.step()
    o_ref.step()
    assert_same(ref, o_ref, flat, o_flat)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the clone we made above is kept alive by nobody
        pool.readopt()
    assert pool.owns(w)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlatStepWarning)
        train_step(ref, 2)
        train_step(flat, 2)
        o_flat.step()
        o_ref.step()
    assert fo.replans == 2 and len(fo.segments) == 1
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


def test_fused_groups_get_the_foreach_math_when_asked() -> None:
    ref, o_ref, flat, _, _, pool = pair("adamw")
    o_flat = torch.optim.AdamW(flat.parameters(), fused=True, lr=1e-2, weight_decay=0.1)
    fo = FlatOptimizer(o_flat, [pool], module=flat, fused="foreach")
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


def test_pool_growth_replans_and_keeps_state() -> None:
    ref, o_ref, flat, o_flat, fo, pool = pair("adamw")
    for m, o, s in ((ref, o_ref, o_ref.step), (flat, o_flat, fo.step)):
        train_step(m, 0)
        s()
        o.zero_grad()
    old_state = fo.buffers()["state"]
    pool.grow(pool.capacity * 2)  # a new parameter storage and a new layout signature
    for m, o, s in ((ref, o_ref, o_ref.step), (flat, o_flat, fo.step)):
        train_step(m, 1)
        s()
    assert fo.replans == 1
    assert all(b.name.startswith("params/") for b in fo.buffers()["state"])
    assert not any(a is b for a in old_state for b in fo.buffers()["state"])
    assert_same(ref, o_ref, flat, o_flat)
    records = census(flat, o_flat).records
    assert len(records) == 5 and all(r.pool is not None for r in records)


def test_verify_forward_is_accepted_and_the_step_still_checks() -> None:
    """``verify="forward"`` is accepted (compatibility); every step checks what it relies on,
    so a member moved after the forward is stepped by torch, not flat from a stale place."""
    cls, kw = OPTIMIZERS["adamw"]
    ref, flat = mlp(), mlp()
    pool = FlatPool()
    pool.adopt(list(flat.parameters()))
    o_ref = cls(ref.parameters(), foreach=True, **kw)
    o_flat = cls(flat.parameters(), foreach=True, **kw)
    FlatOptimizer(o_flat, [pool], module=flat, verify="forward")
    for step in range(3):
        train_step(ref, step)
        train_step(flat, step)
        if step == 2:
            w = flat[0].weight
            with torch.no_grad():
                w.set_(w.detach().clone())
        o_ref.step()
        if step == 2:
            with pytest.warns(FlatStepWarning, match="in none of the given pools"):
                o_flat.step()
        else:
            o_flat.step()
        o_ref.zero_grad()
        o_flat.zero_grad()
    assert_same(ref, o_ref, flat, o_flat)


def test_a_sparse_gradient_is_torchs_to_refuse() -> None:
    """A sparse gradient: the group is torch's, whose Adam refuses it before stepping anything
    (until issue 30 flatpool raised its own ``FlatStepError``)."""
    ref, o_ref, flat, o_flat, fo, pool = pair("adamw")
    train_step(flat, 0)
    o_flat.step()
    before = [p.detach().clone() for p in flat.parameters()]
    state = {k: v.clone() for k, v in o_flat.state[flat[0].weight].items()}
    grads = [p.grad.clone() for p in flat.parameters()]  # type: ignore[union-attr]
    flat[2].bias.grad = torch.ones(16).to_sparse()
    with pytest.warns(FlatStepWarning, match="sparse"), pytest.raises(RuntimeError, match="sparse"):
        o_flat.step()
    assert all(torch.equal(a, b) for a, b in zip(before, flat.parameters()))
    assert all(torch.equal(v, o_flat.state[flat[0].weight][k]) for k, v in state.items())
    assert all(torch.equal(g, p.grad) for g, p in zip(grads[:3], list(flat.parameters())[:3]))


def test_mixed_dtypes_in_one_pool_step_per_dtype() -> None:
    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4).to(torch.bfloat16))

    def run(m: nn.Module, step: int) -> None:
        x = batch(step)
        m[1](m[0](x).to(torch.bfloat16)).float().square().mean().backward()

    ref, flat = model(), model()
    pool = FlatPool()
    pool.adopt(list(flat.parameters()))  # float32 and bfloat16 slices in one pool
    o_ref = torch.optim.AdamW(ref.parameters(), foreach=True, lr=1e-2, weight_decay=0.1)
    o_flat = torch.optim.AdamW(flat.parameters(), foreach=True, lr=1e-2, weight_decay=0.1)
    fo = FlatOptimizer(o_flat, [pool], module=flat)
    assert sorted(str(s.dtype) for s in fo.segments) == ["torch.bfloat16", "torch.float32"]
    for step in range(4):
        run(ref, step)
        run(flat, step)
        o_ref.step()
        if step == 0:
            with pytest.warns(FlatStepWarning, match="torch.bfloat16 members"):  # per parameter
                fo.step()
        else:
            fo.step()
        o_ref.zero_grad()
        o_flat.zero_grad()
    assert_same(ref, o_ref, flat, o_flat)


def test_flat_norm_equals_torch_norm_up_to_rounding() -> None:
    ref, o_ref, flat, o_flat, fo, _ = pair("adamw")
    train_step(ref, 0)
    train_step(flat, 0)
    exact = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9, foreach=True)
    fast = fo.clip_grad_norm_(1e9, exact=False)  # one norm over the flat gradient buffer
    torch.testing.assert_close(fast, exact, rtol=1e-6, atol=0.0)
    assert torch.equal(fo.clip_grad_norm_(1e9), exact)


def test_an_lr_scheduler_changes_the_flat_step_like_the_per_parameter_one() -> None:
    ref, o_ref, flat, o_flat, fo, _ = pair("adamw")
    s_ref = torch.optim.lr_scheduler.CosineAnnealingLR(o_ref, T_max=5)
    s_flat = torch.optim.lr_scheduler.CosineAnnealingLR(o_flat, T_max=5)
    for step in range(5):
        train_step(ref, step)
        train_step(flat, step)
        o_ref.step()
        fo.step()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "scheduler.step() before optimizer.step()"
            s_ref.step()
            s_flat.step()
        o_ref.zero_grad()
        o_flat.zero_grad()
    assert o_flat.param_groups[0]["lr"] == o_ref.param_groups[0]["lr"] != 1e-2
    assert_same(ref, o_ref, flat, o_flat)


def test_an_interrupted_replan_is_redone_at_the_next_step() -> None:
    """A Ctrl-C anywhere in a step's re-plan and adoption (before any kernel runs) leaves the
    optimizer consistent: the next step re-does what was left and equals torch's."""
    import sys

    from flatpool.optim import _stepper as stepper_mod

    optim_dir = str(Path(stepper_mod.__file__).parent)
    k = 0
    while True:
        ref, o_ref, flat, o_flat, fo, pool = pair("adamw")
        for m, o in ((ref, o_ref), (flat, o_flat)):
            train_step(m, 0)
            o.step()
            o.zero_grad()
        pool.grow(pool.capacity * 2)  # the next step re-plans into new companions
        train_step(ref, 1)
        train_step(flat, 1)
        seen = [0]
        ran = [False]

        def tracer(frame: Any, event: str, arg: Any) -> Any:
            if frame.f_code.co_name == "run" and frame.f_code.co_filename == stepper_mod.__file__:
                ran[0] = True  # the kernels start: no more interrupts
            if ran[0] or not frame.f_code.co_filename.startswith(optim_dir):
                return None
            if event == "line":
                if seen[0] == k:
                    seen[0] += 1
                    raise KeyboardInterrupt
                seen[0] += 1
            return tracer

        sys.settrace(tracer)
        try:
            o_flat.step()
            done = True
        except KeyboardInterrupt:
            done = False
        finally:
            sys.settrace(None)
        if not done:
            assert all(torch.equal(a, b) for a, b in zip(before_step(ref, o_ref), flat.parameters()))
            o_flat.step()
        o_ref.step()
        assert_same(ref, o_ref, flat, o_flat)
        if done:
            break
        k += max(1, k // 8)
    assert k > 50

def before_step(ref: nn.Module, o_ref: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The reference's parameters (not stepped yet)."""
    return [p.detach() for p in ref.parameters()]


def test_grad_scaler_with_a_fused_group() -> None:
    """A GradScaler hands a fused optimizer ``grad_scale``/``found_inf``: with ``fused="foreach"``
    torch's own fused step handles the group (a warning says so); with ``fused="fused"`` the flat
    fused kernel reads them. Both stay within fused's bound of per-parameter fused; the default
    (``"exact"``: torch's fused step over the pooled float32 state) is torch.equal to it."""
    for policy in ("foreach", "fused", "exact"):
        ref, flat = mlp(), mlp()
        pool = FlatPool()
        pool.adopt(list(flat.parameters()))
        o_ref = torch.optim.AdamW(ref.parameters(), fused=True, lr=1e-2)
        o_flat = torch.optim.AdamW(flat.parameters(), fused=True, lr=1e-2)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            FlatOptimizer(o_flat, [pool], module=flat, fused=policy)  # type: ignore[arg-type]
            scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 6) for _ in range(2)]
            for step in range(4):
                for m, o, s in ((ref, o_ref, scalers[0]), (flat, o_flat, scalers[1])):
                    s.scale(m(batch(step)).square().mean()).backward()
                    s.step(o)
                    s.update()
                    o.zero_grad()
        assert any("grad_scale" in str(w.message) for w in said) == (policy == "foreach")
        for a, b in zip(ref.parameters(), flat.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            assert torch.equal(a, b) or policy != "exact"


# -- the module hook never changes what autograd, DDP, a transform or a deep copy sees -------
class _Branchy(nn.Module):
    """``b`` is never used: DDP with ``find_unused_parameters`` leaves its gradient ``None``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.a(x)))


@pytest.mark.parametrize("hook_on", ["ddp", "inner"])
def test_ddp_unused_parameters_keep_none(single_rank_mesh: Any, hook_on: str) -> None:
    """``DistributedDataParallel(find_unused_parameters=True, gradient_as_bucket_view=True)``
    with an unused branch: torch leaves the unused gradients ``None`` and AdamW skips them.
    A pooled zero gradient installed at backward start became a bucket view, and AdamW
    decayed the unused weights (issue 41, item 5)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    runs = []
    for flat in (False, True):
        torch.manual_seed(0)
        inner = _Branchy()
        if flat:  # adopted before DDP's Reducer holds the parameters
            pool = FlatPool(alignment=64, name="params")
            pool.adopt(list(inner.parameters()))
        model = DDP(inner, find_unused_parameters=True, gradient_as_bucket_view=True)
        opt = torch.optim.AdamW(inner.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
        if flat:
            FlatOptimizer(opt, [pool], module=model if hook_on == "ddp" else inner)
        seen = []
        for step in range(4):
            model(batch(step)).square().mean().backward()
            seen.append([p.grad is None for p in inner.parameters()])
            opt.step()
            opt.zero_grad()
        runs.append((inner, opt, seen))
    (ref, o_ref, s_ref), (flat_m, o_flat, s_flat) = runs
    assert s_ref == s_flat and any(any(s) for s in s_ref), (s_ref, s_flat)
    assert_same(ref, o_ref, flat_m, o_flat)


def test_torch_func_grad_with_module_hook() -> None:
    """``torch.func.grad`` over ``functional_call`` of a hooked module gives torch's gradients;
    the hook made the gradient pool inside the transform and raised ``NotImplementedError:
    Cannot access storage of TensorWrapper`` (issue 41, item 6). Plain backward still pools."""
    ref, o_ref, flat, o_flat, fo, pool = pair("adamw")
    x = batch(0)

    def loss(model: nn.Module) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
        return lambda ps: torch.func.functional_call(model, ps, (x,)).square().mean()

    want = torch.func.grad(loss(ref))({k: v.detach() for k, v in ref.named_parameters()})
    got = torch.func.grad(loss(flat))({k: v.detach() for k, v in flat.named_parameters()})
    assert sorted(want) == sorted(got)
    for k in want:
        assert torch.equal(want[k], got[k]), k
    assert all(p.grad is None for p in flat.parameters())
    for model, opt in ((ref, o_ref), (flat, o_flat)):
        train_step(model, 1)
        opt.step()
    assert fo.buffers()["grad"]  # the plain backward still wrote into the pool
    assert_same(ref, o_ref, flat, o_flat)


def test_deepcopy_and_averaged_model_of_hooked_module() -> None:
    """``copy.deepcopy`` and ``AveragedModel`` of a module with ``module=`` hooks: the copy has
    plain parameters and no flatpool behaviour (inert hooks, gone after its first forward),
    as torch's copy would, and SWA/EMA averages are torch's; they raised ``InvalidTypeError``
    (the hooks referenced the pools; issue 41, item 7)."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    ref, o_ref, flat, o_flat, fo, pool = pair("adamw")
    hooks = (len(flat._forward_pre_hooks), len(flat._forward_hooks))
    twin = copy.deepcopy(flat)
    assert hooks == (1, 1) == (len(flat._forward_pre_hooks), len(flat._forward_hooks))
    for a, b in zip(flat.parameters(), twin.parameters()):
        assert torch.equal(a, b) and a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
        assert b.untyped_storage().nbytes() == b.numel() * b.element_size()
    averaged = []
    for model, opt in ((ref, o_ref), (flat, o_flat)):
        avg = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        for step in range(3):
            train_step(model, step)
            opt.step()
            opt.zero_grad()
            avg.update_parameters(model)
        averaged.append(avg)
    assert_same(ref, o_ref, flat, o_flat)
    for a, b in zip(averaged[0].parameters(), averaged[1].parameters()):
        assert torch.equal(a, b)
    twin(batch(5)).square().mean().backward()  # the copy trains as a plain module
    assert (len(twin._forward_pre_hooks), len(twin._forward_hooks)) == (0, 0)
    assert all(p.grad is not None for p in twin.parameters())
    assert fo.buffers()["grad"] == []
