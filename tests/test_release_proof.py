"""Release proof: a pinned original is refused (named, rolled back), warned about, or forced.

The proof is a weak reference to each original storage, which also sees C++ holders
(autograd's saved tensors). These tests pin originals in every way the ownership issue lists
and check that the error names the holder and that the rollback leaves everything as before.
"""

from __future__ import annotations

import gc
import os
import warnings
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from flatpool import AdoptSpec, FlatPool, Holder, InvalidRequestError, InvalidTypeError
from flatpool import PinnedStorageError, storage_of
from flatpool import _torch_compat as tc

CAP = 1 << 16


def key(t: torch.Tensor) -> int:
    return int(storage_of(t)._cdata)


def weak(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(storage_of(t))


class Box:
    pass


class State:
    """Everything a rollback must restore, for a list of tensors and a pool."""

    def __init__(self, pool: FlatPool, tensors: list[torch.Tensor]) -> None:
        self.describe = pool.describe()
        self.slices = pool.slices()
        self.ids = [id(t) for t in tensors]
        self.keys = [key(t) for t in tensors]
        self.values = [t.detach().clone() for t in tensors]
        self.geometry = [(t.shape, t.stride(), t.storage_offset()) for t in tensors]

    def check(self, pool: FlatPool, tensors: list[torch.Tensor], *, keys: bool = True) -> None:
        now = State(pool, tensors)
        assert now.describe == self.describe and now.slices == self.slices
        assert now.ids == self.ids and now.geometry == self.geometry
        if keys:
            assert now.keys == self.keys
        assert all(torch.equal(a, b) for a, b in zip(now.values, self.values))
        assert not any(pool.owns(t) for t in tensors)


def _raises_pinned(pool: FlatPool, targets: Any, **kw: Any) -> PinnedStorageError:
    with pytest.raises(PinnedStorageError) as info:
        pool.adopt(targets, **kw)
    return info.value


# -- naming and rollback (default on_pinned="raise") ------------------------------------------
def test_hidden_extra_view_in_a_local_variable() -> None:
    pool = FlatPool(capacity=CAP)
    pool.adopt(torch.randn(4))
    t = torch.randn(6)
    hidden = t.detach()
    state = State(pool, [t, hidden])
    err = _raises_pinned(pool, t)
    assert "local variable 'hidden'" in str(err)
    assert "test_hidden_extra_view_in_a_local_variable" in str(err)
    assert list(err.holders) == ["#0 Tensor(6,) float32"]
    state.check(pool, [t, hidden])
    del hidden
    assert pool.adopt(t).all_released


def test_reference_in_a_dict() -> None:
    pool = FlatPool(capacity=CAP)
    t = torch.randn(3, 2)
    cache = {"stash": t.detach()}
    state = State(pool, [t, cache["stash"]])
    err = _raises_pinned(pool, t)
    assert "['stash']" in str(err)
    state.check(pool, [t, cache["stash"]])


def test_reference_in_a_list() -> None:
    pool = FlatPool(capacity=CAP)
    t = torch.randn(5)
    keep = [torch.randn(1), t[1:3].detach()]
    err = _raises_pinned(pool, t)
    assert "list[1]" in str(err)
    assert not pool.owns(t) and pool.slices() == () and keep


def test_module_attribute_and_shared_parameter_are_named() -> None:
    pool = FlatPool(capacity=CAP)
    model = torch.nn.Linear(3, 2)
    model.stash = model.weight.detach()  # type: ignore[assignment]
    state = State(pool, [model.weight, model.bias])
    err = _raises_pinned(pool, [model.weight, model.bias])
    assert "Linear.stash" in str(err)
    state.check(pool, [model.weight, model.bias])
    del model.stash
    # A second module sharing the storage through its own Parameter object.
    other = torch.nn.Linear(3, 2)
    other.weight = torch.nn.Parameter(model.weight.detach())
    err = _raises_pinned(pool, model.weight)
    assert "Linear.weight (parameter)" in str(err)
    state.check(pool, [model.weight, model.bias])
    # Naming the second parameter as a view adopts both.
    report = pool.adopt(AdoptSpec(model.weight, views=[other.weight]))
    assert report.all_released and pool.owns(other.weight)


def test_python_holders_come_first_and_a_views_base_is_not_called_cpp_only() -> None:
    """Issue 32.2: a view of a detached alias (``m.weight.detach()[0]``) keeps the alias alive
    only through autograd's view link, which gc cannot see. The message named that alias "held
    only from C++" first, before the dict entry that really holds it (and the kept-alive
    warning opened with it). The user's holders are named first, and an alias that is only
    some found view's base is not called a C++ holder."""
    pool = FlatPool(capacity=CAP)
    model = torch.nn.Linear(4, 4)
    model.mine = {"w": model.weight.detach()[0]}  # type: ignore[assignment]
    kept = (model.bias.detach()[:2],)
    state = State(pool, [model.weight, model.bias])
    err = _raises_pinned(pool, [model.weight, model.bias])
    lines = str(err).splitlines()
    assert lines[1].split("is held by: ")[1].startswith("Linear.mine['w'] (tensor (4,) float32)")
    assert lines[2].split("is held by: ")[1].startswith("tuple[0] (tensor (2,) float32)")
    assert "held only from C++" not in str(err)
    state.check(pool, [model.weight, model.bias])
    # A holder that really is C++-only beside a Python one: the Python one first.
    w = torch.randn(6)
    a = torch.randn(3, requires_grad=True)
    loss = (a * w[:3]).sum()  # the graph saved w[:3]
    stash = [w[3:].detach()]
    err = _raises_pinned(pool, w)
    held = str(err).splitlines()[1].split("is held by: ")[1].split("; ")
    assert held[0].startswith("list[0]") and held[-1].startswith("held only from C++"), held
    del loss, stash, kept


def test_optimizer_state_key_is_named() -> None:
    pool = FlatPool(capacity=CAP)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.state[model.weight]["snapshot"] = model.weight.detach()
    err = _raises_pinned(pool, model.weight)
    msg = str(err)
    assert "SGD.state[param(1, 4)]['snapshot']" in msg, msg
    assert not pool.owns(model.weight)


def test_autograd_graph_holding_the_original_is_cpp_only() -> None:
    pool = FlatPool(capacity=CAP)
    w = torch.randn(6)
    a = torch.randn(3, requires_grad=True)
    loss = (a * w[:3]).sum()  # the graph saved the view w[:3]; nothing in Python holds it
    state = State(pool, [w])
    err = _raises_pinned(pool, w)
    assert "held only from C++ (autograd saved tensors, hooks)" in str(err)
    state.check(pool, [w])
    loss.backward()
    assert a.grad is not None and torch.equal(a.grad, w[:3])


def test_autograd_view_named_alone_moves_off_its_base() -> None:
    """FSDP2's local tensor after to_empty: a narrow of padded data nothing else references.
    ``set_`` alone would leave its ``_base`` (the padded tensor) keeping the original alive;
    flatpool swaps the view's TensorImpl for one on the pool instead, so the same object ends
    up base-less in the pool, and the padded original dies."""
    pool = FlatPool(capacity=CAP)
    param = Box()
    param.local = torch.randn(8).narrow(0, 0, 6)  # type: ignore[attr-defined]
    local = param.local  # type: ignore[attr-defined]
    before = local.clone()
    assert local._base is not None and local._base.shape == (8,)
    ref = StorageWeakRef(storage_of(local._base))
    report = pool.adopt(local)
    assert report.all_released and ref.expired() and report.items[0].original_nbytes == 32
    assert param.local is local and local._base is None and pool.owns(local)  # type: ignore[attr-defined]
    assert torch.equal(local, before)


def test_a_graph_that_saved_a_view_moved_off_its_base_pins_early() -> None:
    """The graph keeps the view's old impl (on the original) when the view moves off its base:
    found before commit, so the rollback is exact (same storages, same objects)."""
    pool = FlatPool(capacity=CAP)
    padded = torch.randn(8)
    local = padded.narrow(0, 1, 4)
    del padded
    x = torch.randn(4, requires_grad=True)
    loss = (local * x).sum()  # saves local
    k = key(local)
    with pytest.raises(PinnedStorageError, match="held only from C"):
        pool.adopt(local)
    assert key(local) == k and local._base is not None and pool.slices() == ()
    loss.backward()
    assert x.grad is not None and torch.equal(x.grad, local)


def test_a_kept_error_does_not_pin_the_retry() -> None:
    """Regression: the traceback of a kept PinnedStorageError held the transaction, whose map of
    originals pinned every original, so the retry failed on "the UntypedStorage object"."""
    pool = FlatPool(capacity=CAP)
    t = torch.randn(6)
    hidden = t.detach()
    err = _raises_pinned(pool, t)
    del hidden
    assert err.__traceback__ is not None
    assert pool.adopt(t).all_released


def test_a_pinned_original_rolls_back_the_whole_batch() -> None:
    pool = FlatPool(capacity=CAP)
    clean = [torch.randn(4), torch.randn(2, 2)]
    pinned = torch.randn(3)
    d = {"p": pinned.detach()}
    batch = [clean[0], pinned, clean[1]]
    state = State(pool, batch)
    err = _raises_pinned(pool, batch)
    assert list(err.holders) == ["#1 Tensor(3,) float32"]
    state.check(pool, batch)
    assert d


def test_late_detected_pin_rebuilds_a_dead_original_from_the_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A holder the pre-check cannot count is only seen by the weak-reference proof after
    commit, when the other originals of the batch already died. The rollback then rebuilds each
    dead original from the pool's bytes: identity and values come back. (The pre-check is
    blinded here to reach that path with a real holder.)"""
    import flatpool.ownership._release as settle

    monkeypatch.setattr(settle, "storage_pinned", lambda txn, key, olds=None: False)
    pool = FlatPool(capacity=CAP)
    a = torch.randn(5)
    a_before, a_id = a.clone(), id(a)
    a_ref = weak(a)
    b = torch.randn(8)
    also = b.detach()  # a second tensor on b's original, not named
    b_key = key(b)
    err = _raises_pinned(pool, [a, b])
    assert "local variable 'also'" in str(err)
    del err
    assert a_ref.expired()  # a's original really died before the pin was found ...
    assert id(a) == a_id and torch.equal(a, a_before) and not pool.owns(a)  # ... and is rebuilt
    assert storage_of(a).nbytes() == 20
    assert key(b) == b_key and key(also) == b_key and not pool.owns(b)
    assert pool.slices() == () and pool.registry.bindings(pool.allocate(1, torch.uint8).slice_id) == ()
    del also


# -- on_pinned="warn" --------------------------------------------------------------------------
def test_warn_keeps_the_adoption_and_reports_the_pin() -> None:
    pool = FlatPool(capacity=CAP)
    t = torch.randn(4)
    cache = {"stash": t.detach()}
    before = t.clone()
    ref = weak(t)
    with pytest.warns(UserWarning, match=r"\['stash'\]") as rec:
        report = pool.adopt(t, on_pinned="warn")
    assert "Nothing was changed" not in str(rec[0].message)
    item = report.items[0]
    assert not item.released and item.freed_bytes == 0 and not report.all_released
    assert any("['stash']" in p for p in item.pinned_by)
    assert pool.owns(t) and torch.equal(t, before) and not pool.owns(cache["stash"])
    assert not ref.expired()
    del cache
    gc.collect()
    assert ref.expired()


# -- on_pinned="force" -------------------------------------------------------------------------
def test_force_rebinds_python_visible_holders() -> None:
    pool = FlatPool(capacity=CAP)
    t = torch.randn(6)
    cache = {"alias": t.detach(), "view": t[2:4]}  # a base-less alias and an autograd view
    values = {k: v.clone() for k, v in cache.items()}
    ref = weak(t)
    report = pool.adopt(t, on_pinned="force")
    assert report.all_released and ref.expired()
    for k, v in cache.items():
        assert pool.owns(v) and torch.equal(v, values[k])
    t[2] = 9.0
    assert cache["alias"][2] == 9.0 and cache["view"][0] == 9.0


def test_force_never_frees_memory_in_use() -> None:
    """A C++ holder cannot be rebound: force warns, keeps the original whole (never
    ``resize_(0)``), so reading it later (backward) works and sees the old values."""
    pool = FlatPool(capacity=CAP)
    w = torch.randn(2, 3)
    w_before = w.clone()
    x = torch.randn(4, 3, requires_grad=True)
    loss = torch.nn.functional.linear(x, w).sum()  # saves w.t(), made in C++ only
    nbytes = storage_of(w).nbytes()
    ref = weak(w)
    with pytest.warns(UserWarning, match="held only from C"):
        report = pool.adopt(w, on_pinned="force")
    assert not report.all_released and not ref.expired() and pool.owns(w)
    alive = ref.expired() is False and storage_of(w) is not None
    assert alive
    loss.backward()  # reads the saved original: no segfault, right values
    assert x.grad is not None and torch.equal(x.grad, torch.ones(4, 2) @ w_before)
    assert pool.owns(w) and torch.equal(w, w_before)
    assert nbytes == 24
    del loss
    gc.collect()
    assert ref.expired()


def test_force_in_a_batch_with_clean_items() -> None:
    pool = FlatPool(capacity=CAP)
    clean, pinned = torch.randn(3), torch.randn(4)
    box = Box()
    box.alias = pinned.detach()  # type: ignore[attr-defined]
    report = pool.adopt([clean, pinned], on_pinned="force")
    assert report.all_released
    assert pool.owns(clean) and pool.owns(pinned) and pool.owns(box.alias)  # type: ignore[attr-defined]
    # The forced tensor is bound: relocation moves it too.
    pool.grow(pool.capacity * 2)
    assert pool.owns(box.alias) and pool.is_valid()  # type: ignore[attr-defined]


def test_force_reaches_a_saved_tensor_python_has_seen() -> None:
    """Once Python has touched a saved tensor its object is kept with it and a gc scan finds
    it: force moves even that; backward is right. Where torch counts the graph as an owner of
    that impl beside the Python object (torch 2.10+), it is a C++ holder as a DLPack consumer
    would be, so the pool keeps the original until the graph is gone; where torch parks the
    object with the graph as the impl's only counted owner (2.7-2.9), nothing outside Python
    is seen, and the original is released at once (the graph reads the moved impl)."""
    pool = FlatPool(capacity=CAP)
    w = torch.randn(6)
    a = torch.randn(3, requires_grad=True)
    loss = (a * w[:3]).sum()
    assert loss.grad_fn is not None
    saved = loss.grad_fn.next_functions[0][0]._saved_other  # type: ignore[union-attr]
    saved_id = id(saved)
    del saved
    parked = next(o for o in gc.get_objects() if id(o) == saved_id)
    graph_counted = tc.tensor_impl_users(parked) > 1
    del parked
    ref = weak(w)
    if graph_counted:
        with pytest.warns(UserWarning, match="held outside Python"):
            report = pool.adopt(w, on_pinned="force")
        assert not report.all_released and pool.owns(w)
        assert [u.kept_by_pool for u in pool.unreleased_originals()] == [True]
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            report = pool.adopt(w, on_pinned="force")
        assert report.all_released and pool.owns(w) and ref.expired()
    loss.backward()
    assert a.grad is not None and torch.equal(a.grad, w[:3])
    del loss
    gc.collect()
    assert pool.release_kept() == (1 if graph_counted else 0) and ref.expired()


# -- the counting ------------------------------------------------------------------------------
def test_report_counts_bytes_and_rebinds() -> None:
    pool = FlatPool(capacity=CAP)
    big = torch.randn(100)
    views = [big.detach(), big.detach()]
    small = torch.randn(3, dtype=torch.float64)
    report = pool.adopt([AdoptSpec(big, views=views), small])
    assert [i.original_nbytes for i in report.items] == [400, 24]
    assert [i.rebound for i in report.items] == [3, 1]
    assert report.freed_bytes == 424 and report.all_released
    # An original bigger than the adopted window counts its full storage.
    whole = torch.randn(10)
    window = torch.empty(0).set_(whole.untyped_storage(), 2, (4,), (1,))
    del whole
    r2 = pool.adopt(window)
    assert r2.items[0].original_nbytes == 40 and r2.items[0].released
    assert r2.slices[0].nbytes == 16


def test_a_cpp_owner_that_lets_go_within_milliseconds_does_not_pin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gloo's worker thread holds the tensors of a collective for a moment after ``wait()``
    returns (seen as a spurious "held only from C++" pin, adopting right after
    ``distribute_tensor`` on a loaded machine). The pre-move check looks again before moving;
    here the owner (a pending graph that saved the tensor) goes away during the first wait."""
    import flatpool.ownership._release as proof

    t = torch.randn(4, requires_grad=True)
    graph = {"loss": (t * t).sum()}  # saves t: an owner of its impl Python cannot see
    waits: list[float] = []

    class _Clock:
        @staticmethod
        def sleep(seconds: float) -> None:
            waits.append(seconds)
            graph.clear()  # the holder lets go while flatpool waits

    monkeypatch.setattr(proof, "time", _Clock)
    dead = StorageWeakRef(storage_of(t))
    report = FlatPool(capacity=1024).adopt(t)
    assert report.all_released and dead.expired()
    assert waits == [0.0]  # looked again once, after a bare yield


def _record_waits(monkeypatch: pytest.MonkeyPatch,
                  on_sleep: Any = None) -> list[float]:
    """Replace the proof's clock: each sleep is recorded (and runs ``on_sleep(waits)``)."""
    import flatpool.ownership._release as proof

    waits: list[float] = []

    class _Clock:
        @staticmethod
        def sleep(seconds: float) -> None:
            waits.append(seconds)
            if on_sleep is not None:
                on_sleep(waits)

    monkeypatch.setattr(proof, "time", _Clock)
    return waits


def _graph_saving_an_alias(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, loss)``: a pending graph that saved an alias of ``t`` (another impl on its storage,
    no view link to it), which no Python object refers to."""
    alias = torch.empty(0).set_(t.untyped_storage(), 0, tuple(t.shape), t.stride())
    a = torch.randn(t.shape, requires_grad=True)
    return a, (a * alias).sum()


@pytest.mark.parametrize("policy", ["raise", "warn"])
def test_a_cpp_owner_of_another_impl_that_lets_go_soon_does_not_pin(
    monkeypatch: pytest.MonkeyPatch, policy: str,
) -> None:
    """The gloo case as it really happens: the worker holds the collective's *output* tensor,
    another impl on the storage of the shard being adopted (``distribute_tensor`` returns a
    detached alias of it), so only the count after the move sees it. Here a pending graph saved
    such an alias and lets go during the wait after the move."""
    import flatpool.ownership._release as proof

    t = torch.randn(8)
    graph = {"pending": _graph_saving_an_alias(t)}  # Python does not see that holder
    waits = _record_waits(monkeypatch, lambda w: len(w) == 3 and graph.clear())
    dead = StorageWeakRef(storage_of(t))
    pool = FlatPool(capacity=1024)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no OriginalKeptAliveWarning either
        report = pool.adopt(t, on_pinned=policy)  # type: ignore[arg-type]
    assert report.all_released and dead.expired() and pool.owns(t)
    assert waits == proof.settle_delays()[:3]  # looked again until it let go, no longer


def test_a_cpp_owner_of_another_impl_that_stays_pins_after_the_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import flatpool.ownership._release as proof

    t = torch.randn(8)
    a, loss = _graph_saving_an_alias(t)
    waits = _record_waits(monkeypatch)
    key = tc.storage_key(storage_of(t))
    before = t.clone()
    with pytest.raises(PinnedStorageError, match="held only from C"):
        FlatPool(capacity=1024).adopt(t)
    assert waits == proof.settle_delays()  # the whole bounded wait, once
    assert tc.storage_key(storage_of(t)) == key and torch.equal(t, before)  # rolled back
    loss.backward()
    assert a.grad is not None and torch.equal(a.grad, before)


def test_a_python_holder_pins_without_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """A holder Python can name does not go away by itself: no wait for it."""
    t = torch.randn(8)
    kept = {"stash": t.detach()}
    waits = _record_waits(monkeypatch)
    with pytest.raises(PinnedStorageError, match="stash"):
        FlatPool(capacity=1024).adopt(t)
    assert waits == [] and kept


def test_a_cpp_owner_that_stays_pins_after_a_bounded_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    import flatpool.ownership._release as proof

    t = torch.randn(4, requires_grad=True)
    loss = (t * t).sum()
    waits = _record_waits(monkeypatch)
    monkeypatch.setattr(proof, "load_factor", lambda: 3.0)  # a machine loaded 3 threads a CPU
    key = tc.storage_key(storage_of(t))
    with pytest.raises(PinnedStorageError, match="held"):
        FlatPool(capacity=1024).adopt(t)
    assert tc.storage_key(storage_of(t)) == key  # nothing moved
    assert waits == proof.settle_delays()
    # the whole bounded wait stretched by the load, no more
    assert abs(sum(waits) - 3.0 * proof.cxx_holder_wait()) < 1e-9
    assert waits[1:4] == [0.0005, 0.001, 0.002] and max(waits) <= 0.032  # doubling, capped
    loss.backward()  # the graph still works on the original
    assert torch.equal(t.grad, 2 * t.detach())


def test_the_cpp_holder_wait_stretches_with_the_load_per_cpu() -> None:
    import flatpool.ownership._release as proof

    assert proof.load_factor(0.3, 2) == 1.0  # an idle machine: the configured wait
    assert proof.load_factor(6.0, 2) == 3.0  # 3 runnable threads a CPU: 3 times as long
    assert proof.load_factor(500.0, 2) == proof.LOAD_SCALE_MAX  # bounded
    assert 1.0 <= proof.load_factor() <= proof.LOAD_SCALE_MAX  # this machine, now
    waited = proof.effective_cxx_holder_wait() / proof.cxx_holder_wait()
    assert 1.0 <= waited <= proof.LOAD_SCALE_MAX


def test_the_cpp_holder_wait_is_configurable_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import sys

    import flatpool.ownership._release as proof

    assert proof.cxx_holder_wait() == proof.DEFAULT_CXX_HOLDER_WAIT_S == 0.25
    previous = proof.set_cxx_holder_wait(1.5)
    try:
        assert previous == 0.25 and proof.cxx_holder_wait() == 1.5
        assert abs(sum(proof.settle_delays(proof.cxx_holder_wait())) - 1.5) < 1e-9
        assert proof.settle_delays(0) == [0.0]
        for bad, error in [(-1, InvalidRequestError), (float("nan"), InvalidRequestError),
                           ("1", InvalidTypeError), (True, InvalidTypeError)]:
            with pytest.raises(error, match="seconds"):
                proof.set_cxx_holder_wait(bad)  # type: ignore[arg-type]
            assert proof.cxx_holder_wait() == 1.5  # unchanged
    finally:
        proof.set_cxx_holder_wait(previous)
    code = "import flatpool.ownership._release as p; print(p.cxx_holder_wait())"
    env = {**os.environ, proof.CXX_HOLDER_WAIT_ENV: "2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "2.0", out.stderr
    env[proof.CXX_HOLDER_WAIT_ENV] = "soon"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0 and "InvalidRequestError" in out.stderr
    assert "FLATPOOL_CXX_HOLDER_WAIT_S='soon'" in out.stderr


def test_a_view_of_a_computed_base_keeps_its_gradient() -> None:
    """``(x * 2).view(-1)``, its computed base held only as ``._base``: adoption used to swap the
    view off that base, dropping ``grad_fn`` (``x.grad`` came out 1, not ``8x + 1``). The base
    now moves with it, in place, and backward matches torch's."""
    x = torch.arange(4.0, requires_grad=True)
    y = (x * 2).view(-1)
    old = StorageWeakRef(y.untyped_storage())
    report = FlatPool(device="cpu").adopt([y])
    assert report.all_released and old.expired() and report.items[0].rebound == 2
    assert y.grad_fn is not None and y.requires_grad and y._base is not None
    ((y * y).sum() + x.sum()).backward()
    assert torch.equal(x.grad, 8 * x.detach() + 1)


def test_a_view_inside_a_computed_base_is_refused_and_keeps_its_gradient() -> None:
    """``(x * 2)[1:]``: its computed base reaches bytes outside it and cannot move with it, so
    adoption refuses (it used to drop the view's ``grad_fn``), and nothing changes."""
    x = torch.arange(4.0, requires_grad=True)
    y = (x * 2)[1:]
    fn, where, offset = y.grad_fn, y.untyped_storage().data_ptr(), y.storage_offset()
    pool = FlatPool(device="cpu", capacity=1 << 12)
    with pytest.raises(InvalidRequestError,
                       match=r"view of a computed tensor \(MulBackward0\).*outside.*no_grad"):
        pool.adopt([y])
    assert y.grad_fn is fn and y.requires_grad and not pool.owns(y) and pool.used_bytes == 0
    assert y.untyped_storage().data_ptr() == where and y.storage_offset() == offset
    ((y * y).sum() + x.sum()).backward()
    assert torch.equal(x.grad, torch.tensor([1.0, 9.0, 17.0, 25.0]))


def test_a_view_of_a_leaf_base_still_moves_off_it() -> None:
    """A view of a *leaf* (HyperParallel's ``local.view(-1)``, the leaf dropped) has no history
    to lose: it is still moved off its base, into the pool."""
    pool = FlatPool(device="cpu", capacity=1 << 12)
    local = torch.nn.Parameter(torch.arange(6.0))
    flat = local.view(-1)
    old = StorageWeakRef(flat.untyped_storage())
    del local
    report = pool.adopt([flat])
    assert report.all_released and old.expired()
    assert pool.owns(flat) and flat._base is None and torch.equal(flat, torch.arange(6.0))


def test_a_view_of_a_leaf_is_adopted_and_a_computed_tensor_is_refused() -> None:
    """A view of a leaf requiring grad (``w.view(-1)``: not a leaf, its ``grad_fn`` a view
    function) moves with its base and gradients still reach the leaf; ``w * 2`` is refused."""
    pool = FlatPool(device="cpu")
    w = torch.nn.Parameter(torch.arange(8.0))
    flat = w.view(-1)
    assert not flat.is_leaf and type(flat.grad_fn).__name__ == "ViewBackward0"
    old = StorageWeakRef(w.untyped_storage())
    pool.adopt([AdoptSpec(flat, views=[w])])
    assert old.expired()
    assert pool.owns(w) and pool.owns(flat)
    assert w.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    (flat * torch.arange(8.0)).sum().backward()
    assert torch.equal(w.grad, torch.arange(8.0))
    before = pool.used_bytes
    computed = w * 2
    with pytest.raises(InvalidRequestError, match=r"not a leaf of autograd.*MulBackward0"):
        pool.adopt([computed])
    assert pool.used_bytes == before and not pool.owns(computed)
