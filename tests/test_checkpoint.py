"""Checkpoints of pooled modules behave as if their tensors were ordinary (flatpool.checkpoint).

Every size is compared against an *unadopted twin*: the same module, same values, never put in a
pool. Pools are padded with a large unrelated slice so that writing the pool instead of the
tensor's own bytes could not hide inside the tolerance.
"""

from __future__ import annotations

import copy
import copyreg
import io
import pickle
from collections.abc import Callable, Iterator
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from torch import nn

import flatpool
from flatpool import FlatPool, checkpoint, compact_copy

KiB = 1024
PAD = 4 << 20  # bytes of unrelated data in every pool (4 MiB)
SLACK = 1 * KiB  # "within a few KB": checkpoint sizes may differ by zip framing at most


def saved(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def load(data: bytes) -> object:
    return torch.load(io.BytesIO(data), weights_only=True)


def pooled(module: nn.Module) -> tuple[nn.Module, FlatPool]:
    """``module`` adopted into a pool that also holds 4 MiB of something else."""
    pool = FlatPool(name="ckpt")
    pool.allocate(PAD, torch.uint8)
    pool.adopt(list(module.parameters()) + list(module.buffers()))
    return module, pool


def twins(make: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module, FlatPool]:
    torch.manual_seed(0)
    ref = make()
    model = copy.deepcopy(ref)  # before adoption: an ordinary deep copy
    model, pool = pooled(model)
    return model, ref, pool


class Mixed(nn.Module):
    """bf16 next to fp32 next to a BatchNorm (int64 counter): four dtypes in one pool."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.proj = nn.Linear(16, 24).to(torch.bfloat16)
        self.norm = nn.BatchNorm1d(24)
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.emb.weight  # tied


def tensors(m: nn.Module) -> list[torch.Tensor]:
    return list(m.parameters()) + list(m.buffers())


@pytest.fixture(autouse=True)
def _installed() -> Iterator[None]:
    assert checkpoint.is_installed(), "import flatpool installs the checkpoint support"
    yield
    checkpoint.install()  # a test that uninstalled gives it back


# -- torch.save --------------------------------------------------------------------------------
def test_batchnorm_pool_saves_and_costs_its_own_bytes() -> None:
    model, ref, pool = twins(lambda: nn.BatchNorm1d(4))
    assert len({t.dtype for t in tensors(model)}) == 2 and all(pool.owns(t) for t in tensors(model))
    got, want = saved(model.state_dict()), saved(ref.state_dict())
    assert abs(len(got) - len(want)) <= SLACK, (len(got), len(want))
    assert len(got) < pool.capacity // 100
    loaded = load(got)
    assert isinstance(loaded, dict)
    for k, v in ref.state_dict().items():
        assert torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype


def test_bf16_fp32_tied_model_saves_like_its_unadopted_twin() -> None:
    model, ref, pool = twins(Mixed)
    got, want = saved(model.state_dict()), saved(ref.state_dict())
    assert abs(len(got) - len(want)) <= SLACK, (len(got), len(want))
    loaded = load(got)
    assert isinstance(loaded, dict)
    # tied weights cover the same bytes: written once, loaded sharing one storage, as unpooled
    emb, head = loaded["emb.weight"], loaded["head.weight"]
    assert emb.untyped_storage()._cdata == head.untyped_storage()._cdata
    for k, v in ref.state_dict().items():
        assert torch.equal(loaded[k], v)
    # whole modules pickle the same way
    assert abs(len(saved(model)) - len(saved(ref))) <= SLACK


def test_one_bias_writes_its_own_bytes() -> None:
    model, ref, pool = twins(lambda: nn.Linear(1024, 1024))
    assert pool.capacity > 8 << 20
    got = saved(model.bias)
    assert abs(len(got) - len(saved(ref.bias))) <= SLACK
    back = load(got)
    assert isinstance(back, nn.Parameter) and torch.equal(back, ref.bias)


def test_round_trip_loads_back_into_the_pool_in_place() -> None:
    model, _, pool = twins(Mixed)
    data = saved(model.state_dict())
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    storages = [(t.untyped_storage()._cdata, t.storage_offset()) for t in tensors(model)]
    with torch.no_grad():
        for t in tensors(model):
            t.zero_()
    state = load(data)
    assert isinstance(state, dict)
    model.load_state_dict(state)
    assert pool.is_valid()
    assert all(pool.owns(t) for t in tensors(model))
    assert [(t.untyped_storage()._cdata, t.storage_offset()) for t in tensors(model)] == storages
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k
    # nothing of the checkpoint aliases the pool: mutating it leaves the model alone
    for v in state.values():
        v.zero_() if v.dtype != torch.int64 else v.fill_(-1)
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_geometry_grad_flag_and_attributes_survive() -> None:
    pool = FlatPool()
    pool.allocate(PAD, torch.uint8)
    w = nn.Parameter(torch.randn(6, 5))
    c = torch.randn(3, 2, dtype=torch.complex64)
    plain = torch.arange(7.0)
    pool.adopt([w, c, plain])
    plain.note = {"step": 3}  # type: ignore[attr-defined]
    views = {
        "transposed": w.t(),
        "strided": w[::2, 1:],
        "expanded": plain[:5].expand(4, 5),
        "conj": c.conj(),
        "empty": plain[3:3],
        "nonleaf": w[1],  # requires grad, not a leaf
        "plain": plain,
    }
    back = pickle.loads(pickle.dumps(views))  # plain pickle goes through copyreg too
    for k, v in views.items():
        got = back[k]
        assert got.shape == v.shape and got.stride() == v.stride(), k
        assert got.dtype == v.dtype and got.is_conj() == v.is_conj(), k
        assert got.requires_grad == v.requires_grad, k
        assert torch.equal(got.detach().resolve_conj(), v.detach().resolve_conj()), k
        assert got.untyped_storage().nbytes() < 1024, f"{k} carried more than its own bytes"
    assert back["plain"].note == {"step": 3}
    data = saved(views)
    assert len(data) < 8 * KiB
    loaded = torch.load(io.BytesIO(data), weights_only=False)
    assert loaded["plain"].note == {"step": 3} and loaded["expanded"].stride() == (0, 1)


def test_partly_overlapping_views_are_saved_separately() -> None:
    model, _, pool = twins(lambda: nn.Linear(64, 64))
    w = model.weight
    data = saved({"w": w, "row": w[3], "wt": w.t()})
    out = load(data)
    assert isinstance(out, dict)
    # same bytes, same dtype (w and w.t()): one storage; a partial view: a storage of its own
    assert out["w"].untyped_storage()._cdata == out["wt"].untyped_storage()._cdata
    assert out["row"].untyped_storage()._cdata != out["w"].untyped_storage()._cdata
    assert out["row"].untyped_storage().nbytes() == 64 * 4
    with torch.no_grad():
        out["row"].zero_()
    assert torch.equal(out["w"], w.detach()) and torch.equal(out["wt"], w.detach().t())


def test_a_twin_kept_alive_never_serves_stale_bytes() -> None:
    model, _, _ = twins(lambda: nn.Linear(8, 8))
    b = model.bias
    held = copyreg.dispatch_table[torch.Tensor](b.detach())  # keeps a twin of the bias alive
    with torch.no_grad():
        b.add_(1.0)
    out = load(saved(b.detach()))
    assert isinstance(out, torch.Tensor) and torch.equal(out, b.detach())
    del held


def test_ordinary_tensors_keep_torch_behaviour() -> None:
    base = torch.randn(256)
    out = load(saved({"all": base, "part": base[10:20]}))
    assert isinstance(out, dict)
    # torch's own semantics: views of one ordinary storage are written once and stay views
    assert out["part"].untyped_storage()._cdata == out["all"].untyped_storage()._cdata
    dup = copy.deepcopy({"all": base, "part": base[10:20]})
    assert dup["part"].untyped_storage()._cdata == dup["all"].untyped_storage()._cdata


def test_forking_pickler_still_shares_memory() -> None:
    """torch.multiprocessing's reducer outranks copyreg: pooled tensors are shared, not copied."""
    model, _, pool = twins(lambda: nn.Linear(512, 512))  # 1 MiB weight
    payload = bytes(ForkingPickler.dumps(model.weight.detach()))
    assert len(payload) < 4 * KiB, "the bytes were copied instead of shared"
    assert pool.is_valid() and pool.owns(model.weight)


def test_subclasses_are_delegated_to_torch(hp_wrap: Callable[[torch.Tensor], torch.Tensor]) -> None:
    pool = FlatPool()
    pool.allocate(64 * KiB, torch.uint8)
    t = torch.randn(8)
    pool.adopt([t])
    wrapped = hp_wrap(t)
    assert checkpoint.pool_of(wrapped) is None and checkpoint.pool_of(t) is pool
    back = torch.load(io.BytesIO(saved(wrapped)), weights_only=False)
    assert torch.equal(back, t)


def test_uninstall_gives_torch_its_behaviour_back() -> None:
    model, _, _ = twins(lambda: nn.BatchNorm1d(4))
    checkpoint.uninstall()
    assert not checkpoint.is_installed()
    with pytest.raises(RuntimeError, match="different types"):
        saved(model.state_dict())
    checkpoint.install()
    checkpoint.install()  # idempotent
    assert checkpoint.is_installed()
    assert len(saved(model.state_dict())) < 4 * KiB


# -- deepcopy ----------------------------------------------------------------------------------
def test_deepcopy_of_state_dict_costs_own_bytes_and_is_independent() -> None:
    model, ref, pool = twins(Mixed)
    state = model.state_dict()
    dup = copy.deepcopy(state)
    for k, v in dup.items():
        assert not pool.owns(v), k
        assert v.untyped_storage().nbytes() == v.numel() * v.element_size(), k
        assert torch.equal(v, ref.state_dict()[k]), k
    assert dup["emb.weight"].untyped_storage()._cdata == dup["head.weight"].untyped_storage()._cdata
    for v in dup.values():
        v.fill_(7)
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref.state_dict()[k]), k
    assert pool.is_valid()


def test_deepcopy_of_module_costs_own_bytes_and_is_independent() -> None:
    model, ref, pool = twins(Mixed)
    dup = copy.deepcopy(model)
    assert dup.head.weight is dup.emb.weight  # ties survive
    for k, v in list(dup.named_parameters()) + list(dup.named_buffers()):
        assert not pool.owns(v), k
        assert v.untyped_storage().nbytes() == v.numel() * v.element_size(), k
    with torch.no_grad():
        for t in tensors(dup):
            t.fill_(3)
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref.state_dict()[k]), k


def test_deepcopy_keeps_grad_attributes_and_refuses_non_leaves_like_torch() -> None:
    pool = FlatPool()
    pool.allocate(PAD, torch.uint8)
    t = torch.randn(5, requires_grad=True)
    pool.adopt([t])
    t.grad = torch.ones(5)
    t.tag = "x"  # type: ignore[attr-defined]
    dup = copy.deepcopy(t)
    assert dup.requires_grad and dup.is_leaf and dup.tag == "x"
    assert dup.grad is not None and torch.equal(dup.grad, t.grad)
    assert dup.untyped_storage().nbytes() == 20
    with pytest.raises(RuntimeError, match="graph leaves"):
        copy.deepcopy(t * 2)


def test_compact_copy_helper() -> None:
    pool = FlatPool()
    pool.allocate(PAD, torch.uint8)
    w = torch.randn(4, 6)
    pool.adopt([w])
    c = compact_copy(w.t())
    assert c.stride() == (1, 6) and torch.equal(c, w.t())
    assert c.untyped_storage().nbytes() == 96 and not pool.owns(c)
    assert flatpool.compact_copy is compact_copy


def test_expanded_view_of_a_small_pool_is_compact() -> None:
    """More elements than the pool has bytes (stride 0) still reach only a few of them."""
    pool = FlatPool()
    a, b = torch.arange(4.0), torch.ones(3, dtype=torch.int64)
    pool.adopt([a, b])
    wide = a.expand(1000, 4)
    assert wide.numel() * 4 > pool.capacity
    out = load(saved({"wide": wide, "b": b}))  # two dtypes: torch alone would refuse
    assert isinstance(out, dict)
    assert out["wide"].stride() == (0, 1) and torch.equal(out["wide"], wide)
    assert out["wide"].untyped_storage().nbytes() == 16
