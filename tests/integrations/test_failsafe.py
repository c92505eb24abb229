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

from flatpool import InvalidRequestError, OriginalKeptAliveWarning, PinnedStorageError
from flatpool.errors import UnfusedGroupWarning
from flatpool.integrations.hsdp import GroupBuffers, KeptAlive, keep_fused
from flatpool.integrations.hsdp.hyperparallel import flat_buffer, fuse, is_fused
from flatpool.ownership import release as proof

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
