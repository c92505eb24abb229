"""Differential test: random sequences of what torch's optimizer API lets a user do, applied to
a flat-managed optimizer and to a plain one on identical models, compared bit for bit (NaN equal
to NaN) after every operation: parameters, gradients (``None`` included) and every state entry,
``step`` included.

Operations: training steps (some parameters unused, some frozen, gradient accumulation, both
``zero_grad`` modes, a GradScaler with inf gradients, an LR scheduler), gradients replaced,
dropped or ``.grad.data``-swapped, state entries replaced or edited in place, ``step`` edited,
``state.clear()``, hyper-parameters that decide which state exists switched, a parameter
appended to a group or a new group added, a parameter listed twice in a group, a parameter over
part of another's pooled bytes (in its group or a new one), ``load_state_dict`` of a
``torch.save``/``load`` or ``deepcopy`` round trip, ``KeyboardInterrupt`` injected into the
step's preparation and into a fresh setup, the user's step/zero_grad wrappers set on the optimizer (before a setup or after
it; their calls counted), every ``.grad`` made a view of the user's own flat buffer, that buffer
scaled in place, and a gradient clip. float32, float64, float16, bfloat16; SGD (momentum, nesterov, dampening, weight
decay, maximize), Adam and AdamW (amsgrad, weight decay, maximize).

Quick mode (CI) runs a few thousand sequences on tiny models; ``--slow`` runs ten times more.
"""

from __future__ import annotations

import copy
import io
import sys
import warnings
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from flatpool import FlatPool
from flatpool.optim import FlatOptimizer
from flatpool.optim import _stepper as stepper_mod
from optim_faults import interrupt_at_line

SLOW = settings.default.max_examples >= 1000
EXAMPLES = 30000 if SLOW else 3000
SHAPES = [(3, 4), (5,), (2, 3), (7,)]
"""Three parameters in the optimizer at first; the fourth may be appended later."""

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


class Net(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.ps = nn.ParameterList(
            [nn.Parameter((torch.randn(s, generator=g) * 0.5).to(dtype)) for s in SHAPES])
        self.use = [True] * len(SHAPES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.sum() * 0
        for i, (p, used) in enumerate(zip(self.ps, self.use)):
            if used:
                out = out + ((p * x[: p.numel()].view(p.shape)).sin() * (i + 1)).sum()
        return out


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (a.isnan() & b.isnan())).all())


def assert_same(ref: Net, o_ref: torch.optim.Optimizer, flat: Net, o_flat: torch.optim.Optimizer,
                where: str) -> None:
    for i, (a, b) in enumerate(zip(ref.ps, flat.ps)):
        assert _equal(a, b), f"{where}: param {i}"
        assert (a.grad is None) == (b.grad is None), f"{where}: grad {i} None-ness"
        if a.grad is not None:
            assert _equal(a.grad, b.grad), f"{where}: grad {i}"  # type: ignore[arg-type]
    s_ref, s_flat = o_ref.state_dict(), o_flat.state_dict()
    assert s_ref["param_groups"] == s_flat["param_groups"], where
    assert list(s_ref["state"]) == list(s_flat["state"]), where
    for k, st_ref in s_ref["state"].items():
        st_flat = s_flat["state"][k]
        assert list(st_ref) == list(st_flat), f"{where}: state keys of {k}"
        for kind, v in st_ref.items():
            w = st_flat[kind]
            if torch.is_tensor(v):
                assert torch.is_tensor(w) and _equal(v, w), f"{where}: state {k} {kind}"
            else:
                assert v == w, f"{where}: state {k} {kind}"


CONFIGS = st.one_of(
    st.tuples(st.just("sgd"), st.fixed_dictionaries(dict(
        lr=st.sampled_from([0.05, 0.2]), momentum=st.sampled_from([0.0, 0.9]),
        dampening=st.sampled_from([0.0, 0.3]), weight_decay=st.sampled_from([0.0, 0.1]),
        maximize=st.booleans(), nesterov=st.booleans()))),
    st.tuples(st.sampled_from(["adam", "adamw"]), st.fixed_dictionaries(dict(
        lr=st.sampled_from([1e-2, 0.1]), amsgrad=st.booleans(),
        weight_decay=st.sampled_from([0.0, 0.1]), maximize=st.booleans(),
        eps=st.sampled_from([1e-3, 1e-8])))),
)

OPS = st.one_of(
    st.tuples(st.just("train"), st.lists(st.booleans(), min_size=4, max_size=4),
              st.sampled_from([None, True, False]), st.sampled_from([None, "inf", "ok"]),
              st.one_of(st.none(), st.integers(0, 400))),
    st.tuples(st.just("accumulate"), st.lists(st.booleans(), min_size=4, max_size=4)),
    st.tuples(st.just("freeze"), st.integers(0, 3), st.booleans()),
    st.tuples(st.sampled_from(["grad_none", "grad_data", "grad_assign", "grad_t", "param_t",
                               "param_data"]), st.integers(0, 3)),
    st.tuples(st.sampled_from(["state_replace", "state_inplace", "step_edit", "state_del",
                               "state_data", "step_data", "state_alias", "state_t"]),
              st.integers(0, 3)),
    st.tuples(st.just("state_clear")),
    st.tuples(st.just("hyper"), st.sampled_from(["lr", "momentum", "nesterov", "amsgrad"])),
    st.tuples(st.sampled_from(["append", "new_group"])),
    st.tuples(st.just("duplicate"), st.integers(0, 2)),
    st.tuples(st.just("share"), st.booleans()),
    st.tuples(st.just("load"), st.sampled_from(["save", "deepcopy"])),
    st.tuples(st.just("resetup"), st.integers(0, 6000)),
    st.tuples(st.just("wrap"), st.sampled_from(["step", "zero_grad"])),
    st.tuples(st.sampled_from(["user_grads", "scale_user", "clip"])),
)


def counting(calls: list[str], name: str, fn: Any) -> Any:
    """A user's wrapper, as step counters and accelerate's ``patch_optimizer_step`` write it."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return fn(*args, **kwargs)
    return wrapper


class Twin:
    """One side: a model, its optimizer (and scheduler, scaler); the flat side's FlatOptimizer."""

    def __init__(self, name: str, kw: dict[str, Any], dtype: torch.dtype, flat: bool,
                 alignment: int, scheduler: bool, scaler: bool) -> None:
        self.model = Net(dtype)
        self.dtype = dtype
        cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
        if name == "sgd" and kw["nesterov"] and (kw["momentum"] == 0 or kw["dampening"] != 0):
            kw = dict(kw, nesterov=False)  # torch refuses the combination at construction
        self.opt = cls(list(self.model.ps)[:3], foreach=True, **kw)
        self.fo: FlatOptimizer | None = None
        if flat:
            self.pool = FlatPool(alignment=alignment, name="p")
            self.pool.adopt(list(self.model.ps))  # the fourth too: it may join later
            self.setup()
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, 2, 0.5) if scheduler else None
        self.scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=2) \
            if scaler and dtype != torch.float16 else None
        self.added = False
        self.calls: list[str] = []
        """The user's wrappers' calls."""
        self.buf: torch.Tensor | None = None
        """The user's own gradient buffer."""
        self.shared = False

    def setup(self, k: int | None = None) -> bool:
        if k is not None:
            tracer, _ = interrupt_at_line(k)
            sys.settrace(tracer)
        try:
            self.fo = FlatOptimizer(self.opt, [self.pool], module=self.model)
            return True
        except KeyboardInterrupt:
            return False
        finally:
            sys.settrace(None)

    def backward(self, use: list[bool], seed: int) -> None:
        self.model.use = use
        x = torch.randn(16, generator=torch.Generator().manual_seed(seed)).to(self.dtype)
        loss = self.model(x).float()
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, inf: bool, k: int | None) -> None:
        if inf and self.scaler is not None:
            g = next((p.grad for p in self.model.ps if p.grad is not None), None)
            if g is not None:
                g.view(-1)[0] = float("inf")
        if k is not None and self.fo is not None:  # an interrupt while the step prepares
            tracer, _ = interrupt_at_line(
                k, stop=lambda f: f.f_code.co_name == "run" and f.f_code.co_filename == stepper_mod.__file__)
            sys.settrace(tracer)
            calls = len(self.calls)
            try:
                self._step()
            except KeyboardInterrupt:
                del self.calls[calls:]  # nothing was stepped: step again (the wrappers too)
            else:
                return
            finally:
                sys.settrace(None)
        self._step()

    def _step(self) -> None:
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()


def apply(t: Twin, op: tuple[Any, ...], seed: int) -> None:
    kind, ps, opt = op[0], t.model.ps, t.opt
    if kind == "train":
        _, use, zero, inf, k = op
        t.backward(use, seed)
        t.step(inf == "inf", k)
        if t.sched is not None:
            t.sched.step()
        if zero is not None:
            opt.zero_grad(set_to_none=zero)
    elif kind == "accumulate":
        t.backward(op[1], seed)
    elif kind == "freeze":
        ps[op[1]].requires_grad_(op[2])
    elif kind == "grad_none":
        ps[op[1]].grad = None
    elif kind == "grad_t":  # re-viewed over its own place: same data pointer
        g = ps[op[1]].grad
        if g is not None and g.dim() == 2:
            g.data = g.data.t()
    elif kind == "param_t":  # a layout change: the parameter and what pairs with it, alike
        p = ps[op[1]]      # (torch raises on mismatched shapes after updating part of the state)
        if p.dim() == 2:
            st_ = opt.state.get(p, {})
            for t_ in [p, p.grad] + [v for k, v in st_.items() if k != "step"]:
                if torch.is_tensor(t_) and t_.dim() == 2:
                    t_.data = t_.data.t()
    elif kind == "param_data":  # moved off its place (out of the pool)
        ps[op[1]].data = ps[op[1]].data.clone()
    elif kind in ("grad_data", "grad_assign"):
        p = ps[op[1]]
        new = torch.full_like(p, 0.125 * (op[1] + 1))
        if kind == "grad_assign":
            p.grad = new
        elif p.grad is not None:
            p.grad.data = new
    elif kind in ("state_replace", "state_inplace", "step_edit", "state_del", "state_data",
                  "step_data", "state_alias", "state_t"):
        st_ = opt.state.get(ps[op[1]])
        if not st_:
            return
        if kind == "state_del":
            del opt.state[ps[op[1]]]
        elif kind == "step_edit":
            if "step" in st_:
                st_["step"] = torch.tensor(float(st_["step"]) + 3.0)
        elif kind == "step_data":  # the same step tensor, rebound to new memory
            if "step" in st_:
                st_["step"].data = torch.tensor(float(st_["step"]) + 3.0)
        elif kind == "state_alias":  # an entry rebound onto another member's entry
            key = next((k for k in st_ if k != "step" and torch.is_tensor(st_[k])), None)
            there = next((o[key] for q in ps if q is not ps[op[1]] and (o := opt.state.get(q))
                          and key in o and o[key].numel() >= st_[key].numel()), None)
            if there is not None:
                assert key is not None
                st_[key].data = there.data.flatten()[:st_[key].numel()].view(st_[key].shape)
        elif kind == "state_t":  # the same entry re-viewed over its own place
            key = next((k for k in st_ if k != "step" and torch.is_tensor(st_[k])), None)
            if key is not None and st_[key].dim() == 2:
                st_[key].data = st_[key].data.t()
        elif kind == "state_data":  # offloading code: the same entry, its data moved
            key = next((k for k in st_ if k != "step" and torch.is_tensor(st_[k])), None)
            if key is not None:
                st_[key].data = st_[key].data * 0.5
        else:
            key = next((k for k in st_ if k != "step" and torch.is_tensor(st_[k])), None)
            if key is not None:
                if kind == "state_replace":
                    st_[key] = st_[key] * 0.5
                else:
                    st_[key].mul_(0.5)
    elif kind == "state_clear":
        opt.state.clear()
    elif kind == "hyper":
        g = opt.param_groups[0]
        what = op[1]
        if what == "lr":
            g["lr"] = g["lr"] * 0.5
        elif what in ("momentum", "nesterov") and "momentum" in g:
            if what == "momentum":
                g["momentum"] = 0.9 if g["momentum"] == 0 else 0.0
            g["nesterov"] = (what == "nesterov" and not g["nesterov"] and g["momentum"] != 0
                             and g["dampening"] == 0)
        elif what == "amsgrad" and "amsgrad" in g:
            g["amsgrad"] = not g["amsgrad"]
    elif kind in ("append", "new_group"):
        if not t.added:
            t.added = True
            if kind == "append":
                opt.param_groups[0]["params"].append(ps[3])
            else:
                opt.add_param_group({"params": [ps[3]]})
    elif kind == "duplicate":  # torch warns and steps it twice a step
        group = opt.param_groups[0]["params"]
        if sum(p is ps[op[1]] for p in group) == 1:
            group.append(ps[op[1]])
    elif kind == "share" and not t.shared:  # a parameter over part of ps[0]'s (pooled) bytes
        t.shared = True
        q = nn.Parameter(ps[0].detach().view(-1)[4:])
        q.grad = torch.full_like(q, 0.25)
        if op[1]:
            opt.param_groups[0]["params"].append(q)
        else:
            opt.add_param_group({"params": [q]})
    elif kind == "load":
        sd = opt.state_dict()
        if op[1] == "save":
            buf = io.BytesIO()
            torch.save(sd, buf)
            buf.seek(0)
            sd = torch.load(buf)
        else:
            sd = copy.deepcopy(sd)
        opt.load_state_dict(sd)
    elif kind == "wrap":
        setattr(opt, op[1], counting(t.calls, op[1], getattr(opt, op[1])))
    elif kind == "user_grads":
        t.buf = torch.arange(sum(p.numel() for p in ps), dtype=t.dtype).mul_(0.01)
        at = 0
        for p in ps:
            p.grad = t.buf[at:at + p.numel()].view_as(p)
            at += p.numel()
    elif kind == "scale_user" and t.buf is not None:
        t.buf.mul_(0.5)
    elif kind == "clip":
        params = [p for g in opt.param_groups for p in g["params"]]
        norm = (t.fo.clip_grad_norm_(0.5) if t.fo is not None
                else torch.nn.utils.clip_grad_norm_(params, 0.5, foreach=True))
        t.calls.append(f"norm {norm.item()!r}")
    elif kind == "resetup" and t.fo is not None:
        t.fo.close()
        if not t.setup(op[1]):
            t.setup()


def run(name: str, kw: dict[str, Any], dtype: torch.dtype, alignment: int, scheduler: bool,
        scaler: bool, ops: list[tuple[Any, ...]]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        twins = [Twin(name, dict(kw), dtype, flat, alignment, scheduler, scaler)
                 for flat in (False, True)]
        for i, op in enumerate(ops):
            outcomes = []
            for t in twins:
                try:
                    apply(t, op, seed=i)
                    outcomes.append(None)
                except Exception as exc:  # noqa: BLE001 - torch's own error: both must raise it
                    outcomes.append(f"{type(exc).__name__}: {exc}")
            assert outcomes[0] == outcomes[1], (i, op, outcomes)
            assert twins[0].calls == twins[1].calls, (i, op)
            assert_same(twins[0].model, twins[0].opt, twins[1].model, twins[1].opt, f"op {i} {op}")


@settings(max_examples=EXAMPLES, deadline=None)
@given(config=CONFIGS, dtype=st.sampled_from(DTYPES), alignment=st.sampled_from([1, 4, 64]),
       scheduler=st.booleans(), scaler=st.booleans(), ops=st.lists(OPS, min_size=1, max_size=10))
def test_flat_managed_optimizer_is_torchs(config: tuple[str, dict[str, Any]], dtype: torch.dtype,
                                          alignment: int, scheduler: bool, scaler: bool,
                                          ops: list[tuple[Any, ...]]) -> None:
    name, kw = config
    run(name, kw, dtype, alignment, scheduler, scaler, ops)
