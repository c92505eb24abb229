"""Property: the per-step check and the diagnosis agree, on every member kind, after any move.

Groups of mixed members (HyperParallel's routed and newest DTensor, padded and empty shards, a
meta wrapper materialized by assignment, torch DTensor members whose wrapper has no memory,
plain parameters) are adopted; then some members are moved the ways frameworks and users move
them. ``is_valid`` must be true exactly when ``problems`` is empty, ``problems`` must name
exactly the moved members, and ``readopt_group`` must either bring every member back with its
current values or raise a flatpool error leaving no member worse off and every value as it was.
The pool's storage stays exactly its capacity throughout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch import nn

from flatpool import FlatPoolError
from flatpool import _torch_compat as tc
from flatpool.integrations.hsdp import adopt_group, is_valid, problems, readopt_group
from examples.hyperparallel_sim import HSDPParam, ShardMesh, dtensor_class
from flatpool.integrations.hsdp.members import has_memory, local_of
from check_contexts import CONTEXTS, context


class TorchMember:
    """An FSDP2-shaped member: padded data, a torch DTensor parameter (no memory of its own)
    whose local tensor is a ``narrow`` of the padded data (empty on a trailing rank)."""

    def __init__(self, rows: int, rank: int, mesh: Any) -> None:
        from torch.distributed.tensor import DTensor, Shard

        full = torch.randn(rows, 3)
        per = (rows + 1) // 2
        length = max(0, min(per, rows - rank * per))
        padded = full.new_zeros(per, 3)
        padded[:length] = full[rank * per: rank * per + length]
        self._sharded_param_data = padded.view(-1)
        self.padded_sharded_param_size = torch.Size((per, 3))
        self.sharded_size = torch.Size((length, 3))
        self.offload_to_cpu = False
        local = padded.narrow(0, 0, length)
        self.sharded_param = nn.Parameter(
            DTensor.from_local(local, mesh, [Shard(0)], run_check=False))


class PlainMember:
    """A plain Parameter over the whole (even) shard: the local tensor is the parameter."""

    def __init__(self) -> None:
        self._sharded_param_data = torch.randn(12)
        self.sharded_param = nn.Parameter(self._sharded_param_data.view(4, 3))
        self.sharded_size = torch.Size((4, 3))
        self.offload_to_cpu = False


def _hp(setter: str, flavor: str, rows: int, rank: int) -> HSDPParam:
    cls = dtensor_class(setter, "local")  # type: ignore[arg-type]
    return HSDPParam(nn.Linear(3, rows, bias=False), "weight", ShardMesh(None, 2, rank),
                     dtensor_cls=cls, flavor=flavor)  # type: ignore[arg-type]


def _hp_meta_wrapper() -> HSDPParam:
    """init_empty_weights, then a real ``_local_tensor`` assigned: the wrapper stays meta."""
    with torch.device("meta"):
        module = nn.Linear(3, 8, bias=False)
    p = HSDPParam(module, "weight", ShardMesh(None, 2, 1), dtensor_cls=dtensor_class("rebind", "local"))
    p.sharded_param._local_tensor = torch.randn(4, 3, requires_grad=True)  # type: ignore[attr-defined]
    p.reset_sharded_param()
    return p


KINDS: dict[str, Callable[[Any], Any]] = {
    "hp routed even": lambda mesh: _hp("routed", "even", 8, 1),
    "hp newest padded": lambda mesh: _hp("rebind", "padded", 7, 1),
    "hp routed padded, unpadded rank": lambda mesh: _hp("routed", "padded", 7, 0),
    "hp empty shard": lambda mesh: _hp("rebind", "padded", 1, 1),
    "hp meta wrapper, materialized": lambda mesh: _hp_meta_wrapper(),
    "torch DTensor padded": lambda mesh: TorchMember(7, 1, mesh),
    "torch DTensor empty shard": lambda mesh: TorchMember(1, 1, mesh),
    "plain parameter": lambda mesh: PlainMember(),
}


# ---- moves: each returns False when it does not apply to the member --------------------------
def _set_elsewhere(t: torch.Tensor, like: torch.Tensor) -> None:
    """``set_`` ``t`` onto a new storage holding ``like``'s values (one element more, so an
    empty shard's wrapper also holds memory there)."""
    flat = torch.zeros(like.numel() + 1, dtype=like.dtype)
    flat[: like.numel()] = like.detach().reshape(-1)
    with tc.no_torch_function(), torch.no_grad():
        tc.impl_set_(t, flat.untyped_storage(), 0, tuple(tc.impl_size(t)),
                     tuple(tc.impl_stride(t)))


def move_data(p: Any) -> bool:
    p._sharded_param_data = p._sharded_param_data.detach().clone()
    return True


def move_local(p: Any) -> bool:
    w = p.sharded_param
    local = local_of(w)
    if local is w:
        return False
    w._local_tensor = local.detach().clone().requires_grad_(local.requires_grad)
    return True


def local_outside_view(p: Any) -> bool:
    w = p.sharded_param
    local = local_of(w)
    if local is w:
        return False
    outside = torch.zeros(local.numel() * 2 + 1)
    outside[: local.numel()] = local.detach().reshape(-1)
    w._local_tensor = outside[: local.numel()].view(local.shape)
    return True


def wrapper_elsewhere(p: Any) -> bool:
    w = p.sharded_param
    if local_of(w) is w or not has_memory(w):
        return False
    _set_elsewhere(w, local_of(w))
    return True


def data_shifted(p: Any) -> bool:
    p._sharded_param_data = p._sharded_param_data[1:]
    return True


def reset_like(p: Any) -> bool:
    """reset_sharded_param after load_state_dict: data, local (and a wrapper with memory)
    onto one new padded storage, values kept."""
    w = p.sharded_param
    local = local_of(w)
    padded = p._sharded_param_data.detach().clone()
    rows = p.sharded_size[0] if len(p.sharded_size) else 0
    p._sharded_param_data = padded
    shape = tuple(getattr(p, "padded_sharded_param_size", p.sharded_size))
    new_local = padded.view(shape).narrow(0, 0, rows)
    if local is w:
        with tc.no_torch_function(), torch.no_grad():
            tc.impl_set_(w, padded.untyped_storage(), 0, tuple(tc.impl_size(w)),
                         tuple(tc.impl_stride(w)))
        return True
    w._local_tensor = new_local.detach().requires_grad_(local.requires_grad)
    if has_memory(w):
        with tc.no_torch_function(), torch.no_grad():
            tc.impl_set_(w, padded.untyped_storage(), 0, tuple(tc.impl_size(w)),
                         tuple(tc.impl_stride(w)))
    return True


def data_aliased_same_address(p: Any) -> bool:
    """``.data`` onto another storage over the same memory (``torch.from_numpy(t.numpy())``):
    the data pointer does not change, the StorageImpl does."""
    data = p._sharded_param_data
    data.data = torch.from_numpy(data.detach().numpy())
    return True


def local_aliased_same_address(p: Any) -> bool:
    local = local_of(p.sharded_param)
    if local is p.sharded_param or type(local) is not torch.Tensor or not local.numel():
        return False
    local.data = torch.from_numpy(local.detach().numpy())
    return True


MOVES: dict[str, Callable[[Any], bool]] = {
    "data aliased on another storage, same address": data_aliased_same_address,
    "local tensor aliased on another storage, same address": local_aliased_same_address,
    "data replaced": move_data,
    "local tensor replaced": move_local,
    "local tensor a view of another storage": local_outside_view,
    "wrapper rebound elsewhere": wrapper_elsewhere,
    "data shifted inside the pool": data_shifted,
    "whole member re-saved": reset_like,
}


def _values(ps: list[Any]) -> list[torch.Tensor]:
    with tc.no_torch_function():
        return [local_of(p.sharded_param).detach().clone() for p in ps]


def _pool_exact(buffers: Any) -> bool:
    return all(p.storage.nbytes() == p.capacity for p in buffers.pools())


@pytest.fixture(scope="module")
def mesh(single_rank_mesh: Any) -> Any:
    return single_rank_mesh


@pytest.mark.filterwarnings("ignore::flatpool.ExternalMemoryWarning")  # (the same-address aliases)
@settings(max_examples=40, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(sorted(KINDS)), min_size=1, max_size=4),
    moves=st.lists(st.sampled_from([None, *sorted(MOVES)]), min_size=4, max_size=4),
    seed=st.integers(0, 2**16),
    where=st.sampled_from(CONTEXTS),
)
def test_is_valid_agrees_with_problems_and_readopt_repairs(
        mesh: Any, kinds: list[str], moves: list[str | None], seed: int, where: str) -> None:
    torch.manual_seed(seed)
    ps = [KINDS[k](mesh) for k in kinds]
    buffers = adopt_group(ps, world_size=2)
    assert buffers.adopted and is_valid(buffers, ps) and not problems(buffers, ps)
    assert _pool_exact(buffers)

    moved = set()
    for i, (p, move) in enumerate(zip(ps, moves)):
        if move is not None and MOVES[move](p):
            moved.add(i)
    with context(where):
        found = problems(buffers, ps)
        valid = is_valid(buffers, ps)
    assert valid == (not found), found
    assert set(found) == moved, (found, moved, kinds, moves)
    assert _pool_exact(buffers)

    before = _values(ps)
    try:
        count = readopt_group(buffers, ps)
    except FlatPoolError as exc:
        event(f"readopt refused: {type(exc).__name__}")
        # Refused: no member got worse (a step that went through stays), values unchanged.
        left = problems(buffers, ps)
        assert set(left) <= moved and is_valid(buffers, ps) == (not left)
    else:
        event(f"readopt brought {len(moved)} member(s) back")
        assert count == len(moved)
        assert is_valid(buffers, ps) and not problems(buffers, ps), problems(buffers, ps)
        assert readopt_group(buffers, ps) == 0
    for a, b in zip(before, _values(ps)):
        assert torch.equal(a, b)
    assert _pool_exact(buffers)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("move", ["whole member re-saved", "data replaced",
                                  "local tensor replaced"])
def test_the_framework_moves_are_repaired(mesh: Any, kind: str, move: str) -> None:
    """What frameworks actually do (re-save a member, replace its data or local tensor) is
    always brought back, values kept, for every member kind."""
    torch.manual_seed(0)
    ps = [KINDS[kind](mesh), KINDS[kind](mesh)]
    buffers = adopt_group(ps, world_size=2)
    if not MOVES[move](ps[1]):
        pytest.skip(f"{move} does not apply to {kind}")
    assert not is_valid(buffers, ps) and list(problems(buffers, ps)) == [1]
    before = _values(ps)
    assert readopt_group(buffers, ps) == 1
    assert is_valid(buffers, ps) and not problems(buffers, ps)
    assert all(torch.equal(a, b) for a, b in zip(before, _values(ps)))
    assert _pool_exact(buffers)


@pytest.mark.parametrize("where", CONTEXTS)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_shrunk_pool_storage_is_reported_never_read(mesh: Any, kind: str, where: str) -> None:
    """A member's storage (the pool's) shrunk through it: every member whose slice lies past
    the new end is named, the group is not valid, and re-adoption refuses with a typed error
    instead of reading freed bytes."""
    torch.manual_seed(0)
    ps = [KINDS[kind](mesh) for _ in range(3)]
    buffers = adopt_group(ps, world_size=2)
    layouts = [m for b in buffers.buckets for m in b.members if m.slice is not None]
    if len(layouts) < 2:
        pytest.skip(f"{kind}: fewer than two members with bytes")
    keep = layouts[1].slice.offset
    ps[0]._sharded_param_data.untyped_storage().resize_(keep)
    past = {m.index for m in layouts if m.slice.end > keep}
    with context(where):
        found = problems(buffers, ps)
        valid = is_valid(buffers, ps)
    assert not valid and set(found) == past, found
    with pytest.raises(FlatPoolError):
        readopt_group(buffers, ps)
    assert not is_valid(buffers, ps)
