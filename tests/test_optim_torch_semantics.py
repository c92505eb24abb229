"""Issue 30's cases, one regression test each: a flat-managed optimizer behaves as torch's own,
bit for bit, under what torch's API lets a user do. Each test failed on the code before issue 30
(the docstring says how).

Cases 1-7 run here (one process, plain modules); case 8 (torchtitan's build order), the unused
submodule and the frozen layer on FSDP2 run on 2 gloo ranks in
``tests/integrations/optim_workers.py``.
"""

from __future__ import annotations

import copy
import io
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from flatpool import FlatPool, census
from flatpool.errors import FlatStepWarning
from flatpool.optim import FlatOptimizer
from optim_faults import interrupt_at_line, interrupt_points

STEPS = 4


def mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 13), nn.Tanh(), nn.Linear(13, 7), nn.Tanh(),
                         nn.Linear(7, 3)).to(dtype)


def backward(model: nn.Module, step: int) -> None:
    dtype = next(model.parameters()).dtype
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step)).to(dtype)
    model(x).float().square().mean().backward()


def pooled(model: nn.Module, alignment: int = 1) -> FlatPool:
    pool = FlatPool(alignment=alignment, name="params")
    pool.adopt(list(model.parameters()))
    return pool


def twins(cls: type[torch.optim.Optimizer], dtype: torch.dtype = torch.float32, alignment: int = 1,
          **kw: Any) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module, torch.optim.Optimizer, FlatOptimizer]:
    """A plain model and optimizer, and the same flat-managed."""
    ref, flat = mlp(dtype=dtype), mlp(dtype=dtype)
    pool = pooled(flat, alignment)
    o_ref = cls(ref.parameters(), **kw)
    o_flat = cls(flat.parameters(), **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FlatStepWarning)
        fo = FlatOptimizer(o_flat, [pool], module=flat)
    return ref, o_ref, flat, o_flat, fo


def equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal``, a NaN equal to a NaN in the same place."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (a.isnan() & b.isnan())).all())


def same(ref: nn.Module, o_ref: torch.optim.Optimizer, flat: nn.Module, o_flat: torch.optim.Optimizer) -> None:
    """Parameters, gradients and every state entry (``step`` included) are ``torch.equal``."""
    for a, b in zip(ref.parameters(), flat.parameters()):
        assert equal(a, b)
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            assert equal(a.grad, b.grad)
    s_ref, s_flat = o_ref.state_dict()["state"], o_flat.state_dict()["state"]
    assert sorted(s_ref) == sorted(s_flat)
    for k in s_ref:
        assert list(s_ref[k]) == list(s_flat[k]), k
        for kind in s_ref[k]:
            assert equal(s_ref[k][kind], s_flat[k][kind]), (k, kind)


def both(fn: Callable[[nn.Module, torch.optim.Optimizer], None],
         ref: nn.Module, o_ref: torch.optim.Optimizer, flat: nn.Module, o_flat: torch.optim.Optimizer) -> None:
    fn(ref, o_ref)
    fn(flat, o_flat)


def plain_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    backward(model, step)
    opt.step()
    opt.zero_grad()


# -- case 1: half precision ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cls,kw", [
    (torch.optim.SGD, dict(lr=0.05)),
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, eps=1e-3)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, eps=1e-3)),
])
def test_case1_half_precision_is_bit_identical(dtype: torch.dtype, cls: type[torch.optim.Optimizer],
                                               kw: dict[str, Any]) -> None:
    """Before: one foreach call over the long flat tensor put elements in other vector lanes or
    the scalar tail (1 element of 355 after one SGD step differed)."""
    ref, o_ref, flat, o_flat, fo = twins(cls, dtype, foreach=True, **kw)
    for step in range(STEPS):
        backward(ref, step)
        backward(flat, step)
        o_ref.step()
        if step == 0:  # the per-parameter half-precision step is said once, at the first step
            with pytest.warns(FlatStepWarning, match="not bit-identical"):
                fo.step()
        else:
            fo.step()
        same(ref, o_ref, flat, o_flat)
        o_ref.zero_grad()
        o_flat.zero_grad()


# -- case 2: a step tensor of its own -------------------------------------------------------------
def test_case2_each_parameter_has_its_own_step_everywhere_torch_hands_state_out() -> None:
    """Before: one step tensor per segment; a flat checkpoint resumed in a plain Adam counted
    it once per parameter (step 20 where torch had 8), and editing one step changed all."""
    ref, o_ref, flat, o_flat, fo = twins(torch.optim.Adam, lr=1e-2, foreach=True)
    for step in range(STEPS):
        plain_step(ref, o_ref, step)
        backward(flat, step)
        fo.step()
        o_flat.zero_grad()
    steps = [o_flat.state[p]["step"] for p in flat.parameters()]
    assert len({id(s) for s in steps}) == len(steps)
    buf = io.BytesIO()
    torch.save(o_flat.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf)
    copied = copy.deepcopy(o_flat)
    for sd_source in ("torch.save", "deepcopy", "state_dict"):
        model = mlp()
        model.load_state_dict(flat.state_dict())
        plain = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
        sd = {"torch.save": copy.deepcopy(loaded), "deepcopy": copied.state_dict(),
              "state_dict": copy.deepcopy(o_flat.state_dict())}[sd_source]
        plain.load_state_dict(sd)
        r2 = mlp()
        r2.load_state_dict(ref.state_dict())
        o_r2 = torch.optim.Adam(r2.parameters(), lr=1e-2, foreach=True)
        o_r2.load_state_dict(copy.deepcopy(o_ref.state_dict()))
        for step in range(STEPS, 2 * STEPS):
            plain_step(r2, o_r2, step)
            plain_step(model, plain, step)
        same(r2, o_r2, model, plain)
        assert {float(s["step"]) for s in plain.state.values()} == {2.0 * STEPS}
    # one parameter's step edited: only its bias correction changes, as in torch
    for o in (o_ref, o_flat):
        o.state[next(iter(o.state))]["step"].fill_(1.0)
    for step in range(STEPS, STEPS + 2):
        plain_step(ref, o_ref, step)
        plain_step(flat, o_flat, step)
    same(ref, o_ref, flat, o_flat)


# -- case 3: Ctrl-C inside setup -------------------------------------------------------------------
def _world(model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    """Everything setup may touch, by identity and value."""
    state = {id(p): {k: (id(v), v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
             for p, st in opt.state.items()}
    grads = [(id(p.grad), None if p.grad is None else p.grad.clone()) for p in model.parameters()]
    hooks = (dict(model._forward_pre_hooks), dict(model._forward_hooks))
    return state, grads, sorted(opt.__dict__), hooks, id(opt.state), [id(g) for g in opt.param_groups]


def _same_world(a: Any, b: Any) -> bool:
    (sa, ga, da, ha, *ra), (sb, gb, db, hb, *rb) = a, b
    if da != db or ra != rb or [list(h) for h in ha] != [list(h) for h in hb] or sa.keys() != sb.keys():
        return False
    for p in sa:
        if sa[p].keys() != sb[p].keys():
            return False
        for k in sa[p]:
            (ia, va), (ib, vb) = sa[p][k], sb[p][k]
            if ia != ib or not (torch.equal(va, vb) if torch.is_tensor(va) else va == vb):
                return False
    return all(ia == ib and (va is None) == (vb is None) and (va is None or torch.equal(va, vb))
               for (ia, va), (ib, vb) in zip(ga, gb))


def test_case3_setup_interrupted_anywhere_leaves_the_optimizer_as_it_was(
        request: pytest.FixtureRequest) -> None:
    """Before: a Ctrl-C at the end of state adoption left the shared step installed in
    ``opt.state`` with no guard; a later plain ``opt.step()`` was wrong (step 14 vs 5)."""
    def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
        for step in range(2):
            plain_step(model, opt, step)
        backward(model, 2)  # gradients and state exist: setup adopts both
        return model, opt

    def setup(k: int | None) -> tuple[nn.Module, torch.optim.Optimizer, Any, list[int], bool]:
        model, opt = trained()
        pool = pooled(model)
        before = _world(model, opt)
        tracer, seen = interrupt_at_line(k)
        sys.settrace(tracer)
        try:
            fo = FlatOptimizer(opt, [pool], module=model)
            done = True
        except KeyboardInterrupt:
            done = False
        finally:
            sys.settrace(None)
        if done:
            fo.close()
        return model, opt, before, seen, done

    *_, seen, done = setup(None)
    assert done and seen[1] > 0
    points = interrupt_points(seen[0], seen[1], request.config.getoption("--slow"))
    for k in points:
        model, opt, before, _, done = setup(k)
        assert not done
        assert _same_world(before, _world(model, opt)), f"interrupted at line {k}"
        ref, o_ref = trained()
        opt.step()  # torch's own step, exactly as before setup
        o_ref.step()
        same(ref, o_ref, model, opt)
    assert len(points) > 100


# -- case 4: mutations torch honours ---------------------------------------------------------
def _grad_data(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    w = model[2].weight
    assert w.grad is not None
    w.grad.data = torch.full_like(w, 0.25)


def _state_clear(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.state.clear()


def _state_entry(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.state[model[0].weight]["momentum_buffer"] = torch.full_like(model[0].weight, 0.5)


def _momentum_on(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.param_groups[0]["momentum"] = 0.9


def _step_twice(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.step()  # then the loop's step: FlatOptimizer.step() on the flat side


def _append_param(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    extra = model.extra  # type: ignore[union-attr]
    opt.param_groups[0]["params"].append(extra)


Mutation = Callable[[nn.Module, torch.optim.Optimizer], None]
MUTATIONS: dict[str, tuple[Mutation, int, type[torch.optim.Optimizer], dict[str, Any]]] = {
    # name: (mutation, at which step, optimizer)
    "grad.data": (_grad_data, 2, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "state.clear": (_state_clear, 2, torch.optim.Adam, dict(lr=1e-2)),
    "state entry": (_state_entry, 2, torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    "momentum 0 -> 0.9": (_momentum_on, 2, torch.optim.SGD, dict(lr=0.05, momentum=0.0)),
    "step, then step again": (_step_twice, 0, torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    "param appended": (_append_param, 2, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_case4_mutations_torch_honours_are_honoured(name: str) -> None:
    """Before: the stale pooled gradient was stepped after ``.grad.data = x``; ``state.clear()``
    kept the moments; a new momentum buffer, momentum switched on, a second step and an
    appended parameter were ignored."""
    mutate, at, cls, kw = MUTATIONS[name]
    ref, flat = mlp(), mlp()
    for m in (ref, flat):
        m.extra = nn.Parameter(torch.linspace(-1, 1, 6))  # type: ignore[assignment]
    pool = FlatPool(alignment=1, name="params")
    pool.adopt(list(flat.parameters()))  # extra is pooled too, though not in the optimizer
    o_ref = cls([p for n, p in ref.named_parameters() if n != "extra"], foreach=True, **kw)
    o_flat = cls([p for n, p in flat.named_parameters() if n != "extra"], foreach=True, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlatStepWarning)
        fo = FlatOptimizer(o_flat, [pool], module=flat)

        def forward(m: nn.Module, step: int) -> None:
            x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step))
            (m(x).square().mean() + m.extra.square().sum()).backward()  # type: ignore[operator]

        for step in range(STEPS):
            for m, o, stepper in ((ref, o_ref, o_ref.step), (flat, o_flat, fo.step)):
                forward(m, step)
                if step == at:
                    mutate(m, o)
                stepper()
                o.zero_grad()
            same(ref, o_ref, flat, o_flat)
    assert not torch.equal(flat.extra, torch.linspace(-1, 1, 6)) or name != "param appended"


# -- case 5: gaps ------------------------------------------------------------------------------
def test_case5_a_slice_allocated_in_a_gap_is_not_touched() -> None:
    """Before: free bytes between members were stepped with them; a slice allocated there later
    was decayed by AdamW (1.0 -> 0.857)."""
    ref, flat = mlp(), mlp()
    params = list(flat.parameters())
    pool = FlatPool(alignment=1, name="params")
    filler = torch.zeros(24)
    pool.adopt(params[:2] + [filler] + params[2:])
    slc = pool.slice_of(filler)
    assert slc is not None
    pool.disown(slc)
    pool.free(slc)  # a gap between two members
    del filler
    o_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.5, foreach=True)
    o_flat = torch.optim.AdamW(flat.parameters(), lr=1e-2, weight_decay=0.5, foreach=True)
    fo = FlatOptimizer(o_flat, [pool], module=flat)
    plain_step(ref, o_ref, 0)
    plain_step(flat, o_flat, 0)
    new = pool.allocate((24,), torch.float32)  # lands in the gap
    assert new.offset == slc.offset
    guest = pool.view(new)
    guest.fill_(1.0)
    for step in range(1, STEPS):
        plain_step(ref, o_ref, step)
        plain_step(flat, o_flat, step)
    assert torch.equal(guest, torch.ones(24))
    same(ref, o_ref, flat, o_flat)
    assert len(fo.segments) == 2


# -- case 6: GradScaler --------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["optimizer", "flat"])
def test_case6_grad_scaler_steps_and_skips_as_with_torch(target: str) -> None:
    """Before: ``scaler.step(opt)`` raised ``FlatStepError``, ``scaler.step(flat)`` a raw
    ``AttributeError``."""
    ref, o_ref, flat, o_flat, fo = twins(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, foreach=True)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2) for _ in range(2)]
    scales = []
    for step in range(6):
        for m, o, s, t in ((ref, o_ref, scalers[0], o_ref), (flat, o_flat, scalers[1],
                                                             o_flat if target == "optimizer" else fo)):
            x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step))
            s.scale(m(x).square().mean()).backward()
            if step == 3:  # an overflow: the scaler skips the step and backs off
                m[2].bias.grad[0] = float("inf")  # type: ignore[index]
            s.step(t)  # type: ignore[arg-type]
            s.update()
            o.zero_grad()
        same(ref, o_ref, flat, o_flat)
        assert scalers[0].get_scale() == scalers[1].get_scale()
        scales.append(scalers[1].get_scale())
    assert scales[3] < scales[2]  # the inf step was skipped and backed off


# -- case 7: frozen and sparse ---------------------------------------------------------------
@pytest.mark.parametrize("set_to_none", [True, False])
def test_case7_a_parameter_frozen_mid_training(set_to_none: bool) -> None:
    """Before: a parameter frozen with ``requires_grad_(False)`` was stepped with a zero gradient
    where torch skips it (``set_to_none=True``); with ``set_to_none=False`` torch steps its zero
    gradient, and so must the flat step."""
    ref, o_ref, flat, o_flat, fo = twins(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, foreach=True)
    for step in range(STEPS):
        for m, o in ((ref, o_ref), (flat, o_flat)):
            if step == 2:
                m[2].requires_grad_(False)
            backward(m, step)
            (o.step if o is o_ref else fo.step)()
            o.zero_grad(set_to_none=set_to_none)
        same(ref, o_ref, flat, o_flat)


class TwoPaths(nn.Module):
    """``mlp()`` whose last two layers the forward skips every other call."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        net = self.net
        self.calls += 1
        h = net[1](net[0](x))
        return net[4](net[3](net[2](h))) if self.calls % 2 else h[:, :3]


def test_case7_an_unused_submodule_keeps_no_gradient() -> None:
    """A submodule the forward skips gets no gradient, as with torch: the view pre-installed
    before the forward is given back as ``None`` when the backward ends, before the clip
    reads it (before issue 30 it stayed a zero gradient, stepped with weight decay)."""
    ref, flat = TwoPaths(), TwoPaths()
    pool = pooled(flat)
    o_ref, o_flat = (torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
                     for m in (ref, flat))
    fo = FlatOptimizer(o_flat, [pool], module=flat)
    for step in range(STEPS):
        for m, o, stepper in ((ref, o_ref, o_ref.step), (flat, o_flat, fo.step)):
            x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step))
            m(x).square().mean().backward()
            assert (m.net[4].weight.grad is None) == (step % 2 == 1)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.1, foreach=True)
            stepper()
            o.zero_grad()
        same(ref, o_ref, flat, o_flat)


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.Adam])
def test_case7_a_sparse_gradient_is_handled_as_torch_handles_it(cls: type[torch.optim.Optimizer]) -> None:
    """Before: a sparse ``Embedding`` gradient was silently densified. Now torch's own step
    handles the group: SGD steps it, Adam raises its own error."""
    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))

    ref, flat = model(), model()
    pool = pooled(flat)
    o_ref, o_flat = (cls(m.parameters(), lr=0.05) for m in (ref, flat))
    FlatOptimizer(o_flat, [pool], module=flat)
    idx = torch.tensor([1, 3, 3, 7])
    for m in (ref, flat):
        m(idx).square().mean().backward()
    assert flat[0].weight.grad is not None and flat[0].weight.grad.is_sparse
    if cls is torch.optim.Adam:
        with pytest.raises(RuntimeError, match="sparse") as torch_error:
            o_ref.step()
        with pytest.warns(FlatStepWarning, match="sparse"), pytest.raises(RuntimeError) as flat_error:
            o_flat.step()
        assert str(flat_error.value) == str(torch_error.value)
    else:
        o_ref.step()
        with pytest.warns(FlatStepWarning, match="sparse"):
            o_flat.step()
    for a, b in zip(ref.parameters(), flat.parameters()):
        assert torch.equal(a, b)


# -- drop-in: schedulers, closures, hooks, containers, memory ---------------------------------------
@pytest.mark.parametrize("when", ["before", "after"])
def test_lr_schedulers_before_or_after_setup_warn_nothing_and_match(when: str) -> None:
    ref, flat = mlp(), mlp()
    pool = pooled(flat)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1, foreach=True)
    o_flat = torch.optim.AdamW(flat.parameters(), lr=0.1, weight_decay=0.1, foreach=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s_ref = torch.optim.lr_scheduler.StepLR(o_ref, step_size=2, gamma=0.5)
        if when == "before":
            s_flat = torch.optim.lr_scheduler.StepLR(o_flat, step_size=2, gamma=0.5)
            fo = FlatOptimizer(o_flat, [pool], module=flat)
        else:
            fo = FlatOptimizer(o_flat, [pool], module=flat)
            s_flat = torch.optim.lr_scheduler.StepLR(o_flat, step_size=2, gamma=0.5)
        lrs = []
        for step in range(5):
            for m, o, s in ((ref, o_ref, s_ref), (flat, o_flat, s_flat)):
                backward(m, step)
                o.step()
                o.zero_grad()
                s.step()
            lrs.append((s_ref.get_last_lr(), s_flat.get_last_lr()))
            same(ref, o_ref, flat, o_flat)
        fo.close()
        for step in range(5, 7):  # the scheduler's wrapper now steps torch's own step
            for m, o, s in ((ref, o_ref, s_ref), (flat, o_flat, s_flat)):
                backward(m, step)
                o.step()
                o.zero_grad()
                s.step()
        same(ref, o_ref, flat, o_flat)
    assert all(a == b for a, b in lrs) and lrs[0] != lrs[-1]


def test_closure_hooks_and_a_container_that_only_calls_step() -> None:
    ref, o_ref, flat, o_flat, fo = twins(torch.optim.AdamW, lr=1e-2, foreach=True)
    calls: list[str] = []
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handles = [register_optimizer_step_pre_hook(
                   lambda o, a, k: calls.append("global") if o is o_flat else None),
               o_flat.register_step_pre_hook(lambda o, a, k: calls.append("pre")),
               o_flat.register_step_post_hook(lambda o, a, k: calls.append("post"))]

    class Container:  # torchtitan's OptimizersContainer calls each optimizer's step()
        def __init__(self, opts: list[torch.optim.Optimizer]) -> None:
            self.opts = opts

        def step(self) -> None:
            for o in self.opts:
                o.step()

    try:
        for step in range(3):
            def closure(m: nn.Module = flat, s: int = step) -> torch.Tensor:
                backward(m, s)
                return torch.zeros(())

            plain_step(ref, o_ref, step)
            if step == 1:
                backward(flat, step)
                Container([o_flat]).step()
            else:
                o_flat.step(closure)
            o_flat.zero_grad()
            same(ref, o_ref, flat, o_flat)
    finally:
        for h in handles:
            h.remove()
    assert calls == ["global", "pre", "post"] * 3


def test_zero_grad_releases_the_gradient_pool_and_the_next_backward_makes_one_block() -> None:
    from torch.multiprocessing.reductions import StorageWeakRef

    ref, o_ref, flat, o_flat, fo = twins(torch.optim.AdamW, lr=1e-2, foreach=True)
    pool = fo.pools[0]
    for step in range(3):
        backward(flat, step)
        grad_pool = fo.grads.buffer(pool)
        assert grad_pool is not None
        grads = [r for r in census(flat).records if "grad" in r.roles]
        assert len(grads) == 1 and grads[0].pool == "params/grad"  # one block
        alive = StorageWeakRef(grad_pool.storage)
        del grad_pool, grads
        o_flat.step()
        o_flat.zero_grad(set_to_none=False)  # kept, zeroed
        assert not alive.expired()
        assert all(p.grad is not None and not p.grad.any() for p in flat.parameters())
        o_flat.zero_grad()  # set_to_none=True: released at once, as torch frees its gradients
        assert alive.expired()
        assert fo.grads.buffer(pool) is None


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.AdamW], ids=["sgd", "adamw"])
def test_a_step_bumps_each_parameters_version_as_torch_does(cls: type[torch.optim.Optimizer]) -> None:
    """torch's step writes each parameter in place, so a graph that saved one and runs backward
    after the step raises; the flat step writes the pool instead, and must say the same rather
    than let that backward compute a silently wrong gradient."""
    ref, o_ref, flat, o_flat, fo = twins(cls, lr=0.1)
    for model, opt in ((ref, o_ref), (flat, o_flat)):
        backward(model, 0)
        pending = model(torch.randn(4, 5)).square().sum()  # saves the weights for backward
        before = [p._version for p in model.parameters()]
        opt.step()
        assert all(p._version > v for p, v in zip(model.parameters(), before)), opt
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            pending.backward()
    for a, b in zip(ref.parameters(), flat.parameters()):
        assert torch.equal(a, b)
