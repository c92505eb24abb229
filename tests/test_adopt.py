"""pool.adopt(): identity, values, release proof, batches, rollback, fault injection, autograd.

Every adoption test checks the four things the ownership issue asks for: the tensor objects
keep their identity, the values are bit-identical, the optimizer steps the *pool* storage and
every original storage expired (a weak reference, C++ holders included).
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import flatpool
from flatpool.testing import FailAt, set_fault_hook
from flatpool import (
    AdoptionError,
    AdoptSpec,
    AliasingError,
    FlatPool,
    Holder,
    InvalidRequestError,
    InvalidTypeError,
    PinnedStorageError,
    PoolExhaustedError,
    local_tensor,
    storage_of,
)

CAP = 1 << 16


def key(t: torch.Tensor) -> int:
    return int(storage_of(t)._cdata)


def weak(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(storage_of(t))


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(123)
    return [(torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)) for _ in range(n)]


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, data: Any) -> None:
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


# -- plain tensors -----------------------------------------------------------------------------
def test_plain_tensor_identity_values_and_release() -> None:
    pool = FlatPool(capacity=CAP, name="plain")
    t = torch.randn(4, 5)
    before, ident, ref = t.clone(), id(t), weak(t)
    report = pool.adopt(t)
    assert id(t) == ident and torch.equal(t, before)
    assert pool.owns(t) and pool.slice_of(t) == report.slices[0]
    assert ref.expired()
    item = report.items[0]
    assert item.released and item.freed_bytes == 80 and item.rebound == 1 and item.pinned_by == ()
    assert report.all_released and report.freed_bytes == 80
    # Writes through the tensor land in the pool, and the other way round.
    t.add_(1)
    assert torch.equal(report.slices[0].tensor(), before + 1)
    report.slices[0].tensor().zero_()
    assert torch.equal(t, torch.zeros(4, 5))
    assert pool.is_valid()


def test_requires_grad_leaf_stays_a_leaf() -> None:
    pool = FlatPool(capacity=CAP)
    t = torch.randn(3, requires_grad=True)
    pool.adopt(t)
    assert t.is_leaf and t.requires_grad and t.grad_fn is None
    (t * 2).sum().backward()
    assert t.grad is not None and torch.equal(t.grad, torch.full((3,), 2.0))
    assert not pool.owns(t.grad)


def test_mixed_dtypes_batch_and_single_foreach_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = torch._foreach_copy_

    def counting(dst: Any, src: Any, *a: Any, **k: Any) -> Any:
        calls.append(len(dst))
        return real(dst, src, *a, **k)

    monkeypatch.setattr(torch, "_foreach_copy_", counting)
    pool = FlatPool(capacity=CAP)
    ts = [torch.randn(7), torch.arange(5, dtype=torch.int64), torch.randn(3, 3).to(torch.bfloat16),
          torch.tensor([True, False, True])]
    before = [t.clone() for t in ts]
    refs = [weak(t) for t in ts]
    report = pool.adopt(ts)
    assert calls == [4]
    assert len(report.items) == 4 and report.all_released
    assert all(r.expired() for r in refs)
    for t, b, slc in zip(ts, before, report.slices):
        assert t.dtype == b.dtype and torch.equal(t, b) and pool.slice_of(t) == slc
        assert slc.offset % pool.alignment == 0
    assert report.freed_bytes == sum(b.numel() * b.element_size() for b in before)


def test_non_contiguous_primary_keeps_strides() -> None:
    pool = FlatPool(capacity=CAP)
    t = torch.randn(6, 4).t()  # a transposed leaf: strided, no autograd base
    t = t.detach()
    assert not t.is_contiguous() and t._base is None
    before, stride = t.clone(), t.stride()
    report = pool.adopt(t)
    assert t.stride() == stride and torch.equal(t, before)
    assert report.slices[0].shape == (24,) and report.all_released


def test_adopt_into_given_slice() -> None:
    pool = FlatPool(capacity=CAP)
    slc = pool.allocate((2, 3), torch.float32)
    t = torch.randn(2, 3)
    before = t.clone()
    report = pool.adopt(AdoptSpec(t, slice=slc))
    assert report.slices == (slc,) and torch.equal(slc.tensor(), before) and pool.owns(t)
    other = torch.randn(2, 3)
    with pytest.raises(InvalidRequestError, match="already backs"):
        pool.adopt(AdoptSpec(other, slice=slc))
    with pytest.raises(InvalidRequestError, match="needs"):
        pool.adopt(AdoptSpec(torch.randn(4), slice=pool.allocate(3, torch.float32)))


# -- parameters under an optimizer ----------------------------------------------------------
@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
        lambda ps: torch.optim.Adam(ps, lr=0.01),
        lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=False),
    ],
    ids=["sgd-momentum", "adam-foreach", "adam-loop"],
)
def test_training_after_adoption_is_bit_identical(
    make_opt: Callable[[Any], torch.optim.Optimizer],
) -> None:
    data = _batches(6)
    ref_model = _model()
    ref_opt = make_opt(ref_model.parameters())
    model = copy.deepcopy(ref_model)
    opt = make_opt(model.parameters())
    _train(ref_model, ref_opt, data[:3])
    _train(model, opt, data[:3])  # optimizer state exists before adoption

    params = list(model.parameters())
    ids = [id(p) for p in params]
    state_ids = {id(p): {k: id(v) for k, v in opt.state[p].items()} for p in params}
    refs = [weak(p) for p in params]
    pool = FlatPool(capacity=CAP, name="params")
    report = pool.adopt(params)
    assert report.all_released and all(r.expired() for r in refs)
    assert [id(p) for p in model.parameters()] == ids
    assert [id(p) for p in opt.param_groups[0]["params"]] == ids
    for p in model.parameters():
        assert isinstance(p, torch.nn.Parameter) and p.is_leaf and p.requires_grad
        assert pool.owns(p)
        assert {k: id(v) for k, v in opt.state[p].items()} == state_ids[id(p)]
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)

    _train(ref_model, ref_opt, data[3:])
    _train(model, opt, data[3:])
    for p, q, slc in zip(model.parameters(), ref_model.parameters(), report.slices):
        assert torch.equal(p, q)
        assert torch.equal(slc.tensor(), q)  # the optimizer stepped the pool's storage
        assert pool.owns(p)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        for k, v in ref_opt.state[q].items():
            assert torch.equal(opt.state[p][k], v)
    assert pool.is_valid()


def test_adoption_before_first_step_then_train() -> None:
    data = _batches(4)
    ref_model = _model(1)
    model = copy.deepcopy(ref_model)
    pool = FlatPool(capacity=CAP)
    pool.adopt(list(model.parameters()))
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    ref_opt = torch.optim.Adam(ref_model.parameters(), lr=0.02)
    _train(model, opt, data)
    _train(ref_model, ref_opt, data)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q) and pool.owns(p)
    # The whole bucket is one flat buffer: a fused view sees every parameter.
    flat = pool.flat()
    assert flat.dtype == torch.float32
    for p in model.parameters():
        slc = pool.slice_of(p)
        assert slc is not None
        n = slc.offset // 4
        assert torch.equal(flat[n : n + p.numel()].view_as(p), p)


# -- views -------------------------------------------------------------------------------------
class Box:
    pass


def test_explicit_baseless_views_are_rebound_in_place() -> None:
    pool = FlatPool(capacity=CAP)
    base = torch.randn(10)
    alias = base.detach()  # same storage, no autograd base
    window = torch.empty(0)
    window.set_(base.untyped_storage(), 2, (2, 3), (3, 1))  # a hand-made strided window
    before = (base.clone(), alias.clone(), window.clone())
    ids = (id(alias), id(window))
    ref = weak(base)
    report = pool.adopt(AdoptSpec(base, views=[alias, window]))
    assert report.all_released and ref.expired() and report.items[0].rebound == 3
    assert (id(alias), id(window)) == ids
    assert torch.equal(base, before[0]) and torch.equal(alias, before[1])
    assert torch.equal(window, before[2]) and window.stride() == (3, 1)
    assert window.storage_offset() * 4 == report.slices[0].offset + 8
    base[3] = 42.0
    assert alias[3] == 42.0 and window[0, 1] == 42.0


def test_autograd_view_needs_its_holder() -> None:
    pool = FlatPool(capacity=CAP)
    base = torch.randn(10)
    box = Box()
    box.v = base.narrow(0, 2, 5)  # type: ignore[attr-defined]
    assert box.v._base is base  # type: ignore[attr-defined]
    old_view, k = box.v, key(base)  # type: ignore[attr-defined]
    with pytest.raises(PinnedStorageError):
        pool.adopt(base)  # set_ alone would leave box.v's base pinning the original
    assert key(base) == k and box.v is old_view and pool.slices() == ()  # type: ignore[attr-defined]
    del old_view
    expected = box.v.clone()  # type: ignore[attr-defined]
    ref = weak(base)
    report = pool.adopt(AdoptSpec(base, holders=[Holder(box, "v")]))
    assert report.all_released and ref.expired()
    # Named, the view moves in place with its base: still a view of it, both in the pool.
    assert box.v._base is base and pool.owns(box.v)  # type: ignore[attr-defined]
    assert torch.equal(box.v, expected)  # type: ignore[attr-defined]
    base[2] = 7.0
    assert box.v[0] == 7.0  # type: ignore[attr-defined]


def test_narrowed_local_of_padded_data_fsdp_style() -> None:
    """FSDP2 after to_empty: the local tensor is a narrow of the padded data (has a _base)."""
    pool = FlatPool(capacity=CAP)
    padded = torch.zeros(8, 3)
    padded[:6] = torch.randn(6, 3)
    param = Box()
    param._sharded_param_data = padded.view(-1)  # type: ignore[attr-defined]
    param._local_tensor = padded.narrow(0, 0, 6)  # type: ignore[attr-defined]
    local_before = param._local_tensor.clone()  # type: ignore[attr-defined]
    ref = weak(padded)
    report = pool.adopt(
        AdoptSpec(
            padded,
            holders=[Holder(param, "_sharded_param_data"), Holder(param, "_local_tensor")],
        )
    )
    del padded
    assert report.all_released and ref.expired()
    assert torch.equal(param._local_tensor, local_before)  # type: ignore[attr-defined]
    assert param._local_tensor.shape == (6, 3)  # type: ignore[attr-defined]
    assert pool.owns(param._local_tensor) and pool.owns(param._sharded_param_data)  # type: ignore[attr-defined]
    param._sharded_param_data[0] = 5.0  # type: ignore[attr-defined]
    assert param._local_tensor[0, 0] == 5.0  # type: ignore[attr-defined]


def test_narrowed_primary_with_rest_of_storage_kept() -> None:
    """Adopting only a narrow window of a storage: the rest of the storage pins it."""
    pool = FlatPool(capacity=CAP)
    whole = torch.randn(10)
    part = whole[2:6].detach()
    with pytest.raises(PinnedStorageError, match="whole"):
        pool.adopt(part)
    assert pool.slices() == () and not pool.owns(part)


def test_discover_finds_hidden_views() -> None:
    pool = FlatPool(capacity=CAP)
    base = torch.randn(6)
    box = Box()
    box.hidden = base.detach()  # type: ignore[attr-defined]
    holder = {"v": base[1:4]}  # an autograd view in a dict: replaced through the dict
    before = holder["v"].clone()
    ref = weak(base)
    report = pool.adopt(base, discover=True)
    assert report.all_released and ref.expired()
    assert pool.owns(box.hidden) and pool.owns(holder["v"])  # type: ignore[attr-defined]
    assert torch.equal(holder["v"], before)


def test_view_outside_primary_is_refused() -> None:
    pool = FlatPool(capacity=CAP)
    whole = torch.randn(10)
    part = torch.empty(0)
    part.set_(whole.untyped_storage(), 0, (4,), (1,))
    with pytest.raises(InvalidRequestError, match="outside"):
        pool.adopt(AdoptSpec(part, views=[whole]))
    with pytest.raises(InvalidRequestError, match="does not share"):
        pool.adopt(AdoptSpec(whole, views=[torch.randn(3)]))


# -- DTensor and storage-sharing wrappers ------------------------------------------------------
def test_dtensor_parameter_single_rank(dtensor_from_local: Callable[[torch.Tensor], torch.Tensor]) -> None:
    torch.manual_seed(0)
    full = torch.randn(6, 4)
    target = dtensor_from_local(torch.randn(6, 4))
    ref_p = torch.nn.Parameter(dtensor_from_local(full.clone()))
    p = torch.nn.Parameter(dtensor_from_local(full.clone()))
    opt = torch.optim.Adam([p], lr=0.1)
    ref_opt = torch.optim.Adam([ref_p], lr=0.1)

    def step(param: torch.Tensor, o: torch.optim.Optimizer) -> None:
        o.zero_grad()
        ((param - target) ** 2).sum().backward()
        o.step()

    step(p, opt)
    step(ref_p, ref_opt)
    ident, local_before = id(p), p.to_local().clone()  # type: ignore[attr-defined]
    ref = weak(p)
    pool = FlatPool(capacity=CAP)
    report = pool.adopt(p)
    assert report.all_released and ref.expired()
    assert id(p) == ident and isinstance(p, torch.nn.Parameter)
    from torch.distributed.tensor import DTensor

    assert isinstance(p, DTensor)
    assert torch.equal(local_tensor(p), local_before) and pool.owns(local_tensor(p))
    assert opt.param_groups[0]["params"][0] is p
    for _ in range(3):
        step(p, opt)
        step(ref_p, ref_opt)
    assert torch.equal(local_tensor(p), local_tensor(ref_p))
    assert torch.equal(report.slices[0].tensor(), local_tensor(ref_p))
    assert pool.is_valid()


def test_storage_sharing_subclass(hp_wrap: Callable[[torch.Tensor], torch.Tensor]) -> None:
    local = torch.randn(4, 3)
    w = hp_wrap(local)
    assert key(w) == key(local)
    with torch._C.DisableTorchFunctionSubclass():
        assert int(w.untyped_storage()._cdata) == key(local)
    before, ident, local_id = local.clone(), id(w), id(local)
    ref = weak(local)
    pool = FlatPool(capacity=CAP)
    report = pool.adopt(w)
    assert report.all_released and ref.expired() and report.items[0].rebound == 2
    assert id(w) == ident and w._local_tensor is local and id(local) == local_id  # type: ignore[attr-defined]
    with torch._C.DisableTorchFunctionSubclass():
        assert int(w.untyped_storage()._cdata) == int(pool.storage._cdata)
        assert torch.equal(w.as_subclass(torch.Tensor), before)
    assert torch.equal(local, before) and pool.owns(local)


# -- bad input leaves everything as it was -----------------------------------------------------
def _snapshot(pool: FlatPool, tensors: list[torch.Tensor]) -> tuple[Any, ...]:
    return (
        pool.describe(),
        pool.slices(),
        [id(t) for t in tensors],
        [key(t) for t in tensors],
        [t.detach().clone() for t in tensors],
        [(t.shape, t.stride(), t.storage_offset()) for t in tensors],
    )


def _assert_same(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    assert a[0] == b[0] and a[1] == b[1] and a[2] == b[2] and a[3] == b[3] and a[5] == b[5]
    assert all(torch.equal(x, y) for x, y in zip(a[4], b[4]))


@pytest.mark.parametrize(
    "bad, exc, match",
    [
        (lambda: torch.empty(3, device="meta"), InvalidRequestError, "meta"),
        (lambda: torch.empty(0), InvalidRequestError, "empty"),
        (lambda: torch.randn(1).expand(4), InvalidRequestError, "overlaps itself"),
        (lambda: "x", InvalidTypeError, "takes tensors or AdoptSpecs"),
    ],
    ids=["meta", "empty", "expanded", "not-a-tensor"],
)
def test_bad_input_in_a_batch_rolls_back(bad: Callable[[], Any], exc: type, match: str) -> None:
    pool = FlatPool(capacity=CAP)
    pool.adopt(torch.randn(3))
    good = [torch.randn(4), torch.randn(2, 2)]
    snap = _snapshot(pool, good)
    with pytest.raises(exc, match=match):
        pool.adopt([good[0], bad(), good[1]])
    _assert_same(snap, _snapshot(pool, good))


def test_invalid_arguments() -> None:
    pool = FlatPool(capacity=CAP)
    t = torch.randn(3)
    with pytest.raises(InvalidRequestError, match="nothing"):
        pool.adopt([])
    with pytest.raises(InvalidTypeError):
        pool.adopt({"a": t})  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="on_pinned"):
        pool.adopt(t, on_pinned="maybe")  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="discover"):
        pool.adopt(t, discover=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="twice"):
        pool.adopt([t, t])
    with pytest.raises(InvalidTypeError, match="views"):
        AdoptSpec(t, views=[1])  # type: ignore[list-item]
    with pytest.raises(InvalidTypeError, match="holders"):
        AdoptSpec(t, holders=["x"])  # type: ignore[list-item]
    with pytest.raises(InvalidRequestError, match="holder"):
        pool.adopt(AdoptSpec(t, holders=[Holder(Box(), "missing")]))
    with pytest.raises(InvalidRequestError, match="does not hold"):
        pool.adopt(AdoptSpec(t, holders=[Holder({"k": torch.randn(3)}, "k", item=True)]))
    assert pool.slices() == () and not pool.owns(t)


def test_overlapping_primaries_are_aliasing() -> None:
    pool = FlatPool(capacity=CAP)
    base = torch.randn(10)
    a = torch.empty(0).set_(base.untyped_storage(), 0, (6,), (1,))
    b = torch.empty(0).set_(base.untyped_storage(), 4, (6,), (1,))
    with pytest.raises(AliasingError):
        pool.adopt([a, b])
    assert pool.slices() == ()


def test_already_in_a_pool() -> None:
    pool, other = FlatPool(capacity=CAP), FlatPool(capacity=CAP, name="other")
    t = torch.randn(3)
    pool.adopt(t)
    with pytest.raises(InvalidRequestError, match="this pool"):
        pool.adopt(t)
    with pytest.raises(InvalidRequestError, match="pool"):
        other.adopt(t)


def test_exhaustion_mid_batch_rolls_back() -> None:
    pool = FlatPool(capacity=2048)
    pool.adopt(torch.randn(100))
    ts = [torch.randn(100), torch.randn(100), torch.randn(300)]  # the third does not fit
    snap = _snapshot(pool, ts)
    with pytest.raises(PoolExhaustedError):
        pool.adopt(ts)
    _assert_same(snap, _snapshot(pool, ts))
    assert pool.used_bytes == 400


def test_wrong_device_is_refused() -> None:
    pool = FlatPool(capacity=CAP)
    with pytest.raises(InvalidRequestError, match="meta"):
        pool.adopt(torch.nn.Parameter(torch.empty(3, device="meta")))


# -- fault injection ---------------------------------------------------------------------------
def _count_checkpoints(run: Callable[[], Any]) -> list[str]:
    steps: list[str] = []
    set_fault_hook(steps.append)
    try:
        run()
    finally:
        set_fault_hook(None)
    return steps


class _Fault(Exception):
    pass


def _scenario() -> tuple[FlatPool, list[Any], Callable[[], Any], list[torch.Tensor]]:
    """A batch with every kind of member: plain, parameter+optimizer, explicit view, holder."""
    pool = FlatPool(capacity=CAP, name="faults")
    pool.adopt(torch.randn(3))  # something already in the pool
    plain = torch.randn(5)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    base = torch.randn(8)
    alias = base.detach()
    box = Box()
    box.v = base.narrow(0, 1, 4)  # type: ignore[attr-defined]
    keep = [plain, model, opt, base, alias, box]
    targets = [plain, model.weight, model.bias, AdoptSpec(base, views=[alias], holders=[Holder(box, "v")])]
    watched = [plain, model.weight, model.bias, base, alias]
    return pool, keep, lambda: pool.adopt(targets), watched


def _fault_cases() -> list[int]:
    pool, keep, run, _ = _scenario()
    return list(range(len(_count_checkpoints(run))))


@pytest.mark.parametrize("exc_type", [RuntimeError, KeyboardInterrupt, _Fault])
@pytest.mark.parametrize("k", _fault_cases())
def test_fault_at_every_checkpoint_rolls_back(k: int, exc_type: type[BaseException]) -> None:
    pool, keep, run, watched = _scenario()
    box = keep[5]
    view_before, view_id = box.v, id(box.v)
    snap = _snapshot(pool, watched)
    set_fault_hook(FailAt(k, exc_type))
    with pytest.raises(exc_type, match="injected"):
        run()
    set_fault_hook(None)
    _assert_same(snap, _snapshot(pool, watched))
    assert box.v is view_before and id(box.v) == view_id and box.v._base is keep[3]
    assert len(pool.slices()) == 1  # no slice leaked
    model, opt = keep[1], keep[2]
    assert opt.param_groups[0]["params"][0] is model.weight
    # The same adoption then succeeds in full (once our own reference to the old view is gone).
    del view_before
    report = run()
    assert report.all_released and all(pool.owns(t) for t in watched)
    assert pool.owns(box.v)


def test_fault_checkpoints_cover_every_step() -> None:
    _, _, run, _ = _scenario()
    steps = _count_checkpoints(run)
    for step in ("allocate", "copy", "rebind", "release"):
        assert step in steps


# -- autograd ----------------------------------------------------------------------------------
def test_pending_graph_that_saved_the_parameter_pins_then_backprops_under_warn() -> None:
    """A graph that saved the parameter holds its TensorImpl from C++, exactly as a DLPack
    consumer does; torch cannot tell the two apart, so by default adoption refuses ("held
    outside Python"). Under ``warn`` the move stands, the pool keeps the original alive while
    the graph may read it, backward works, and the original goes once the graph is gone."""
    w = torch.nn.Parameter(torch.randn(5))
    version = w._version
    loss = (w * w).sum()
    pool = FlatPool(capacity=CAP)
    k = key(w)
    with pytest.raises(PinnedStorageError, match="held outside Python"):
        pool.adopt(w)
    assert key(w) == k and pool.slices() == ()
    ref = weak(w)
    with pytest.warns(UserWarning, match="still referenced"):
        report = pool.adopt(w, on_pinned="warn")
    assert not report.all_released and report.freed_bytes == 0 and w._version == version
    kept = pool.unreleased_originals()
    assert len(kept) == 1 and kept[0].kept_by_pool and not ref.expired()
    loss.backward()  # no "modified by an inplace operation"
    assert w.grad is not None and torch.equal(w.grad, 2 * w.detach())
    del loss
    gc.collect()
    assert pool.release_kept() == 1 and ref.expired() and pool.unreleased_originals() == ()


def test_pending_graph_that_saved_a_named_view_still_backprops() -> None:
    """A view shares its base's version counter: adopting both in place must leave the shared
    counter where it was, whatever order they are moved in (regression: reading the view's
    counter after its base's ``set_`` recorded the bumped value)."""
    w = torch.nn.Parameter(torch.randn(8))
    v = w[:4]
    loss = (v * v).sum()  # saves the view: its impl is held from C++
    pool = FlatPool(capacity=CAP)
    with pytest.warns(UserWarning, match="held outside Python"):
        report = pool.adopt(AdoptSpec(w, views=[v]), on_pinned="warn")
    assert pool.owns(w) and pool.owns(v) and v._base is w
    assert w._version == 0 and v._version == 0
    loss.backward()
    assert w.grad is not None and torch.equal(w.grad[:4], 2 * w.detach()[:4])
    del loss, report
    gc.collect()
    assert pool.release_kept() == 1 and pool.unreleased_originals() == ()


def test_pending_graph_that_saved_a_view_pins_until_backward() -> None:
    """nn.Linear saves ``weight.t()``: a view (its own TensorImpl) on the original storage that
    only the graph holds. By default adoption refuses and rolls back; with ``warn`` it proceeds,
    backward still gives the reference gradients, and the original dies with the graph."""
    model = _model(3)
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8)
    loss = model(x).sum()
    pool = FlatPool(capacity=CAP)
    keys = [key(p) for p in model.parameters()]
    with pytest.raises(PinnedStorageError, match="held only from C[+][+]") as err:
        pool.adopt(list(model.parameters()))
    del err
    assert [key(p) for p in model.parameters()] == keys and pool.slices() == ()
    refs = [weak(p) for p in model.parameters()]
    with pytest.warns(UserWarning, match="still referenced"):
        report = pool.adopt(list(model.parameters()), on_pinned="warn")
    assert not report.all_released
    pinned = [i for i in report.items if not i.released]
    assert pinned and all(i.pinned_by for i in pinned)
    loss.backward()
    ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad)
        assert pool.owns(p)
    del loss
    gc.collect()
    pool.release_kept()  # what the pool kept while the graph might read it
    assert all(r.expired() for r in refs)  # the graph was the last holder


def test_in_place_write_after_adoption_is_still_detected() -> None:
    """Adoption preserves the version counter; a real in-place edit still invalidates."""
    w = torch.randn(4, requires_grad=True)
    loss = (w * w).sum()
    with pytest.warns(UserWarning, match="held outside Python"):  # the graph saved w
        FlatPool(capacity=CAP).adopt(w, on_pinned="warn")
    with torch.no_grad():
        w.add_(1)
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()


def test_adoption_during_backward_raises() -> None:
    pool = FlatPool(capacity=CAP)
    w = torch.randn(3, requires_grad=True)
    other = torch.randn(4)
    other_key = key(other)
    errors: list[BaseException] = []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        try:
            pool.adopt(other)
        except AdoptionError as exc:
            errors.append(exc)
        return grad

    (w * 2).register_hook(hook)
    y = w * 2
    y.register_hook(hook)
    y.sum().backward()
    assert errors and all("backward" in str(e) for e in errors)
    assert key(other) == other_key and pool.slices() == ()
    # Outside backward it works.
    assert pool.adopt(other).all_released


def test_inference_tensor_is_refused_cleanly() -> None:
    """Regression: an inference tensor used to fail inside set_ with a bare RuntimeError."""
    with torch.inference_mode():
        t = torch.randn(4)
    pool = FlatPool(capacity=CAP)
    with pytest.raises(InvalidRequestError, match="inference"):
        pool.adopt([torch.randn(2), t])
    assert pool.slices() == ()
    assert pool.adopt(t.clone()).all_released


def test_pool_does_not_keep_adopted_tensors_alive() -> None:
    pool = FlatPool(capacity=CAP)
    model = torch.nn.Linear(4, 4)
    report = pool.adopt(list(model.parameters()))
    import weakref

    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    for slc in report.slices:
        assert not pool.registry.holds(slc)
        pool.free(slc)
    assert pool.used_bytes == 0


def test_free_refuses_a_slice_backing_adopted_tensors() -> None:
    pool = FlatPool(capacity=CAP)
    t = torch.randn(3)
    slc = pool.adopt(t).slices[0]
    with pytest.raises(InvalidRequestError, match="disown"):
        pool.free(slc)
    pool.disown(slc)
    pool.free(slc)
    assert pool.slices() == ()


def test_public_names() -> None:
    for name in ("AdoptSpec", "Holder", "AdoptionReport", "AdoptedItem", "census"):
        assert hasattr(flatpool, name)
    # The old test-hook names still resolve, with a deprecation warning naming the new home.
    with pytest.warns(DeprecationWarning, match="flatpool.testing.set_fault_hook"):
        assert flatpool.set_fault_hook is flatpool.testing.set_fault_hook  # type: ignore[attr-defined]


def test_fail_at_raises_once_at_its_checkpoint() -> None:
    hook = FailAt(2, KeyboardInterrupt)
    hook("allocate")
    hook("copy")
    with pytest.raises(KeyboardInterrupt, match=r"injected at checkpoint 2 \(rebind\)"):
        hook("rebind")
    hook("release")  # only the k-th checkpoint fails
    assert hook.steps == ["allocate", "copy", "rebind", "release"]


# -- autograd state a move must keep (hostile inputs, round 3) ---------------------------------


def _leaf_view() -> torch.Tensor:
    """A leaf that is an autograd view of a dropped base (``b[2:6].requires_grad_()``)."""
    b = torch.arange(8.0)
    v = b[2:6]
    v.requires_grad_(True)
    assert v.is_leaf and v._base is b
    return v


def test_leaf_view_moved_off_its_base_keeps_grad_and_hooks() -> None:
    """Moving an autograd view off its base gives it a new TensorImpl; its ``.grad`` and its
    hooks lived on the old one and were silently lost (accumulation restarted, hooks stopped)."""
    v = _leaf_view()
    calls: list[str] = []
    v.register_hook(lambda g: calls.append("hook"))
    v.register_post_accumulate_grad_hook(lambda t: calls.append("post"))
    (v * 2).sum().backward()
    assert calls == ["hook", "post"]
    pool = FlatPool()
    report = pool.adopt(v)
    assert report.all_released and pool.owns(v) and v._base is None and v.is_leaf
    assert v.grad is not None and torch.equal(v.grad, torch.full((4,), 2.0))
    calls.clear()
    (v * 3).sum().backward()
    assert calls == ["hook", "post"]
    assert torch.equal(v.grad, torch.full((4,), 5.0))  # accumulated into the kept .grad
    assert torch.equal(v.detach(), torch.arange(2.0, 6.0))


def _padded_shard(adopt: bool) -> tuple[str, torch.Tensor | None]:
    """FSDP2's padded shard: data and local tensor, two views of one base that was dropped.
    An in-place write through ``data`` after ``local`` was saved for backward."""
    base = torch.arange(12.0)
    data, local = base.narrow(0, 0, 12), base.narrow(0, 0, 10)
    del base
    if adopt:
        assert FlatPool().adopt(AdoptSpec(data, views=(local,))).all_released
    w = torch.ones(10, requires_grad=True)
    out = (w * local).sum()
    data.add_(1)
    try:
        out.backward()
    except RuntimeError as exc:
        assert "modified by an inplace operation" in str(exc)
        return "raised", None
    return "ran", w.grad


def test_aliases_keep_sharing_a_version_counter() -> None:
    """Two views of one base share its version counter; after adoption each had its own, so an
    in-place write through one went unseen by autograd for the other (backward ran on the new
    values). torch raises; so must it after adoption."""
    assert _padded_shard(adopt=False) == ("raised", None)
    assert _padded_shard(adopt=True) == ("raised", None)


def test_storage_once_viewed_by_numpy_counts_as_external() -> None:
    """``t.numpy()`` marks the storage non-resizable for good, as ``torch.from_numpy`` does,
    and torch does not say which allocator made a storage: the safe answer is "another owner's"
    (a warning, ``external=True``, ``freed_bytes`` 0), though the original is proven dead and
    the tensor is moved like any other. (Reading torch's allocator word out of the StorageImpl
    told the two apart; flatpool reads no raw memory, issue 31.)"""
    t = torch.arange(1 << 20, dtype=torch.float32)
    array = t.numpy()
    del array
    assert not t.untyped_storage().resizable()
    pool = FlatPool()
    with pytest.warns(flatpool.ExternalMemoryWarning):
        report = pool.adopt(t)
    item = report.items[0]
    assert item.released and item.external and report.freed_bytes == 0
    assert pool.owns(t) and torch.equal(t, torch.arange(1 << 20, dtype=torch.float32))


def test_from_numpy_memory_is_still_external() -> None:
    """The rule above does not touch memory numpy owns: still external, nothing freed."""
    import numpy

    array = numpy.arange(16, dtype=numpy.float32)
    t = torch.from_numpy(array)
    with pytest.warns(flatpool.ExternalMemoryWarning):
        report = FlatPool().adopt(t)
    assert report.items[0].external and report.freed_bytes == 0


def test_aliases_keep_sharing_a_version_counter_through_readopt() -> None:
    """The same when re-adoption finds new objects in the holders' places (a framework that
    rebuilt its shard: a new base and a narrow view of it): the view is moved off the new base
    and still shares the base's counter."""
    from flatpool import Holder

    class Shard:
        pass

    shard = Shard()
    shard.data = torch.arange(12.0)  # type: ignore[attr-defined]
    shard.local = shard.data.narrow(0, 0, 10)  # type: ignore[attr-defined]
    pool = FlatPool()
    holders = (Holder(shard, "data"), Holder(shard, "local"))
    pool.adopt(AdoptSpec(shard.data, holders=holders))  # type: ignore[attr-defined]
    shard.data = torch.arange(12.0) + 1  # type: ignore[attr-defined]
    shard.local = shard.data.narrow(0, 0, 10)  # type: ignore[attr-defined]
    assert pool.readopt().all_released
    data, local = shard.data, shard.local  # type: ignore[attr-defined]
    assert pool.owns(data) and pool.owns(local) and local._base is None
    v = data._version
    local.add_(0)
    assert data._version == v + 1


def test_report_repr_leads_with_the_summary() -> None:
    """Issue 32.8: ``repr(report)`` was one line of every item's fields. It now leads with what
    a user asks first (how many tensors, bytes moved and freed, all released?), then lists the
    first items, one a line, and says how many more ``.items`` holds."""
    pool = flatpool.FlatPool(name="bucket")
    tensors = [torch.randn(6, 8) for _ in range(20)]
    lines = repr(pool.adopt(tensors)).splitlines()
    assert lines[0] == ("AdoptionReport(20 tensors into pool 'bucket': 3.75 KiB moved, "
                        "3.75 KiB freed, all released)")
    assert lines[1] == "  #0: slice 0 (float32 6x8, 192 B), original 192 B released"
    assert len(lines) == 1 + 8 + 1 and lines[-1] == "  ... 12 more in .items"
    assert all(len(line) < 100 for line in lines)

    one = torch.randn(10)
    keep = one.view(2, 5)
    with pytest.warns(flatpool.FlatPoolWarning):
        text = repr(flatpool.FlatPool(name="held").adopt([one], on_pinned="warn"))
    first, item = text.splitlines()
    assert first == "AdoptionReport(1 tensor into pool 'held': 40 B moved, 0 B freed, 1 kept alive)"
    assert "original 40 B kept alive, held by" in item and "keep" in item
    del keep
    assert repr(flatpool.AdoptionReport(())) == "AdoptionReport(nothing adopted)"
