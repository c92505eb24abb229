"""The flat step's host cost (issue 40): a steady step re-reads everything torch's step reads
but runs no per-member Python; what it remembered from the last step is checked again, so a
gradient changed in place or replaced steps exactly as with torch."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from flatpool import FlatPool
from flatpool.optim import FlatOptimizer
from flatpool.optim import _grads, _stepper

N = 64


def params(seed: int) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(2, 2, generator=g)) for _ in range(N)]


def give_grads(ps: list[nn.Parameter], step: int) -> None:
    """Gradients made outside flatpool (the user's or autograd's own): copied in at each step."""
    g = torch.Generator().manual_seed(100 + step)
    for p in ps:
        p.grad = torch.randn(2, 2, generator=g)


def twins() -> tuple[list[nn.Parameter], torch.optim.Optimizer, list[nn.Parameter],
                     torch.optim.Optimizer, FlatOptimizer]:
    ref, flat = params(0), params(0)
    o_ref = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=True)
    o_flat = torch.optim.AdamW(flat, lr=1e-2, weight_decay=0.1, foreach=True)
    pool = FlatPool(alignment=1)
    pool.adopt(flat)
    return ref, o_ref, flat, o_flat, FlatOptimizer(o_flat, [pool])


def same(ref: list[nn.Parameter], o_ref: torch.optim.Optimizer, flat: list[nn.Parameter],
         o_flat: torch.optim.Optimizer) -> None:
    for a, b in zip(ref, flat):
        assert torch.equal(a, b)
    for a, b in zip(ref, flat):
        sa, sb = o_ref.state[a], o_flat.state[b]
        assert sorted(sa) == sorted(sb)
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


class Calls:
    """Counts the calls of a module's function while still calling it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> None:
        self.n = 0
        real = getattr(module, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.n += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


@pytest.mark.parametrize("foreign", [True, False])
def test_a_steady_step_runs_no_per_member_python(monkeypatch: pytest.MonkeyPatch,
                                                 foreign: bool) -> None:
    """Before: every step checked each foreign gradient in Python (``unpoolable``) and listed
    each parameter's local tensor for the version bump."""
    ref, o_ref, flat, o_flat, fo = twins()
    for step in range(2):
        give_grads(ref, step)
        if foreign:
            give_grads(flat, step)
        else:  # pooled views (as the module hook installs them), written in place
            for p in flat:
                p.grad = None
            fo.grads.install_missing()
            for p, r in zip(flat, ref):
                p.grad.copy_(r.grad)
        o_ref.step()
        o_flat.step()
    same(ref, o_ref, flat, o_flat)
    checks = Calls(monkeypatch, _grads, "unpoolable")
    locals_ = Calls(monkeypatch, _stepper, "local_tensor")
    o_ref.step()
    o_flat.step()  # the same gradients again: checked by C-level passes only
    same(ref, o_ref, flat, o_flat)
    assert (checks.n, locals_.n) == (0, 0)
    if foreign:
        assert fo.grads.pooled(0, N) == [False] * N  # still the user's: copied in, not rebound


def _data(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Callable[[nn.Parameter], None]:
    def change(p: nn.Parameter) -> None:
        assert p.grad is not None
        p.grad.data = torch.full(shape, 0.5, dtype=dtype)  # the same object, new metadata
    return change


def _replace(p: nn.Parameter) -> None:
    p.grad = torch.full((2, 2), 0.25)


def _drop(p: nn.Parameter) -> None:
    p.grad = None


def _sparse(p: nn.Parameter) -> None:
    p.grad = torch.full((2, 2), 0.5).to_sparse()


CHANGES = {
    "shape": _data((3, 2)), "broadcast shape": _data((1, 2)), "dtype": _data((2, 2), torch.float64),
    "replaced": _replace, "none": _drop, "sparse": _sparse,
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_foreign_gradient_changed_after_a_checked_step_steps_as_torch(change: str) -> None:
    """The last step's check is reused only while every gradient still passes it: one changed
    in place (``.grad.data = x``), replaced, dropped or made sparse is seen by the next step."""
    ref, o_ref, flat, o_flat, fo = twins()
    for step in range(2):
        give_grads(ref, step)
        give_grads(flat, step)
        o_ref.step()
        o_flat.step()
    for ps in (ref, flat):
        CHANGES[change](ps[N // 2])
    outcomes = []
    for o in (o_ref, o_flat):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                o.step()
                outcomes.append(None)
            except RuntimeError as e:
                outcomes.append(str(e))
    assert outcomes[0] == outcomes[1]
    same(ref, o_ref, flat, o_flat)
    if change == "replaced":  # copied in, still the user's object
        assert flat[N // 2].grad is not None and flat[N // 2].grad.eq(0.25).all()


def test_pooled_gradients_beside_members_without_one_are_checked_without_per_member_python(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: one member without a gradient (frozen, unused) sent every pooled one through a
    Python check of its place at each step."""
    ref, o_ref, flat, o_flat, fo = twins()
    for p in (ref[3], flat[3]):
        p.requires_grad_(False)
    for step in range(3):
        give_grads(ref, step)
        ref[3].grad = None
        for p in flat:
            p.grad = None
        fo.grads.install_missing()  # (none for the frozen one)
        for p, r in zip(flat, ref):
            if r.grad is not None:
                p.grad.copy_(r.grad)
        if step == 2:
            places = Calls(monkeypatch, _grads.Grads, "_at_place")
        o_ref.step()
        o_flat.step()
        same(ref, o_ref, flat, o_flat)
    assert flat[3].grad is None
    assert places.n == 0
    flat[5].grad.data = torch.zeros(2, 2)  # the pooled view moved: the user's now, copied in
    ref[5].grad.data = torch.zeros(2, 2)
    o_ref.step()
    o_flat.step()
    same(ref, o_ref, flat, o_flat)


def test_foreign_gradients_of_adjacent_1d_members_are_copied_in_as_torch_steps_them() -> None:
    """Adjacent 1-D places are filled by one ``torch.cat`` into their flat range (not one copy
    a member): the values torch steps, every step, a replaced or in-place edited one included."""
    g = torch.Generator().manual_seed(0)
    shapes = [(5,), (3,), (8,), (1,), (4,)] * 8
    ref = [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    flat = [nn.Parameter(p.detach().clone()) for p in ref]
    o_ref = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=True)
    o_flat = torch.optim.AdamW(flat, lr=1e-2, weight_decay=0.1, foreach=True)
    pool = FlatPool(alignment=1)
    pool.adopt(flat)
    fo = FlatOptimizer(o_flat, [pool])
    for step in range(4):
        if step != 2:  # step 2: the same objects, edited in place
            gg = torch.Generator().manual_seed(step)
            for a, b in zip(ref, flat):
                a.grad = torch.randn(a.shape, generator=gg)
                b.grad = a.grad.clone()
        else:
            for a, b in zip(ref, flat):
                a.grad.mul_(-2.0)
                b.grad.mul_(-2.0)
        o_ref.step()
        o_flat.step()
        same(ref, o_ref, flat, o_flat)
    assert fo.grads._copy is not None and fo.grads._copy[3] is not None  # the flat range path
    assert all(a.grad is not b.grad for a, b in zip(ref, flat))


def test_a_step_sets_off_no_cycle_collection() -> None:
    """The foreign gradients' C-level check makes a short-lived object a member (their shapes),
    which would set off automatic collections, generation 2 over the whole heap among them
    (20-170 ms at 10,000 members): the step runs under flatpool's gc pause (this test fails
    without it; the old per-member check made no such list)."""
    import gc

    ps = [nn.Parameter(torch.randn(3, 2)) for _ in range(3000)]
    opt = torch.optim.AdamW(ps, foreach=True)
    pool = FlatPool(alignment=1)
    pool.adopt(ps)
    FlatOptimizer(opt, [pool])
    for p in ps:
        p.grad = torch.ones(3, 2)
    opt.step()
    seen: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.collect()
    gc.callbacks.append(count)
    try:
        for _ in range(2):
            opt.step()
    finally:
        gc.callbacks.remove(count)
    assert seen == []
