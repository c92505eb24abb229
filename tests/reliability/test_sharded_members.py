"""FSDP2-shaped members through the one adoption pipeline.

Members are built the way FSDP2 lays them out after lazy init (:class:`.scenarios.ShardedMember`,
on a real 1-rank gloo mesh): a padded shard that is an autograd view of a base that stays
behind, a memory-less DTensor parameter over a local tensor on the shard's storage. Each spec is
what ``adopt_group`` passes: the shard, the parameter as its view, the member's attribute as its
holder. (Every line of the pipeline is interrupted in ``test_interrupts.py``, op
``adopt-sharded``.)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import flatpool.ownership._release as release
from flatpool import AdoptSpec, FlatPool, PinnedStorageError
from flatpool import _torch_compat as tc
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


@pytest.mark.parametrize("alignment", [1, 64])
def test_fsdp2_members_move_with_every_holder(single_rank_mesh: Any, alignment: int) -> None:
    """Each member moves two tensor objects (the shard, off its base; the local tensor, in
    place), the DTensor wrapper (no memory) stays; every original dies; the bindings find the
    shard through its holder and the local tensor through its wrapper."""
    members = _members(single_rank_mesh)
    shards = [m._sharded_param_data for m in members]
    locals_ = [m.sharded_param._local_tensor for m in members]
    values = [(d.clone(), loc.clone()) for d, loc in zip(shards, locals_)]
    pool = FlatPool(alignment=alignment)
    report = pool.adopt([m.spec() for m in members])
    assert report.all_released and pool.is_valid()
    assert [i.rebound for i in report.items] == [2] * len(SHAPES)
    for m, d, loc, (dv, lv) in zip(members, shards, locals_, values):
        assert m._sharded_param_data is d and m.sharded_param._local_tensor is loc
        assert pool.owns(d) and pool.owns(loc) and d._base is None
        assert torch.equal(d, dv) and torch.equal(loc, lv)
        assert m.sharded_param.requires_grad
    for s, m in zip(pool.slices(), members):
        found = [(b.current() is m._sharded_param_data, b.current() is m.sharded_param._local_tensor)
                 for b in pool.registry.bindings(s.slice_id)]
        assert found == [(True, False), (False, True)]


def _specs(pool: FlatPool, members: list[Member], given: bool) -> list[AdoptSpec]:
    """The members' specs; ``given``: each into a slice planned beforehand."""
    specs = [m.spec() for m in members]
    if not given:
        return specs
    slices = pool.allocate_many([(tuple(m._sharded_param_data.shape), torch.float32)
                                 for m in members])
    return [AdoptSpec(s.tensor, views=s.views, holders=s.holders, slice=slc)
            for s, slc in zip(specs, slices)]


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


def test_a_late_pin_rebuilds_the_dead_shards_and_their_locals(
        single_rank_mesh: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A holder the pin counts miss (blinded here) is found by the weak-reference proof after
    commit, when the other shards' originals already died: the rollback rebuilds each dead one
    from the pool's bytes, gives every swapped shard its old impl back (rebuilt where it died)
    and puts each local tensor back on its shard's storage. Identity and values come back."""
    monkeypatch.setattr(release, "storage_pinned", lambda txn, key, olds=(): False)
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


def test_real_fsdp2_members_are_adopted(single_rank_mesh: Any) -> None:
    """``adopt_group`` on FSDP2's own members after lazy init (1-rank mesh: the layout FSDP2
    makes, its DTensor parameters): every shard is released, values kept."""
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
    buffers = adopt_group(params)
    assert buffers.adopted and is_valid(buffers, params)
    assert len(buffers.buckets) == 1 and buffers.freed_bytes == sum(b.nbytes for b in before)
    for p, b in zip(params, before):
        assert torch.equal(p._sharded_param_data, b)
        assert p._sharded_param_data.untyped_storage().data_ptr() == \
            p.sharded_param._local_tensor.untyped_storage().data_ptr()


@pytest.mark.parametrize("holder", [None, "base", "storage", "alias", "old view"])
def test_the_pin_count_of_swapped_shards(single_rank_mesh: Any, holder: str | None) -> None:
    """FSDP2's shards are views of a padded base that stays behind: each move leaves an old
    impl, which the count accounts for. A healthy batch is released; any extra holder (of the
    base, the storage object, another impl on it, the old view) still pins, and is named."""
    members = _members(single_rank_mesh)
    d = members[1]._sharded_param_data
    kept: dict[str, Any] = {
        None: None, "base": d._base, "storage": d.untyped_storage(),
        "alias": None if holder != "alias" else d._base.detach(),
        "old view": None if holder != "old view" else d.view(-1),
    }[holder]
    del d
    pool = FlatPool(alignment=1)
    specs = [m.spec() for m in members]
    if holder is None:
        assert pool.adopt(specs).all_released
    else:
        with pytest.raises(PinnedStorageError, match=r"#1 Tensor"):
            pool.adopt(specs)
        assert pool.slices() == ()
    assert kept is not None or holder is None
