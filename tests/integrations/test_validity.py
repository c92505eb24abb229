"""The per-step pointer check (``is_valid``) agrees with the storage-identity diagnosis
(``problems``) on every way a member can leave its slice; no process group needed."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from flatpool.integrations.hsdp.group import adopt_group
from flatpool.integrations.hsdp.validity import is_valid, problems, readopt_group

sys.path.insert(0, str(Path(__file__).parent))
from hp_double import HPParam  # noqa: E402


def _group(n: int = 4) -> tuple[list[HPParam], object]:
    torch.manual_seed(0)
    # Rank 1 of 2 over 7 rows: a padded shard whose local tensor is a narrow view.
    params = [HPParam(torch.randn(7, 3), rank=1, world=2) for _ in range(n)]
    buffers = adopt_group(params, world_size=2)  # type: ignore[arg-type]
    assert buffers.adopted
    return params, buffers


def _move_data(p: HPParam) -> None:
    p._sharded_param_data = p._sharded_param_data.clone()


def _move_local(p: HPParam) -> None:
    local = p.sharded_param._local_tensor  # type: ignore[attr-defined]
    p.sharded_param._local_tensor = local.clone()  # type: ignore[attr-defined]


def _local_view_of_outside(p: HPParam) -> None:
    local = p.sharded_param._local_tensor  # type: ignore[attr-defined]
    outside = torch.zeros(local.numel() * 2)
    p.sharded_param._local_tensor = outside[: local.numel()].view_as(local)  # type: ignore[attr-defined]


def _move_wrapper(p: HPParam) -> None:
    with torch.no_grad():
        p.sharded_param.data = p.sharded_param.detach().clone()


def _shift_data(p: HPParam) -> None:
    p._sharded_param_data = p._sharded_param_data[1:]


MOVES: dict[str, Callable[[HPParam], None]] = {
    "data replaced": _move_data,
    "local replaced": _move_local,
    "local is a view of another storage": _local_view_of_outside,
    "wrapper rebound elsewhere": _move_wrapper,
    "data shifted inside the pool": _shift_data,
}


def test_valid_after_adoption() -> None:
    params, buffers = _group()
    assert is_valid(buffers, params) and not problems(buffers, params)  # type: ignore[arg-type]


@pytest.mark.parametrize("move", sorted(MOVES))
@pytest.mark.parametrize("which", [0, 3])
def test_every_member_is_checked(move: str, which: int) -> None:
    params, buffers = _group()
    MOVES[move](params[which])
    assert not is_valid(buffers, params)  # type: ignore[arg-type]
    found = problems(buffers, params)  # type: ignore[arg-type]
    assert list(found) == [which], found


def test_readopt_restores_validity_with_the_new_values() -> None:
    params, buffers = _group()
    p = params[2]
    fresh = torch.full_like(p._sharded_param_data, 7.0)
    p._sharded_param_data = fresh
    p.sharded_param._local_tensor = fresh.view(p.padded_sharded_param_size).narrow(  # type: ignore[attr-defined]
        0, 0, p.sharded_size[0]
    )
    with torch.no_grad():
        p.sharded_param.set_(fresh.untyped_storage(), 0, p.sharded_size, (3, 1))
    assert not is_valid(buffers, params)  # type: ignore[arg-type]
    assert readopt_group(buffers, params) == 1  # type: ignore[arg-type]
    assert is_valid(buffers, params)  # type: ignore[arg-type]
    assert torch.equal(p._sharded_param_data, torch.full_like(fresh, 7.0))
    assert readopt_group(buffers, params) == 0  # type: ignore[arg-type]


def test_freed_pool_slice_is_invalid() -> None:
    params, buffers = _group()
    bucket = buffers.buckets[0]  # type: ignore[attr-defined]
    slc = bucket.members[1].slice
    bucket.pool.disown(slc)
    bucket.pool.free(slc)
    assert not is_valid(buffers, params)  # type: ignore[arg-type]
    assert 1 in problems(buffers, params)  # type: ignore[arg-type]


def test_failed_bucket_undoes_the_buckets_before_it() -> None:
    """adopt_group is all-or-nothing across dtype buckets: when a later bucket's adoption is
    refused (a pinned original), the one transaction that covers every bucket's pool puts every
    member back on its very storage, with its values, and no member is left in a pool."""
    from flatpool import PinnedStorageError, live_pools

    torch.manual_seed(0)
    fp32 = [HPParam(torch.randn(7, 3), rank=1, world=2) for _ in range(2)]
    bf16 = [HPParam(torch.randn(7, 3).to(torch.bfloat16), rank=1, world=2) for _ in range(2)]
    params = fp32 + bf16
    before = [p._sharded_param_data.clone() for p in params]
    keys = [p._sharded_param_data.untyped_storage()._cdata for p in params]
    wrappers = [p.sharded_param for p in params]
    hidden = bf16[1]._sharded_param_data[:2]  # an unnamed view pins the second bucket
    with pytest.raises(PinnedStorageError):
        adopt_group(params, world_size=2)  # type: ignore[arg-type]
    pools = live_pools()
    for p, b, w in zip(params, before, wrappers):
        assert p.sharded_param is w
        assert torch.equal(p._sharded_param_data, b)
        assert torch.equal(p.sharded_param.detach().reshape(-1), b[: p.sharded_param.numel()])
        assert not any(pool.owns(p._sharded_param_data) for pool in pools)
        assert not any(pool.owns(p.sharded_param._local_tensor) for pool in pools)  # type: ignore[attr-defined]
    assert [p._sharded_param_data.untyped_storage()._cdata for p in params] == keys
    del hidden
