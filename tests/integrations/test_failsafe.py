"""The fail-safe policy of the fusion hooks, on HyperParallel-shaped members in one process:
a C++ holder is a pin kept alive and released at a later check, any other failure leaves the
group unfused with one warning, and a strict policy still raises."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from flatpool import FlatPool, InvalidRequestError, OriginalKeptAliveWarning, PinnedStorageError
from flatpool.errors import UnfusedGroupWarning
from flatpool.integrations.hsdp import GroupBuffers, KeptAlive, keep_fused
from flatpool.integrations.hsdp import flat_buffer, fuse, is_fused
from flatpool.ownership import _release as proof

sys.path.insert(0, str(Path(__file__).parent))
from hp_double import HPParam  # noqa: E402


@pytest.fixture
def no_wait() -> Iterator[None]:
    before = proof.set_cxx_holder_wait(0)  # a graph's saved tensor never goes by itself
    try:
        yield
    finally:
        proof.set_cxx_holder_wait(before)


def _members() -> list[HPParam]:
    torch.manual_seed(0)
    return [HPParam(torch.randn(8, 3), rank=0, world=2) for _ in range(2)]


def test_a_cpp_holder_is_kept_alive_and_released_at_a_later_check(no_wait: None) -> None:
    params = _members()
    local = params[1].sharded_param._local_tensor  # type: ignore[attr-defined]
    local.requires_grad_(True)
    loss = (local * local).sum()  # the graph saves the local tensor: a holder outside Python
    with pytest.raises(PinnedStorageError, match=r"held only from C\+\+"):
        fuse(params, None, device="cpu", world_size=2, on_pinned="raise")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        buffers = fuse(params, None, device="cpu", world_size=2)
        assert is_fused(buffers, params) and flat_buffer(buffers) is not None
        assert fuse(params, buffers, device="cpu", world_size=2) is buffers  # valid: no-op
    kept = [w for w in caught if issubclass(w.category, OriginalKeptAliveWarning)]
    assert len(kept) == 1 and "member 1" in str(kept[0].message), [str(w.message) for w in caught]
    assert kept[0].filename == __file__
    assert buffers.kept_alive == 1 and buffers.kept.originals[0].nbytes == 4 * 3 * 4
    loss.backward()  # the graph still reads the original it saved (kept alive for it)
    del loss
    assert is_fused(buffers, params)  # the per-step check lets the kept original go
    assert buffers.kept_alive == 0 and len(buffers.kept) == 0
    assert all(p.unreleased_originals() == () for p in buffers.pools())


def test_any_other_failure_leaves_the_group_unfused_with_one_warning() -> None:
    params = _members()
    calls = []

    def refuses(policy: object, kept: KeptAlive) -> GroupBuffers:
        calls.append(policy)
        raise InvalidRequestError("member 0 cannot be laid out")

    start = GroupBuffers(skipped="not built yet")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, moved = keep_fused(start, params, refuses, where="hsdp")
        again, _ = keep_fused(out, params, refuses, where="hsdp")  # tried again, told once
    unfused = [w for w in caught if issubclass(w.category, UnfusedGroupWarning)]
    assert len(unfused) == 1 and "member 0 cannot be laid out" in str(unfused[0].message)
    assert not out.adopted and not again.adopted and moved == 0 and calls == ["warn", "warn"]
    assert "the group trains unfused" in (again.skipped or "")
    with pytest.raises(InvalidRequestError):
        keep_fused(start, params, refuses, on_pinned="raise")


def test_the_warning_says_when_the_memory_comes_back(no_wait: None) -> None:
    """Issue 32.3: the warning said the memory comes back "at the first step after" the
    reference is dropped. Measured: an original held by references (a Python alias, an autograd
    graph that saved it) dies the moment the last one goes: no step, no check, no gc."""
    from torch.multiprocessing.reductions import StorageWeakRef

    params = _members()
    locals_ = [p.sharded_param._local_tensor for p in params]  # type: ignore[attr-defined]
    originals = [StorageWeakRef(t.untyped_storage()) for t in locals_]
    alias = locals_[0].detach()  # a Python reference to the original storage
    locals_[1].requires_grad_(True)
    loss = (locals_[1] * locals_[1]).sum()  # the graph saves the original: a C++ reference
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fuse(params, None, device="cpu", world_size=2)
    said = [str(w.message) for w in caught if issubclass(w.category, OriginalKeptAliveWarning)]
    assert len(said) == 2, [str(w.message) for w in caught]
    for text in said:
        assert "first step" not in text
        assert "comes back the moment the last of those references is dropped" in text
    assert not any(o.expired() for o in originals)
    del alias  # the last reference: the memory comes back now
    assert originals[0].expired() and not originals[1].expired()
    del loss  # the graph was the last reference
    assert originals[1].expired()


def test_an_original_the_pool_keeps_is_freed_at_the_next_check(no_wait: None) -> None:
    """The other case of issue 32.3: something outside Python (a DLPack consumer) holds the
    moved tensor, so the pool keeps the original (the consumer may still read it). Its warning
    says so; the memory comes back at the first check after the consumer let go."""
    import numpy as np
    from torch.multiprocessing.reductions import StorageWeakRef

    pool = FlatPool(name="bucket")
    shard = torch.randn(12)
    original = StorageWeakRef(shard.untyped_storage())
    consumer = np.from_dlpack(shard)
    kept = KeptAlive()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept.note(pool, pool.adopt([shard], on_pinned="warn"), ["layer.weight"])
        kept.report()
    said = [str(w.message) for w in caught if issubclass(w.category, OriginalKeptAliveWarning)
            and "layer.weight" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    assert "first step" not in said[0]
    assert "the pool keeps it until that holder lets go" in said[0]
    assert "freed at the layer's next check after that" in said[0]
    del consumer  # the holder let go; the pool still keeps the original ...
    assert not original.expired() and len(kept) == 1
    assert kept.refresh() == 0  # ... until the check (what the next forward runs)
    assert original.expired()
