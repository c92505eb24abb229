"""What the user installed on the optimizer or as ``.grad`` stays theirs: a step or zero_grad
wrapper keeps being called (around the flat step) and is put back by ``close()``; a ``.grad``
the user installed (views of their own flat buffer) is read at every step and clip, never
rebound."""

from __future__ import annotations

import functools
import gc
import weakref
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from flatpool import FlatPool
from flatpool.errors import FlatStepWarning, InvalidRequestError
from flatpool.optim import FlatOptimizer

from test_optim import assert_same as same


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def pooled(model: nn.Module) -> FlatPool:
    pool = FlatPool(name="params")
    pool.adopt(list(model.parameters()))
    return pool


def backward(model: nn.Module, step: int) -> None:
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()


def counting(calls: list[str], name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator as step counters, trainers and accelerate's ``patch_optimizer_step`` write it."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapper
    return wrap


# -- step and zero_grad wrappers -------------------------------------------------------------
def test_a_step_wrapper_set_before_setup_wraps_the_flat_step_and_close_restores_it() -> None:
    ref, flat = mlp(), mlp()
    pool = pooled(flat)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=0.05, foreach=True)
    o_flat = torch.optim.AdamW(flat.parameters(), lr=0.05, foreach=True)
    calls: list[str] = []
    hooks: list[str] = []
    o_flat.step = counting(calls, "step")(o_flat.step)  # type: ignore[method-assign]
    o_flat.zero_grad = counting(calls, "zero_grad")(o_flat.zero_grad)  # type: ignore[method-assign]
    step_wrapper, zero_wrapper = o_flat.step, o_flat.zero_grad
    o_flat.register_step_pre_hook(lambda *_: hooks.append("pre"))
    o_flat.register_step_post_hook(lambda *_: hooks.append("post"))
    fo = FlatOptimizer(o_flat, [pool])  # no module: the flat step pools autograd's gradients
    assert o_flat.step is step_wrapper and o_flat.zero_grad is zero_wrapper
    for step in range(4):
        for m, o in ((ref, o_ref), (flat, o_flat)):
            backward(m, step)
            o.step()
            if step == 0:
                assert fo.grads.buffer(pool) is not None or m is ref  # the flat step ran
            o.zero_grad(set_to_none=False)
        same(ref, o_ref, flat, o_flat)
    assert calls == ["step", "zero_grad"] * 4
    assert hooks == ["pre", "post"] * 4  # torch's hooks once a step, as torch runs them
    fo.close()
    assert o_flat.__dict__["step"] is step_wrapper and o_flat.__dict__["zero_grad"] is zero_wrapper
    del calls[:], hooks[:]
    for step in range(4, 6):  # the wrapper calls torch's own step again
        for m, o in ((ref, o_ref), (flat, o_flat)):
            backward(m, step)
            o.step()
            o.zero_grad()
        same(ref, o_ref, flat, o_flat)
    assert calls == ["step", "zero_grad"] * 2 and hooks == ["pre", "post"] * 2
    FlatOptimizer(o_flat, [pool]).close()  # a second setup after close: the same wrapper again
    assert o_flat.__dict__["step"] is step_wrapper


def test_a_wrapper_set_after_setup_wraps_the_flat_step_and_stays_after_close() -> None:
    ref, flat = mlp(), mlp()
    pool = pooled(flat)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, foreach=True)
    o_flat = torch.optim.SGD(flat.parameters(), lr=0.05, momentum=0.9, foreach=True)
    fo = FlatOptimizer(o_flat, [pool], module=flat)
    calls: list[str] = []
    o_flat.step = counting(calls, "step")(o_flat.step)  # type: ignore[method-assign]
    wrapper = o_flat.step
    for step in range(3):
        for m, o in ((ref, o_ref), (flat, o_flat)):
            backward(m, step)
            o.step()
            o.zero_grad()
        same(ref, o_ref, flat, o_flat)
    fo.close()
    assert o_flat.step is wrapper  # the user's: close() leaves it
    for m, o in ((ref, o_ref), (flat, o_flat)):
        backward(m, 3)
        o.step()
    same(ref, o_ref, flat, o_flat)
    o_flat.step = counting(calls, "outer")(o_flat.step)  # type: ignore[method-assign]
    FlatOptimizer(o_flat, [pool], module=flat)  # the wrappers now hold a closed flat step
    for step in range(4, 6):
        for m, o in ((ref, o_ref), (flat, o_flat)):
            backward(m, step)
            o.step()
            o.zero_grad()
        same(ref, o_ref, flat, o_flat)
    assert calls == ["step"] * 4 + ["outer", "step"] * 2


def test_a_scheduler_wrapper_around_a_user_wrapper_keeps_both() -> None:
    ref, flat = mlp(), mlp()
    pool = pooled(flat)
    o_ref = torch.optim.Adam(ref.parameters(), lr=0.1, foreach=True)
    o_flat = torch.optim.Adam(flat.parameters(), lr=0.1, foreach=True)
    calls: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "step order" warning
        s_ref = torch.optim.lr_scheduler.StepLR(o_ref, step_size=2, gamma=0.5)
        s_flat = torch.optim.lr_scheduler.StepLR(o_flat, step_size=2, gamma=0.5)
        o_flat.step = counting(calls, "step")(o_flat.step)  # type: ignore[method-assign]
        fo = FlatOptimizer(o_flat, [pool], module=flat)
        for step in range(4):
            for m, o, s in ((ref, o_ref, s_ref), (flat, o_flat, s_flat)):
                backward(m, step)
                o.step()
                o.zero_grad()
                s.step()
            same(ref, o_ref, flat, o_flat)
        assert s_ref.get_last_lr() == s_flat.get_last_lr()
    assert calls == ["step"] * 4
    assert fo.grads.buffer(pool) is None  # released by zero_grad: the flat zero_grad ran


class Counter:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("kind", ["callable object", "partial", "replacement"])
def test_a_wrapper_flatpool_cannot_reach_is_refused_and_nothing_changes(kind: str) -> None:
    model = mlp()
    pool = pooled(model)
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    backward(model, 0)
    grads = [p.grad for p in model.parameters()]
    wrapper: Any = {"callable object": Counter(opt.step),
                    "partial": functools.partial(opt.step),
                    "replacement": lambda closure=None: None}[kind]
    opt.step = wrapper  # type: ignore[method-assign]
    with pytest.raises(InvalidRequestError, match="set it after FlatOptimizer"):
        FlatOptimizer(opt, [pool], module=model)
    assert opt.step is wrapper and "zero_grad" not in opt.__dict__
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert not opt.state and not model._forward_hooks


# -- the user's gradient buffers ----------------------------------------------------------------
def _user_grads(model: nn.Module) -> torch.Tensor:
    """One flat buffer of the user's with every ``.grad`` a view of it."""
    params = list(model.parameters())
    buf = torch.zeros(sum(p.numel() for p in params))
    at = 0
    for p in params:
        p.grad = buf[at:at + p.numel()].view_as(p)
        at += p.numel()
    return buf


@pytest.mark.parametrize("module", [False, True])
def test_user_gradient_buffers_are_read_at_every_step_clip_and_zero_grad(module: bool) -> None:
    ref, flat = mlp(), mlp()
    pool = pooled(flat)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1, foreach=True)
    o_flat = torch.optim.AdamW(flat.parameters(), lr=0.05, weight_decay=0.1, foreach=True)
    bufs = [_user_grads(ref), _user_grads(flat)]
    views = [p.grad for p in flat.parameters()]
    backward(flat, 0)  # a gradient present at setup: it stays the user's
    backward(ref, 0)
    fo = FlatOptimizer(o_flat, [pool], module=flat if module else None)
    for step in range(4):
        if step:
            backward(ref, step)
            backward(flat, step)  # autograd accumulates into the user's views in place
        for buf in bufs:
            buf.mul_(0.5)  # the user's own scaling, in place, before every step
        norms = (torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, foreach=True),
                 fo.clip_grad_norm_(0.05))
        assert torch.equal(*norms)
        assert torch.equal(bufs[0], bufs[1])  # the clip scaled the user's own tensors
        o_ref.step()
        o_flat.step()
        assert all(p.grad is v for p, v in zip(flat.parameters(), views))  # never rebound
        same(ref, o_ref, flat, o_flat)
        for o in (o_ref, o_flat):
            o.zero_grad(set_to_none=False)  # zeroes the user's tensors in place, as torch
        assert not bufs[1].any() and all(p.grad is v for p, v in zip(flat.parameters(), views))
    for o in (o_ref, o_flat):
        o.zero_grad()  # set_to_none=True: None, as torch
    assert all(p.grad is None for p in flat.parameters())
    assert fo.grads.buffer(pool) is None


def test_an_optimizer_stepped_flat_dies_with_its_last_reference() -> None:
    model = mlp()
    pool = pooled(model)
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    opt.step = counting([], "step")(opt.step)  # type: ignore[method-assign]
    fo = FlatOptimizer(opt, [pool])  # (module= hooks would hold it while the module lives)
    backward(model, 0)
    opt.step()
    dead = weakref.ref(opt)
    del opt, fo
    gc.collect()
    assert dead() is None


@pytest.mark.parametrize("kw", [dict(nesterov=True), dict(nesterov=True, maximize=True),
                                dict(nesterov=True, weight_decay=0.1), dict(nesterov=False)])
def test_a_copied_in_gradient_gets_what_torchs_in_place_kernel_leaves_in_it(kw: dict[str, Any]
                                                                             ) -> None:
    """torch's foreach SGD with nesterov adds the momentum into the ``.grad`` tensors themselves.
    A ``.grad`` flatpool did not install is stepped through a copy in the gradient pool: it
    must come out of the step as torch leaves it (the differential test found it unchanged,
    issue 41 item 4's rule meeting nesterov), and the next accumulation adds onto that."""
    ref, flat = mlp(), mlp()
    pool = pooled(flat)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, foreach=True, **kw)
    o_flat = torch.optim.SGD(flat.parameters(), lr=0.05, momentum=0.9, foreach=True, **kw)
    FlatOptimizer(o_flat, [pool])  # no module hook: autograd's own gradients stay the .grads
    for step in range(4):
        for m, o in ((ref, o_ref), (flat, o_flat)):
            backward(m, step)  # accumulates onto what the last step left in .grad
            o.step()
        same(ref, o_ref, flat, o_flat)
        for a, b in zip(ref.parameters(), flat.parameters()):
            assert a.grad is not None and b.grad is not None
            assert torch.equal(a.grad, b.grad), (step, kw)


# -- state entries whose memory moved ---------------------------------------------------------
def _moved(kind: str, o: torch.optim.Optimizer, ps: list[nn.Parameter]) -> None:
    """What offloading code and hostile users do to an entry without replacing it."""
    st0, st1 = o.state[ps[0]], o.state[ps[1]]
    if kind == "offload":  # the same tensor, its data moved off and back
        st0["exp_avg"].data = st0["exp_avg"].data.to("cpu", copy=True)
        st0["exp_avg"].data = st0["exp_avg"].data.clone()
    elif kind == "step":  # the same step tensor, rebound to new memory
        st1["step"].data = torch.tensor(float(st1["step"]) + 5.0)
    elif kind == "alias":  # one parameter's entry onto another's memory
        n = st1["exp_avg_sq"].numel()
        st1["exp_avg_sq"].data = st0["exp_avg_sq"].data.flatten()[:n].view(st1["exp_avg_sq"].shape)
    elif kind == "set_":
        st1["exp_avg"].set_(torch.full_like(st1["exp_avg"], 0.25))


@pytest.mark.parametrize("kind", ["offload", "step", "alias", "set_"])
def test_a_state_entry_whose_memory_moved_is_stepped_where_it_is_now(kind: str) -> None:
    """``entry.data = x`` keeps the entry object but moves its memory: the flat step must not
    step the place it left (torch steps ``x``). Before the fix the flat step kept updating the
    pooled place: silent divergence, the bug this project exists for."""
    ref, flat = mlp(), mlp()
    pool = pooled(flat)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=0.05, foreach=True)
    o_flat = torch.optim.AdamW(flat.parameters(), lr=0.05, foreach=True)
    FlatOptimizer(o_flat, [pool], module=flat)
    for step in range(4):
        for model, o in ((ref, o_ref), (flat, o_flat)):
            backward(model, step)
            if step == 2:
                _moved(kind, o, list(model.parameters()))
            if o is o_flat and step == 2 and kind == "alias":  # torch's own step: it aliases
                with pytest.warns(FlatStepWarning, match="shares memory with flatpool's pools"):
                    o.step()
            else:  # the others are copied into their places (as an entry the user replaced)
                with warnings.catch_warnings():
                    warnings.simplefilter("error", FlatStepWarning)
                    o.step()
            o.zero_grad()
        same(ref, o_ref, flat, o_flat)


class _Squares(nn.Module):
    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.randn(3, 3, generator=g)) for _ in range(3)])

    def forward(self) -> torch.Tensor:
        w = torch.arange(9.0).view(3, 3)
        return torch.stack([((k + 1) * w * q).sum() for k, q in enumerate(self.ps)]).sum()


@pytest.mark.parametrize("what,cls,kw", [
    ("param", torch.optim.AdamW, {}), ("grad", torch.optim.AdamW, {}),
    ("exp_avg", torch.optim.AdamW, {}),
    ("grad", torch.optim.SGD, dict(momentum=0.9, nesterov=True)),  # writes into the .grad
])
def test_a_tensor_re_viewed_over_its_own_place_is_stepped_as_torch_steps_it(
        what: str, cls: type[torch.optim.Optimizer], kw: dict[str, Any]) -> None:
    """``t.data = t.data.t()`` keeps the data pointer and moves every element but the diagonal:
    the flat step checks each place's contiguity with its address (it stepped the old layout)."""
    runs = []
    for flat in (False, True):
        g = torch.Generator().manual_seed(3)
        model = _Squares(g)
        ps = list(model.ps)
        opt = cls(ps, lr=0.1, foreach=True, **kw)
        if flat:  # module=: the backward writes into pooled .grad views
            pool = FlatPool(name="square")
            pool.adopt(ps)
            FlatOptimizer(opt, [pool], module=model)
        for step in range(3):
            opt.zero_grad()
            model().backward()
            if step == 2:
                p = ps[1]
                if what == "param":
                    p.data = p.data.t()
                elif what == "grad":
                    assert p.grad is not None
                    p.grad.data = p.grad.data.t()
                else:
                    entry = opt.state[p]["exp_avg"]
                    entry.data = entry.data.t()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FlatStepWarning)  # (torch steps what it aliases)
                opt.step()
        runs.append((ps, opt))
    (ref, o_ref), (flat_ps, o_flat) = runs
    for a, b in zip(ref, flat_ps):
        assert torch.equal(a, b) and a.stride() == b.stride()
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)
        assert sorted(o_ref.state[a]) == sorted(o_flat.state[b])
        for key in o_ref.state[a]:
            assert torch.equal(o_ref.state[a][key], o_flat.state[b][key]), key
