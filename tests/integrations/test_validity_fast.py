"""The per-step check's fast path (``quickcheck``): taken on a healthy group, never passes a move.

``is_valid`` answers from arrays of what the full rules read when they last passed. These tests
hold it to the full rules: on every member kind the arrays are kept once the rules pass, the
fast answer is ``True`` while nothing changed, and after every move the property test knows
(and a few it cannot make: a reshape in place, an empty shard moved to another storage, a freed
slice, a relocated pool, a parameter object replaced) the fast path does not answer and
``is_valid`` agrees with ``problems``. Every test runs twice: with the vectorized impl read
(:func:`flatpool.torch_compat.impl_unchanged`, what answers on a healthy group) and with it
switched off (the per-field lists, what a torch whose layout the probe does not know gets).
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import pytest
import torch
from test_validity_properties import KINDS, MOVES  # noqa: E402
from torch import nn

from flatpool import torch_compat as tc
from flatpool.integrations.hsdp import adopt_group, is_valid, problems
from flatpool.integrations.hsdp.members import local_of
from flatpool.integrations.hsdp.quickcheck import still_valid
from vectorized_reads import READS, choose_reads

BROKEN = {"hp meta wrapper, materialized"}
"""Kinds adoption refuses on this branch (not this module's concern): checked when they adopt."""


@pytest.fixture(params=READS, autouse=True)
def reads(request: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run each test on both readers; the vectorized one must really be in use."""
    return choose_reads(request.param, monkeypatch)


@pytest.fixture(scope="module")
def mesh(single_rank_mesh: Any) -> Any:
    return single_rank_mesh


def _group(mesh: Any, kind: str, n: int = 3) -> tuple[Any, list[Any]]:
    torch.manual_seed(0)
    ps = [KINDS[kind](mesh) for _ in range(n)]
    try:
        buffers = adopt_group(ps, world_size=2)
    except Exception as exc:  # noqa: BLE001
        if kind in BROKEN:
            pytest.skip(f"{kind} does not adopt on this branch: {exc!r}")
        raise
    assert buffers.adopted
    return buffers, ps


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_healthy_group_is_answered_from_the_arrays(mesh: Any, kind: str, reads: str) -> None:
    buffers, ps = _group(mesh, kind)
    assert still_valid(buffers, ps) is None  # nothing remembered before the rules ran
    assert is_valid(buffers, ps)
    assert buffers.wrapper_kinds.fast is not None
    assert all((r.raw is not None) == (reads == "vectorized") for r in buffers.wrapper_kinds.fast)
    assert still_valid(buffers, ps) is True
    for r in buffers.wrapper_kinds.fast:  # answered by the one read, not the per-field lists
        assert (reads == "per field" or tc.impl_same(r.tensors(ps), (
            3 if r.own_local else 2) * len(ps), r.raw, r.addresses) is True)
    with torch.no_grad():  # an optimizer step writes values in place: still valid, still fast
        for p in ps:
            local_of(p.sharded_param).add_(1.0)
    assert still_valid(buffers, ps) is True and is_valid(buffers, ps)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("move", sorted(MOVES))
def test_no_move_passes_the_fast_path(mesh: Any, kind: str, move: str) -> None:
    buffers, ps = _group(mesh, kind)
    assert is_valid(buffers, ps) and still_valid(buffers, ps)
    if not MOVES[move](ps[1]):
        pytest.skip(f"{move} does not apply to {kind}")
    assert still_valid(buffers, ps) is None
    assert not is_valid(buffers, ps)
    assert list(problems(buffers, ps)) == [1]


def _reshape_local(p: Any) -> None:
    """Same storage, same offset, another shape: no pointer changes."""
    local = local_of(p.sharded_param)
    with tc.no_torch_function(), torch.no_grad():
        n = tc.impl_numel(local)
        tc.impl_set_(local, tc.impl_untyped_storage(local), tc.impl_storage_offset(local),
                     (n,), (1,))


def _reshape_data(p: Any) -> None:
    data = p._sharded_param_data
    with tc.no_torch_function(), torch.no_grad():
        n = tc.impl_numel(data)
        tc.impl_set_(data, tc.impl_untyped_storage(data), tc.impl_storage_offset(data),
                     (1, n), (n, 1))


@pytest.mark.parametrize("kind", ["plain parameter", "torch DTensor padded", "hp routed even"])
@pytest.mark.parametrize("change", [_reshape_local, _reshape_data])
def test_a_reshape_in_place_is_caught(mesh: Any, kind: str, change: Any) -> None:
    buffers, ps = _group(mesh, kind)
    assert is_valid(buffers, ps)
    if change is _reshape_local and len(tuple(ps[1].sharded_size)) < 2:
        pytest.skip("a 1-D local has no other shape of its size")
    change(ps[1])
    assert still_valid(buffers, ps) is None
    assert not is_valid(buffers, ps) and list(problems(buffers, ps)) == [1]


@pytest.mark.parametrize("kind", ["torch DTensor empty shard", "hp empty shard"])
def test_an_empty_shard_moved_to_another_storage_is_caught(mesh: Any, kind: str) -> None:
    """An empty tensor's pointer is 0 wherever it is: its storage and offset must be read."""
    buffers, ps = _group(mesh, kind)
    assert is_valid(buffers, ps)
    local = local_of(ps[1].sharded_param)
    with tc.no_torch_function():
        assert tc.impl_numel(local) == 0 and tc.impl_data_ptr(local) == 0
        elsewhere = torch.zeros(8, dtype=tc.impl_dtype(local)).untyped_storage()
        with torch.no_grad():
            tc.impl_set_(local, elsewhere, 0, tuple(tc.impl_size(local)),
                         tuple(tc.impl_stride(local)))
        assert tc.impl_data_ptr(local) == 0
    assert still_valid(buffers, ps) is None
    assert not is_valid(buffers, ps) and list(problems(buffers, ps)) == [1]


def test_a_freed_slice_is_caught(mesh: Any) -> None:
    buffers, ps = _group(mesh, "plain parameter")
    assert is_valid(buffers, ps)
    m = buffers.buckets[0].members[1]
    pool = buffers.buckets[0].pool
    assert m.slice is not None
    pool.disown(m.slice)
    pool.free(m.slice)
    assert still_valid(buffers, ps) is None and not is_valid(buffers, ps)


def test_a_reallocated_slice_is_caught(mesh: Any) -> None:
    """A slice freed and allocated again at the same place: every tensor reads as before (same
    storage, offset, shape), only the pool's live handles changed; the member's slice is no
    longer its own (another owner's now), so the fast path must not answer."""
    buffers, ps = _group(mesh, "plain parameter")
    assert is_valid(buffers, ps) and still_valid(buffers, ps)
    m = buffers.buckets[0].members[1]
    pool = buffers.buckets[0].pool
    assert m.slice is not None
    pool.disown(m.slice)
    pool.free(m.slice)
    again = pool.allocate(m.slice.shape, m.slice.dtype)
    assert again.offset == m.slice.offset and again is not m.slice  # the same bytes, reused
    assert still_valid(buffers, ps) is None
    assert not is_valid(buffers, ps) and list(problems(buffers, ps)) == [1]


def test_a_replaced_parameter_object_is_judged_by_the_full_rules(mesh: Any) -> None:
    """``load_state_dict(assign=True)`` installs a new wrapper: a torch DTensor's verdict is
    remembered per object, so a new one (even in the same place) goes to the full rules."""
    buffers, ps = _group(mesh, "torch DTensor padded")
    assert is_valid(buffers, ps)
    old = ps[1].sharded_param
    ps[1].sharded_param = nn.Parameter(old.detach())  # a new DTensor over the same local tensor
    assert still_valid(buffers, ps) is None
    assert is_valid(buffers, ps) and not problems(buffers, ps)  # same local, same place
    assert still_valid(buffers, ps) is True  # and the new object is remembered


def test_a_storage_less_wrappers_impl_in_another_object_is_judged_by_the_full_rules(
        mesh: Any) -> None:
    """The remembered impl (same words, same address) now behind another wrapper object
    (``swap_tensors`` moves impls between objects): the verdict is per object, so only the
    objects' identity tells, and the fast path must leave it to the full rules."""
    buffers, ps = _group(mesh, "torch DTensor padded")
    assert is_valid(buffers, ps) and still_valid(buffers, ps)
    old = ps[1].sharded_param
    other = nn.Parameter(old.detach().clone())
    with tc.no_torch_function():
        impl = tc.impl_address(old)
    torch.utils.swap_tensors(old, other)  # ``other`` is now what ``old`` was, impl included
    with tc.no_torch_function():
        assert tc.impl_address(other) == impl
    ps[1].sharded_param = other
    assert still_valid(buffers, ps) is None
    assert is_valid(buffers, ps) and not problems(buffers, ps)  # the same local, same place
    assert still_valid(buffers, ps) is True  # and the new object is remembered


def test_a_relocated_pool_is_caught(mesh: Any) -> None:
    """A pool moved to a new storage (``grow``) changes every pointer: the arrays are stale,
    the full rules run (and pass, the registry having moved every member), and are kept again."""
    buffers, ps = _group(mesh, "plain parameter")
    assert is_valid(buffers, ps)
    before = buffers.wrapper_kinds.fast
    pool = buffers.buckets[0].pool
    pool.grow(pool.capacity * 4)
    assert still_valid(buffers, ps) is None
    assert is_valid(buffers, ps) == (not problems(buffers, ps))
    if is_valid(buffers, ps):
        assert buffers.wrapper_kinds.fast is not before and still_valid(buffers, ps)


def test_fewer_parameters_than_members_go_to_the_full_rules(mesh: Any) -> None:
    """A shorter list must not pass on its prefix: the full rules index every member."""
    buffers, ps = _group(mesh, "plain parameter")
    assert is_valid(buffers, ps) and still_valid(buffers, ps)
    assert still_valid(buffers, ps[:2]) is None
    with pytest.raises(IndexError):
        is_valid(buffers, ps[:2])


def _pool_view(p: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A new tensor object over exactly the member's local tensor's place (or in ``dtype``,
    at the same element offset: other bytes when the element size differs)."""
    local = local_of(p.sharded_param)
    with tc.no_torch_function():
        return torch.empty(0, dtype=dtype or tc.impl_dtype(local)).set_(
            tc.impl_untyped_storage(local), tc.impl_storage_offset(local),
            tuple(tc.impl_size(local)), tuple(tc.impl_stride(local)))


def test_swap_tensors_moving_a_parameter_out_is_caught(mesh: Any) -> None:
    """``swap_tensors`` changes the impl behind the same Python object: read it again each call."""
    buffers, ps = _group(mesh, "plain parameter")
    assert is_valid(buffers, ps) and still_valid(buffers, ps)
    other = nn.Parameter(torch.zeros_like(ps[1].sharded_param.detach()))
    torch.utils.swap_tensors(ps[1].sharded_param, other)
    assert still_valid(buffers, ps) is None
    assert not is_valid(buffers, ps) and list(problems(buffers, ps)) == [1]


def test_swap_tensors_with_a_twin_in_place_is_rechecked_and_valid(mesh: Any,
                                                                   reads: str) -> None:
    """Another impl over the same place: the vectorized read (which names the impl) leaves it
    to the full rules, which pass it, and the new impl is remembered; per field it reads the
    same (pointer and shape), which is the rules' answer too."""
    buffers, ps = _group(mesh, "plain parameter")
    assert is_valid(buffers, ps)
    twin = nn.Parameter(_pool_view(ps[1]))
    torch.utils.swap_tensors(ps[1].sharded_param, twin)
    assert still_valid(buffers, ps) is (None if reads == "vectorized" else True)
    assert is_valid(buffers, ps) and not problems(buffers, ps)
    assert still_valid(buffers, ps) is True


@pytest.mark.parametrize("kind", ["plain parameter", "torch DTensor padded"])
def test_dot_data_onto_another_storage_is_caught(mesh: Any, kind: str) -> None:
    buffers, ps = _group(mesh, kind)
    assert is_valid(buffers, ps)
    local = local_of(ps[1].sharded_param)
    with torch.no_grad():
        local.data = local.detach().clone()  # same impl, its storage replaced
    assert still_valid(buffers, ps) is None
    assert not is_valid(buffers, ps) and list(problems(buffers, ps)) == [1]


@pytest.mark.parametrize("kind", ["plain parameter", "torch DTensor padded"])
def test_set_to_another_element_size_at_the_same_offset_is_caught(mesh: Any, kind: str) -> None:
    """Same storage, same element offset, same shape, half the element size: other bytes.
    Only the dtype word tells (the offset is counted in elements)."""
    buffers, ps = _group(mesh, kind)
    assert is_valid(buffers, ps)
    local = local_of(ps[1].sharded_param)
    half = _pool_view(ps[1], torch.float16)
    with tc.no_torch_function(), torch.no_grad():
        assert tc.impl_storage_offset(half) > 0  # (member 1: its bytes differ)
        local.data = half  # same impl, storage, element offset and shape; another dtype
        assert tc.impl_dtype(local) == torch.float16
    assert still_valid(buffers, ps) is None
    assert not is_valid(buffers, ps) and list(problems(buffers, ps)) == [1]


def test_another_thread_turns_the_vectorized_read_off(mesh: Any, reads: str) -> None:
    """While another thread exists (it could swap an impl away and free it between two
    reads), the vectorized read does not run; the per-field lists answer, still exactly."""
    import threading

    buffers, ps = _group(mesh, "plain parameter")
    assert is_valid(buffers, ps)
    r = buffers.wrapper_kinds.fast[0]

    def tensors() -> Any:  # what the fast path reads, in its order
        return chain((p._sharded_param_data for p in ps), (p.sharded_param for p in ps))

    if reads == "vectorized":
        assert r.raw is not None and tc.impl_same(tensors(), 2 * len(ps), r.raw) is True
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert not tc.sole_thread()
        if reads == "vectorized":
            assert tc.impl_same(tensors(), 2 * len(ps), r.raw) is None
        assert still_valid(buffers, ps) is True
        _reshape_data(ps[1])
        assert still_valid(buffers, ps) is None and not is_valid(buffers, ps)
    finally:
        stop.set()
        other.join()


def _set_local(p: Any, storage: torch.UntypedStorage, offset: int,
               size: tuple[int, ...] | None = None) -> None:
    local = local_of(p.sharded_param)
    with tc.no_torch_function(), torch.no_grad():
        tc.impl_set_(local, storage, offset, size or tuple(tc.impl_size(local)),
                     tuple(tc.impl_stride(local)))


@pytest.mark.parametrize("kind", ["plain parameter", "torch DTensor padded"])
def test_only_the_storage_changed_is_caught(mesh: Any, kind: str) -> None:
    """A copy of the pool's storage, the same element offset, shape and dtype: only the
    storage identity differs."""
    buffers, ps = _group(mesh, kind)
    assert is_valid(buffers, ps)
    local = local_of(ps[1].sharded_param)
    with tc.no_torch_function():
        copy = tc.impl_untyped_storage(local).clone()
        offset = tc.impl_storage_offset(local)
    _set_local(ps[1], copy, offset)
    assert still_valid(buffers, ps) is None
    assert not is_valid(buffers, ps) and list(problems(buffers, ps)) == [1]


@pytest.mark.parametrize("kind", ["plain parameter", "torch DTensor padded"])
def test_only_the_offset_changed_is_caught(mesh: Any, kind: str) -> None:
    """The same storage, shape and dtype, one element further."""
    buffers, ps = _group(mesh, kind)
    assert is_valid(buffers, ps)
    local = local_of(ps[1].sharded_param)
    with tc.no_torch_function():
        storage, offset = tc.impl_untyped_storage(local), tc.impl_storage_offset(local)
    _set_local(ps[1], storage, offset + 1)
    assert still_valid(buffers, ps) is None
    assert not is_valid(buffers, ps) and list(problems(buffers, ps)) == [1]


def test_only_a_size_changed_is_caught(mesh: Any) -> None:
    """Same storage, offset, dimension count and dtype; one element fewer."""
    buffers, ps = _group(mesh, "plain parameter")
    assert is_valid(buffers, ps)
    data = ps[1]._sharded_param_data
    with tc.no_torch_function(), torch.no_grad():
        n = tc.impl_numel(data)
        tc.impl_set_(data, tc.impl_untyped_storage(data), tc.impl_storage_offset(data),
                     (n - 1,), (1,))
    assert still_valid(buffers, ps) is None
    assert not is_valid(buffers, ps) and list(problems(buffers, ps)) == [1]


_NOT_A_TENSOR = """
import torch
from torch import nn
from flatpool import torch_compat as tc
from flatpool.integrations.hsdp import adopt_group, is_valid
from flatpool.integrations.hsdp.quickcheck import still_valid

class Member:
    def __init__(self):
        self._sharded_param_data = torch.randn(8)
        self.sharded_param = nn.Parameter(self._sharded_param_data)
        self.sharded_size = torch.Size([8])
        self.padded_sharded_param_size = torch.Size([8])
        self.offload_to_cpu = False

tc.VECTORIZED_MIN = 1
ps = [Member() for _ in range(3)]
buffers = adopt_group(ps, world_size=2)
assert is_valid(buffers, ps) and buffers.wrapper_kinds.fast[0].raw is not None
ps[1]._sharded_param_data = [1, 2, 3]  # its third word is its length, not an impl pointer
print("answer", still_valid(buffers, ps))
"""


def test_an_object_of_another_type_is_never_followed(reads: str) -> None:
    """A member attribute that is no longer a tensor: only its type word is read (following
    its third word as an impl pointer would read address 3). In a subprocess: a wrong read
    crashes."""
    if reads != "vectorized":
        pytest.skip("the subprocess reads with the layout its own probe found")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _NOT_A_TENSOR], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "answer None" in out.stdout
