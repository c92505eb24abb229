"""``FlatOptimizer.collective_output``: a gradient pool handed to a collective as its output
(what FSDP2's reduce-scatter gets), on a real FlatOptimizer over a real FlatPool, no FSDP2: the
flat view when the layout matches, a reason when it does not, nothing when closed or while a
member has a gradient; checked once per plan and layout."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from flatpool import FlatPool
from flatpool.optim import FlatOptimizer, Member
from flatpool.optim import _collective

Layout = tuple[FlatOptimizer, FlatPool, nn.Module, tuple[torch.Tensor, ...], tuple[int, ...], int]


def setup() -> Layout:
    """An SGD over a model packed from byte 0 (alignment 1): its members' params and offsets."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    pool = FlatPool(alignment=1, name="params")
    pool.adopt(list(model.parameters()))
    fo = FlatOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), [pool])
    ms: list[Member] = sorted((m for s in fo.segments for m in s.members if m.pool is pool),
                              key=lambda m: m.offset)
    assert [m.offset for m in ms][0] == 0
    assert all(a.end == b.offset for a, b in zip(ms, ms[1:]))  # no gaps
    return (fo, pool, model, tuple(m.param for m in ms), tuple(m.offset for m in ms),
            sum(m.numel for m in ms))


def test_the_flat_view_when_the_layout_matches() -> None:
    fo, pool, model, params, offsets, numel = setup()
    assert fo.check_collective_output(pool, params, offsets) is None
    out = fo.collective_output(pool, params, offsets, numel, torch.float32)
    assert out is not None
    assert out.shape == (numel,) and out.dtype == torch.float32 and out.storage_offset() == 0
    [gpool] = fo.buffers()["grad"]
    assert out.data_ptr() == gpool.view_at(0, (numel,), torch.float32).data_ptr()
    # as FSDP2 does: write it whole, view each .grad at its absolute storage offset
    out.copy_(torch.randn(numel))
    for p, at in zip(params, offsets):
        p.grad = torch.as_strided(out, p.shape, p.stride(), at // 4)
    want = [nn.Parameter(p.detach().clone()) for p in params]  # torch's own step, same grads
    for w, p in zip(want, params):
        w.grad = p.grad.clone()  # type: ignore[union-attr]
    torch.optim.SGD(want, lr=0.1).step()
    assert all(fo.grads.pooled(0, len(params)))  # FSDP2's views are the pooled gradients
    fo.step()
    assert all(torch.equal(p, w) for p, w in zip(params, want))
    assert fo.buffers()["grad"] == [gpool]  # stepped from the pool it handed out


def test_a_reason_when_the_params_or_offsets_differ() -> None:
    fo, pool, model, params, offsets, numel = setup()
    for other in (params[::-1], params[:-1], params + (nn.Parameter(torch.zeros(2)),)):
        why = fo.check_collective_output(pool, other, offsets[:len(other)])
        assert why == "not every member of the group is a flat member of this optimizer"
        assert fo.collective_output(pool, other, offsets, numel, torch.float32) is None
    shifted = tuple(o + 4 for o in offsets)
    assert fo.check_collective_output(pool, params, shifted) == (
        "the pool has gaps between the padded shards (alignment > 1)")
    assert fo.collective_output(pool, params, shifted, numel, torch.float32) is None
    assert fo.buffers()["grad"] == []  # nothing handed out, nothing made


def test_nothing_when_closed() -> None:
    fo, pool, model, params, offsets, numel = setup()
    before = fo.closed
    fo.close()
    assert (before, fo.closed) == (False, True)
    assert fo.collective_output(pool, params, offsets, numel, torch.float32) is None
    assert fo.check_collective_output(pool, params, offsets) == "the flat optimizer is closed"
    with pytest.raises(AttributeError):
        fo.closed = False  # type: ignore[misc]


def test_nothing_while_a_member_has_a_gradient() -> None:
    fo, pool, model, params, offsets, numel = setup()
    model(torch.randn(2, 4)).sum().backward()  # autograd's own .grads (no module=): FSDP2 adds
    assert fo.check_collective_output(pool, params, offsets) is None
    assert fo.collective_output(pool, params, offsets, numel, torch.float32) is None
    for p in params:
        p.grad = None
    assert fo.collective_output(pool, params, offsets, numel, torch.float32) is not None


def test_checked_once_per_plan_and_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    fo, pool, model, params, offsets, numel = setup()
    calls = []
    real = _collective.check

    def counted(*a: Any) -> Any:
        calls.append(1)
        return real(*a)

    monkeypatch.setattr(_collective, "check", counted)
    for _ in range(3):  # the same tuples: one check
        assert fo.check_collective_output(pool, params, offsets) is None
        fo.collective_output(pool, params, offsets, numel, torch.float32)
        fo.optimizer.zero_grad()
    assert len(calls) == 1
    fo.check_collective_output(pool, tuple(list(params)), offsets)  # equal, not the same tuple
    fo.check_collective_output(pool, list(params), offsets)
    assert len(calls) == 3
    fo.readopt()  # a new plan: checked again
    assert fo.check_collective_output(pool, params, offsets) is None
    assert len(calls) == 4
