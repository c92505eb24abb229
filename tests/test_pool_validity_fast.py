"""``FlatPool.is_valid()``'s fast path (``flatpool.ownership.quickcheck``): taken while nothing
changed, never answering for a binding that moved, reshaped, changed dtype, died or was
replaced in its holder, nor after the registry or the storage changed. Every test runs with the
vectorized impl read and with it off (what a torch whose layout the probe does not know gets).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from flatpool import AdoptSpec, FlatPool, Holder
from flatpool import torch_compat as tc
from flatpool.ownership.quickcheck import still_in_place
from vectorized_reads import READS, choose_reads


@pytest.fixture(params=READS, autouse=True)
def reads(request: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    return choose_reads(request.param, monkeypatch)


def _set(t: torch.Tensor, storage: torch.UntypedStorage, offset: int,
         size: tuple[int, ...], stride: tuple[int, ...]) -> None:
    with tc.no_torch_function(), torch.no_grad():
        tc.impl_set_(t, storage, offset, size, stride)


def _plain() -> tuple[FlatPool, list[torch.Tensor], Any]:
    ts = [torch.randn(4, 3) for _ in range(4)]
    pool = FlatPool("cpu")
    pool.adopt(ts)
    return pool, ts, None


def _module() -> tuple[FlatPool, list[torch.Tensor], Any]:
    """Parameters found through their module (attribute holders) and a dict (an item)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    box = {"k": torch.randn(4, 3)}
    specs = [AdoptSpec(getattr(m, name), holders=[Holder(m, name)])
             for m in model for name in ("weight", "bias")]
    pool = FlatPool("cpu")
    pool.adopt([*specs, AdoptSpec(box["k"], holders=[Holder(box, "k", item=True)])])
    return pool, [*model.parameters(), box["k"]], model


def _unheld() -> tuple[FlatPool, list[torch.Tensor], Any]:
    """Parameters adopted without holders (``ParamRef`` bindings: the vectorized read finds
    them through the references' slot word, not by calling them)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    pool = FlatPool("cpu")
    pool.adopt(list(model.parameters()))
    _UNHELD.add(model)
    return pool, list(model.parameters()), model


_UNHELD: weakref.WeakSet[nn.Module] = weakref.WeakSet()


SETUPS: dict[str, Callable[[], tuple[FlatPool, list[torch.Tensor], Any]]] = {
    "plain tensors": _plain, "module parameters": _module, "unheld parameters": _unheld}


def _moved_elsewhere(ts: list[torch.Tensor], model: Any) -> None:
    t = ts[1]
    _set(t, t.detach().clone().untyped_storage(), 0, tuple(t.shape), tuple(t.stride()))


def _shifted(ts: list[torch.Tensor], model: Any) -> None:
    t = ts[1]
    _set(t, t.untyped_storage(), t.storage_offset() + 1, (t.numel() - 1,), (1,))


def _reshaped(ts: list[torch.Tensor], model: Any) -> None:
    t = ts[0]
    n = t.numel()
    _set(t, t.untyped_storage(), t.storage_offset(), (n,), (1,))  # same pointer


def _transposed(ts: list[torch.Tensor], model: Any) -> None:
    t = ts[0]
    _set(t, t.untyped_storage(), t.storage_offset(), tuple(t.shape), (1, t.shape[0]))


def _other_dtype(ts: list[torch.Tensor], model: Any) -> None:
    t = ts[-1]  # (a parameter's data must stay floating point while it requires grad)
    t.requires_grad_(False)
    with torch.no_grad():
        t.data = t.data.view(torch.int32)  # same bytes, pointer, shape and stride


def _replaced_in_holder(ts: list[torch.Tensor], model: Any) -> None:
    if model is None:
        pytest.skip("plain tensors have no holder")
    if model in _UNHELD:
        pytest.skip("unheld: the old parameter stays in place (test_parameters_their_model_dropped)")
    model[0].weight = nn.Parameter(model[0].weight.detach().clone())


def _copy_same_place(ts: list[torch.Tensor], model: Any) -> None:
    t = ts[1]  # a copy of the pool's storage, same offset, shape, stride, dtype
    _set(t, t.untyped_storage().clone(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def _one_further(ts: list[torch.Tensor], model: Any) -> None:
    t = ts[1]  # same storage, shape, stride, dtype; one element further
    _set(t, t.untyped_storage(), t.storage_offset() + 1, tuple(t.shape), tuple(t.stride()))


def _other_shape(ts: list[torch.Tensor], model: Any) -> None:
    t = ts[0]  # same storage, offset, dimension count, dtype: (4, 3) read as (3, 4)
    _set(t, t.untyped_storage(), t.storage_offset(), (3, 4), (4, 1))


def _swapped_out(ts: list[torch.Tensor], model: Any) -> None:
    if model is None:  # plain tensors are held by a TensorRef, not a weak reference (issue 20)
        t = ts[1]
        torch.utils.swap_tensors(t, torch.zeros_like(t))
        return
    t = model[1].bias
    torch.utils.swap_tensors(t, nn.Parameter(torch.zeros_like(t.detach())))


CHANGES = {"copied storage, same place": _copy_same_place, "one element further": _one_further,
           "other shape, same dims": _other_shape, "swap_tensors out": _swapped_out,
           "moved elsewhere": _moved_elsewhere, "shifted in the pool": _shifted,
           "reshaped in place": _reshaped, "restrided in place": _transposed,
           "other dtype, same bytes": _other_dtype, "replaced in its holder": _replaced_in_holder}


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_a_healthy_pool_is_answered_from_the_arrays(setup: str, reads: str) -> None:
    pool, ts, _ = SETUPS[setup]()
    assert still_in_place(pool) is None  # nothing remembered before a full check
    assert pool.is_valid()
    assert still_in_place(pool) is True
    from flatpool.ownership.quickcheck import _kept
    kept = _kept[pool._state if hasattr(pool, "_state") else pool]
    assert (kept.raw is not None) == (reads == "vectorized")
    # Bindings without a holder are read through their references' slot (plain tensors' too)
    assert (kept.slotted is not None) == (reads == "vectorized" and setup != "module parameters")
    with torch.no_grad():
        for t in ts:
            t.add_(1)  # values change in place: still valid, still fast
    assert still_in_place(pool) is True and pool.is_valid()


@pytest.mark.parametrize("setup", sorted(SETUPS))
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_no_change_passes_the_fast_path(setup: str, change: str) -> None:
    pool, ts, model = SETUPS[setup]()
    assert pool.is_valid() and still_in_place(pool)
    CHANGES[change](ts, model)
    assert still_in_place(pool) is None
    assert not pool.is_valid() and pool.moved()


def test_a_dead_tensor_keeps_the_fast_path_after_one_full_check() -> None:
    pool, ts, _ = _plain()
    assert pool.is_valid()
    del ts[2]
    assert still_in_place(pool) is None  # its reference died: the lists are stale
    assert pool.is_valid() and still_in_place(pool) is True


def test_registry_and_storage_changes_are_rechecked() -> None:
    pool, ts, _ = _plain()
    assert pool.is_valid()
    pool.grow(pool.capacity + 1024)  # a new storage: every pointer changed
    assert still_in_place(pool) is None and pool.is_valid() and still_in_place(pool)
    extra = torch.randn(5)
    pool.adopt([extra])  # a registry change
    assert still_in_place(pool) is None and pool.is_valid() and still_in_place(pool)
    _set(extra, torch.zeros(5).untyped_storage(), 0, (5,), (1,))
    assert still_in_place(pool) is None and not pool.is_valid()


def test_the_probe_refuses_a_layout_that_reads_wrong() -> None:
    """The layout found at import reads fresh tensors as the public readers do; the same
    layout one word off anywhere does not (a probe that found it would switch the reads off)."""
    import attrs

    layout = tc._probe_layout()  # (probed again: the fixture may have switched the reads off)
    assert layout is not None and tc._layout_reads_right(layout)
    for field in ("py_impl", "storage", "offset", "dim", "flags"):
        wrong = attrs.evolve(layout, **{field: getattr(layout, field) + 1})
        assert not tc._layout_reads_right(wrong), field


def test_parameters_their_model_dropped_go_to_the_full_check() -> None:
    """Parameters adopted without holders are referenced strongly but read as gone once their
    model lets go (``load_state_dict(assign=True)``): the fast path must not answer for them
    (it did, when it read the reference's object without calling it)."""
    m = nn.Linear(4, 3)
    pool = FlatPool("cpu")
    pool.adopt(list(m.parameters()))
    assert pool.is_valid() and still_in_place(pool) is True
    m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, assign=True)
    assert still_in_place(pool) is None
    assert not pool.is_valid()


@pytest.mark.parametrize("view", (False, True), ids=("alone", "a view shares the impl"))
def test_parameters_liveness_read_at_once_matches_their_references(
        reads: str, view: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The vectorized read decides every unheld parameter's liveness from reference counts,
    exactly as its ``ParamRef`` would (torch's preserved reference counted while a view shares
    the impl): a parameter its model still holds stays on the fast path, with no reference
    called; one its model dropped is never answered for, and the full check drops it."""
    from flatpool.registry import ParamRef

    models = [nn.Linear(3, 2) for _ in range(3)]
    pool = FlatPool("cpu")
    pool.adopt([p for m in models for p in m.parameters()])
    views = [p.view(-1) for m in models for p in m.parameters()] if view else []
    assert all((tc.tensor_impl_users(p) > 1) == view for m in models for p in m.parameters())
    assert pool.is_valid()
    calls: list[int] = []
    called = ParamRef.__call__

    def counting(self: ParamRef) -> torch.Tensor | None:
        calls.append(1)
        return called(self)

    monkeypatch.setattr(ParamRef, "__call__", counting)
    assert still_in_place(pool) is True
    assert (not calls) if reads == "vectorized" else calls  # no call per parameter
    dropped = models[1].weight
    del dropped
    models[1].weight = nn.Parameter(torch.randn(2, 3))  # the model lets its weight go
    calls.clear()
    assert still_in_place(pool) is None
    assert (not calls) if reads == "vectorized" else calls  # the counts said it is dropped
    assert not pool.is_valid()
    assert still_in_place(pool) is None  # (its reference let go: the slot reads empty now)
    del views


def test_without_count_words_the_vectorized_read_calls_the_references(
        reads: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch or Python whose count words the probe did not find: the parameters' references
    are called (and still decide) while the impl words are read as before."""
    monkeypatch.setattr(tc, "USE_COUNT_WORD", None)
    answers: list[bool | None] = []
    unchanged = tc.impl_unchanged

    def spying(*args: Any) -> bool | None:
        answers.append(unchanged(*args))
        return answers[-1]

    monkeypatch.setattr(tc, "impl_unchanged", spying)
    m = nn.Linear(3, 2)
    pool = FlatPool("cpu")
    pool.adopt(list(m.parameters()))
    assert pool.is_valid() and still_in_place(pool) is True
    assert answers == ([True] if reads == "vectorized" else [])  # the impl words still read
    m.weight = nn.Parameter(torch.randn(2, 3))
    assert still_in_place(pool) is None and not pool.is_valid()


def test_a_change_of_the_live_slices_is_rechecked() -> None:
    """The lists key on the pool's live-slices version (one compare, not one per slice): any
    change of the live handles, even one no binding needed, sends one check to the full rules,
    which remember again; freeing a bound slice's handle away is never answered from them."""
    pool, ts, _ = _plain()
    pool.grow(pool.capacity + 4096)  # (room for a spare slice)
    assert pool.is_valid() and still_in_place(pool) is True
    spare = pool.allocate((8,), torch.float32)
    assert still_in_place(pool) is None and pool.is_valid() and still_in_place(pool) is True
    pool.free(spare)
    assert still_in_place(pool) is None and pool.is_valid() and still_in_place(pool) is True
    snap = pool.capture()
    victim = pool.slice_of(ts[0])
    assert victim is not None
    pool.disown(victim)
    pool.free(victim)
    assert still_in_place(pool) is None
    pool.restore(snap)
    pool.forget(snap)
    assert still_in_place(pool) is None and pool.is_valid() and still_in_place(pool) is True


def test_the_slot_probe_finds_the_parameter_reference_word(reads: str) -> None:
    """The word the vectorized read follows to each unheld parameter is the one its
    ``ParamRef`` keeps it in (read back on a live reference); a class without that slot, or a
    name that is no slot, gives none (the read then calls the references), as do reads off."""
    from flatpool.ownership.quickcheck import _SLOT
    from flatpool.registry import ParamRef

    if reads == "per field":
        assert tc.slot_word(ParamRef, "_obj") is None
        return
    assert _SLOT is not None and tc.slot_word(ParamRef, "_obj") == _SLOT
    p = nn.Parameter(torch.randn(3))
    ref = ParamRef(p)
    assert tc._words_at(id(ref), _SLOT + 1)[_SLOT] == id(p)

    class Plain:
        pass

    assert tc.slot_word(Plain, "x") is None and tc.slot_word(ParamRef, "other") is None
