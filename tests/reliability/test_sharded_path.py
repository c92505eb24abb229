"""The lean path for sharded parameters (:mod:`flatpool.ownership.sharded`) against the general one.

Members are built the way FSDP2 lays them out after lazy init (:class:`.scenarios.ShardedMember`,
on a real 1-rank gloo mesh). Each spec is what ``adopt_group`` passes: the shard, the parameter
as its view, the member's attribute as its holder. (Every line of the path is interrupted in
``test_interrupts.py``, op ``adopt-sharded``.)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import flatpool.ownership.adopt as adopt_mod
import flatpool.ownership.sharded as sharded_mod
from flatpool import AdoptSpec, FlatPool, FlatPoolError, InvalidRequestError, PinnedStorageError
from flatpool import torch_compat as tc
from flatpool.ownership.sharded import SpecColumns, is_sharded_batch
from flatpool.testing import FailAt, set_fault_hook

from .scenarios import ShardedMember as Member

SHAPES = [(3, 3, 4), (5, 6, 2), (0, 2, 7), (4, 4, 1)]  # (rows, padded rows, cols); one empty


def _members(mesh: Any) -> list[Member]:
    return [Member(r, p, c, start=100.0 * i, mesh=mesh) for i, (r, p, c) in enumerate(SHAPES)]


def _state(m: Member) -> tuple[Any, ...]:
    d, w = m._sharded_param_data, m.sharded_param
    local = w._local_tensor
    return (tc.storage_address(d), d.storage_offset(), tuple(d.shape), d.stride(), d._version,
            d._base is None, tc.storage_address(local), local.storage_offset(),
            tuple(local.shape), local.stride(), local._version, local._base is None,
            d.clone(), local.clone())


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


def test_fsdp2_members_take_the_sharded_path(single_rank_mesh: Any,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    members = _members(single_rank_mesh)
    specs = [m.spec() for m in members]
    assert is_sharded_batch(specs)
    calls: list[str] = []
    monkeypatch.setattr(adopt_mod, "_adopt", lambda *a, **k: calls.append("general"))
    pool = FlatPool(alignment=1)
    report = pool.adopt(specs)
    assert calls == [] and report.all_released and pool.is_valid()
    for m in members:
        assert pool.owns(m._sharded_param_data) and pool.owns(m.sharded_param._local_tensor)


def _specs(pool: FlatPool, members: list[Member], given: bool) -> list[AdoptSpec]:
    """The members' specs; ``given``: each into a slice planned beforehand."""
    specs = [m.spec() for m in members]
    if not given:
        return specs
    slices = pool.allocate_many([(tuple(m._sharded_param_data.shape), torch.float32)
                                 for m in members])
    return [AdoptSpec(s.tensor, views=s.views, holders=s.holders, slice=slc)
            for s, slc in zip(specs, slices)]


def _columns(specs: list[AdoptSpec]) -> SpecColumns:
    """The batch as a fusion group hands it over: columns, the member the shard's holder."""
    return SpecColumns([s.tensor for s in specs], [s.views[0] for s in specs],
                       [s.holders[0].owner for s in specs], "_sharded_param_data",
                       [s.slice for s in specs])


@pytest.mark.parametrize("form", ["specs", "columns", "columns, records member by member"])
@pytest.mark.parametrize("given", [False, True], ids=["allocated", "into-planned-slices"])
@pytest.mark.parametrize("alignment", [1, 64])
def test_sharded_and_general_paths_agree(single_rank_mesh: Any, monkeypatch: pytest.MonkeyPatch,
                                         alignment: int, given: bool, form: str) -> None:
    def run(members: list[Member], lean: bool = False) -> tuple[FlatPool, Any]:
        pool = FlatPool(alignment=alignment)
        specs = _specs(pool, members, given)
        if lean and form != "specs":
            return pool, adopt_mod.adopt(pool, _columns(specs))
        return pool, pool.adopt(specs)

    lean, general = _members(single_rank_mesh), _members(single_rank_mesh)
    with monkeypatch.context() as mp:
        if form == "columns, records member by member":  # (as for references of mixed kinds)
            mp.setattr(sharded_mod, "_refs_of", lambda ts: None)
        p1, r1 = run(lean, lean=True)
    with monkeypatch.context() as mp:
        mp.setattr(adopt_mod, "sharded_specs", lambda targets: None)  # the general path
        p2, r2 = run(general)
    assert p1.describe().splitlines()[1:] == p2.describe().splitlines()[1:]
    assert [(i.slice.offset, i.original_nbytes, i.released, i.rebound, i.pinned_by)
            for i in r1.items] == [(i.slice.offset, i.original_nbytes, i.released, i.rebound,
                                    i.pinned_by) for i in r2.items]
    assert [i.rebound for i in r1.items] == [2] * len(SHAPES)
    assert torch.equal(p1.flat(torch.uint8), p2.flat(torch.uint8)) or all(
        torch.equal(a.bytes(), b.bytes()) for a, b in zip(p1.slices(), p2.slices()))
    for a, b in zip(lean, general):
        sa, sb = _state(a), _state(b)
        assert _same(sa[1:6] + sa[7:], sb[1:6] + sb[7:])  # all but the pools' addresses
        assert a.sharded_param.requires_grad and b.sharded_param.requires_grad
    for s1, s2 in zip(p1.slices(), p2.slices()):
        recs1, recs2 = p1.registry.records(s1.slice_id), p2.registry.records(s2.slice_id)
        assert [r[1:5] + r[6:] for r in recs1] == [r[1:5] + r[6:] for r in recs2]
        # the same kind of reference (weak, or a ParamRef for a parameter) to each object
        assert [(type(r[0]), type(r[5])) for r in recs1] == [(type(r[0]), type(r[5]))
                                                             for r in recs2]
    which = [[(r[0]() is m._sharded_param_data, r[0]() is m.sharded_param._local_tensor,
               r[5]() is m or r[5]() is m.sharded_param)
              for r in p.registry.records(s.slice_id)]
             for p, ms in ((p1, lean), (p2, general)) for s, m in zip(p.slices(), ms)]
    assert which[:len(SHAPES)] == which[len(SHAPES):]
    assert p1.is_valid() and p2.is_valid()


@pytest.mark.parametrize("exc_type", [RuntimeError, KeyboardInterrupt], ids=["error", "ctrl-c"])
@pytest.mark.parametrize("given", [False, True], ids=["allocated", "into-planned-slices"])
def test_a_fault_at_every_checkpoint_rolls_back(single_rank_mesh: Any, given: bool,
                                                exc_type: type[BaseException]) -> None:
    k = 0
    while True:
        members = _members(single_rank_mesh)
        pool = FlatPool(alignment=1)
        specs = _specs(pool, members, given)
        locals_ = [m.sharded_param._local_tensor for m in members]
        before = [_state(m) for m in members]
        live = len(pool.slices())
        hook = FailAt(k, exc_type)
        set_fault_hook(hook)
        try:
            report = pool.adopt(specs)
        except exc_type as exc:
            assert str(exc).startswith("injected"), exc
        else:
            set_fault_hook(None)
            assert report.all_released and pool.is_valid()
            break
        finally:
            set_fault_hook(None)
        for m, local, st in zip(members, locals_, before):
            assert m.sharded_param._local_tensor is local
            assert _same(_state(m), st), (k, hook.steps[-1])
        assert not pool.is_materialized and len(pool.slices()) == live
        assert all(not pool.registry.holds(s.slice_id) for s in pool.slices())
        report = pool.adopt(specs)  # the same adoption succeeds after the rollback
        assert report.all_released and pool.is_valid()
        k += 1
    assert k >= 4, hook.steps


def test_a_pinned_shard_rolls_back_naming_its_holder(single_rank_mesh: Any) -> None:
    members = _members(single_rank_mesh)
    held = members[1]._sharded_param_data._base  # what a user might keep: the padded tensor
    before = [_state(m) for m in members]
    pool = FlatPool(alignment=1)
    with pytest.raises(PinnedStorageError, match=r"#1 Tensor"):
        pool.adopt([m.spec() for m in members])
    assert all(_same(_state(m), st) for m, st in zip(members, before))
    with pytest.warns(Warning, match="still referenced"):
        report = pool.adopt([m.spec() for m in members], on_pinned="warn")
    assert [bool(i.pinned_by) for i in report.items] == [False, True, False, False]
    assert pool.is_valid() and held is not None


@pytest.mark.parametrize("bad", ["not held", "plain view", "not a tensor"])
def test_columns_that_need_the_general_path_get_its_verdict(single_rank_mesh: Any,
                                                            bad: str) -> None:
    """Columns the lean path cannot take go to the general path as specs, which decides as for
    any call: a holder that does not hold its shard, a plain view that leaves the parameter's
    local tensor on the original (a pin), a non-tensor shard are refused with their typed
    errors, and nothing changed."""
    members = _members(single_rank_mesh)
    cols = _columns([m.spec() for m in members])
    if bad == "not held":
        members[1]._sharded_param_data = torch.zeros(1)  # the place holds something else now
    elif bad == "plain view":
        cols.wrappers[2] = cols.tensors[2][:0]
    else:
        cols.tensors[0] = "shard"  # type: ignore[call-overload]
    before = [_state(m) for m in members]
    pool = FlatPool(alignment=1)
    calls: list[str] = []
    real = adopt_mod._adopt

    def general(*a: Any, **k: Any) -> Any:
        calls.append("general")
        return real(*a, **k)

    import unittest.mock
    with unittest.mock.patch.object(adopt_mod, "_adopt", general):
        with pytest.raises(FlatPoolError, match={
                "not held": "does not hold a tensor on its storage",
                "plain view": "still referenced", "not a tensor": "tensor"}[bad]):
            adopt_mod.adopt(pool, cols)
    # (a non-tensor is refused as the specs are built, by AdoptSpec's own validation)
    assert calls == ([] if bad == "not a tensor" else ["general"])
    assert all(_same(_state(m), st) for m, st in zip(members, before))
    assert pool.slices() == ()


def test_ragged_columns_are_refused_before_anything_is_read() -> None:
    """Columns of unequal lengths would pair members wrongly (or drop some): refused at once."""
    t = torch.zeros(4)
    with pytest.raises(InvalidRequestError, match="one of each per member"):
        SpecColumns([t, t.clone()], [t], None, "_sharded_param_data", [None, None])
    with pytest.raises(InvalidRequestError, match="2 owners"):
        SpecColumns([t], [t], [object(), object()], "_sharded_param_data", [None])


def test_a_late_pin_rebuilds_the_dead_shards_and_their_locals(
        single_rank_mesh: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A holder the pin counts miss (blinded here) is found by the weak-reference proof after
    commit, when the other shards' originals already died: the rollback rebuilds each dead one
    from the pool's bytes, gives every swapped shard its old impl back (rebuilt where it died)
    and puts each local tensor back on its shard's storage. Identity and values come back."""
    import flatpool.ownership.settle as settle

    monkeypatch.setattr(settle, "swapped_held_once", lambda txn, olds: True)
    monkeypatch.setattr(settle, "storage_pinned", lambda txn, key, olds=None: False)
    members = _members(single_rank_mesh)
    shards = [m._sharded_param_data for m in members]
    locals_ = [m.sharded_param._local_tensor for m in members]
    values = [(d.clone(), loc.clone()) for d, loc in zip(shards, locals_)]
    kept_key = tc.storage_address(shards[1])
    also = shards[1].detach()  # a second tensor on one original, named by nothing above
    pool = FlatPool(alignment=1)
    with pytest.raises(PinnedStorageError, match="also"):
        pool.adopt([m.spec() for m in members])
    for m, d, loc, (dv, lv) in zip(members, shards, locals_, values):
        assert m._sharded_param_data is d and m.sharded_param._local_tensor is loc
        assert torch.equal(d, dv) and torch.equal(loc, lv) and not pool.owns(d)
        assert tc.storage_address(loc) == tc.storage_address(d)  # the local on its shard's
    assert tc.storage_address(shards[1]) == kept_key == tc.storage_address(also)
    assert pool.slices() == ()
    del also
    monkeypatch.undo()
    report = pool.adopt([m.spec() for m in members])  # and the retry adopts everything
    assert report.all_released and pool.is_valid()


def test_real_fsdp2_members_take_the_sharded_path(single_rank_mesh: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``adopt_group`` on FSDP2's own members after lazy init (1-rank mesh: the layout FSDP2
    makes, its DTensor parameters) never reaches the general path; every shard is released."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from flatpool.integrations.hsdp import adopt_group, is_valid
    from flatpool.integrations.hsdp.fsdp2 import fsdp_param_groups, lazy_init

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    fully_shard(model, mesh=single_rank_mesh)
    lazy_init(model)
    params = next(iter(fsdp_param_groups(model))).fsdp_params
    before = [p._sharded_param_data.clone() for p in params]
    calls: list[str] = []
    monkeypatch.setattr(adopt_mod, "_adopt", lambda *a, **k: calls.append("general"))
    buffers = adopt_group(params)
    assert calls == [] and buffers.adopted and is_valid(buffers, params)
    assert len(buffers.buckets) == 1 and buffers.freed_bytes == sum(b.nbytes for b in before)
    for p, b in zip(params, before):
        assert torch.equal(p._sharded_param_data, b)
        assert p._sharded_param_data.untyped_storage().data_ptr() == \
            p.sharded_param._local_tensor.untyped_storage().data_ptr()


@pytest.mark.parametrize("holder", [None, "base", "storage", "alias", "old view"])
def test_the_pin_count_of_swapped_shards(single_rank_mesh: Any, monkeypatch: pytest.MonkeyPatch,
                                         holder: str | None) -> None:
    """FSDP2's shards are views of a padded base that stays behind: each move leaves an old
    impl. A healthy batch is cleared by the C-level count (no per-original count runs); any
    extra holder (of the base, the storage object, another impl on it, the old view) still
    pins, through the per-original count that names it."""
    import flatpool.ownership.settle as settle

    members = _members(single_rank_mesh)
    d = members[1]._sharded_param_data
    kept: dict[str, Any] = {
        None: None, "base": d._base, "storage": d.untyped_storage(),
        "alias": None if holder != "alias" else d._base.detach(),
        "old view": None if holder != "old view" else d.view(-1),
    }[holder]
    del d
    counted: list[int] = []
    real = settle.storage_pinned
    monkeypatch.setattr(settle, "storage_pinned", lambda *a: counted.append(1) or real(*a))
    pool = FlatPool(alignment=1)
    specs = [m.spec() for m in members]
    if holder is None:
        assert pool.adopt(specs).all_released and counted == []
    else:
        with pytest.raises(PinnedStorageError, match=r"#1 Tensor"):
            pool.adopt(specs)
        assert counted and pool.slices() == ()
    assert kept is not None or holder is None
