"""Adoption of DTensor parameters sharded over a 2-rank gloo mesh on CPU.

One 2-rank job (``examples.launch``) runs every scenario; each rank reports
``{scenario: None | traceback}`` and every scenario is its own test here.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from scenario_runs import run_scenarios, together

SCENARIOS = (
    "train_bit_identical",
    "uneven_shards",
    "fused_all_gather",
    "pinned_rolls_back",
    "meta_materialize",
    "grow_then_train",
)


# -- worker side -------------------------------------------------------------------------------
def _expired(t: torch.Tensor) -> Callable[[], bool]:
    from torch.multiprocessing.reductions import StorageWeakRef

    from flatpool import storage_of

    ref = StorageWeakRef(storage_of(t))
    return ref.expired


def _params(mesh: Any, shapes: list[tuple[int, ...]], seed: int) -> list[torch.nn.Parameter]:
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(seed)  # the same full tensors on both ranks
    return [
        torch.nn.Parameter(distribute_tensor(torch.randn(*s, generator=g), mesh, [Shard(0)]))
        for s in shapes
    ]


def _step(params: list[torch.nn.Parameter], targets: list[Any], opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    loss = sum(((p - t) ** 2).sum() for p, t in zip(params, targets))
    loss.backward()  # type: ignore[union-attr]
    opt.step()


def _train_pair(mesh: Any, shapes: list[tuple[int, ...]]) -> None:
    from flatpool import FlatPool, local_tensor

    params = _params(mesh, shapes, 0)
    ref = [torch.nn.Parameter(copy.deepcopy(p.data)) for p in params]
    targets = [p.detach() * 0.5 + 1 for p in _params(mesh, shapes, 1)]
    opt = torch.optim.Adam(params, lr=0.05)
    ref_opt = torch.optim.Adam(ref, lr=0.05)
    for _ in range(2):
        _step(params, targets, opt)
        _step(ref, targets, ref_opt)
    ids = [id(p) for p in params]
    dead = [_expired(p) for p in params]
    pool = FlatPool(capacity=1 << 16, name=f"rank{dist.get_rank()}")
    with together():  # a rank that fails here must not leave the other in full_tensor()
        report = pool.adopt(list(params))
    assert report.all_released and all(d() for d in dead), report
    assert [id(p) for p in params] == ids
    assert [id(p) for p in opt.param_groups[0]["params"]] == ids
    for p, q in zip(params, ref):
        assert pool.owns(local_tensor(p)) and torch.equal(local_tensor(p), local_tensor(q))
    for _ in range(3):
        _step(params, targets, opt)
        _step(ref, targets, ref_opt)
    for p, q, s in zip(params, ref, report.slices):
        assert torch.equal(local_tensor(p), local_tensor(q))
        assert torch.equal(s.tensor(), local_tensor(q))  # the optimizer stepped the pool
        assert torch.equal(p.full_tensor(), q.full_tensor())  # type: ignore[attr-defined]
    assert pool.is_valid()


def _s_train_bit_identical(mesh: Any) -> None:
    _train_pair(mesh, [(8, 4), (6,), (4, 2, 2)])


def _s_uneven_shards(mesh: Any) -> None:
    _train_pair(mesh, [(5, 3), (3,)])  # rank 0 holds 3 and 2 rows, rank 1 holds 2 and 1


def _s_fused_all_gather(mesh: Any) -> None:
    from flatpool import FlatPool

    params = _params(mesh, [(4, 4), (2, 4)], 3)
    pool = FlatPool(alignment=1)  # sized by the adoption: exactly the two shards
    with together():
        pool.adopt(list(params))
    flat = pool.flat(torch.float32)
    assert flat.numel() == 12  # 2x4 + 1x4 floats on each rank
    out = torch.empty(flat.numel() * 2)
    dist.all_gather_into_tensor(out, flat)
    mine = out.view(2, -1)[dist.get_rank()]
    assert torch.equal(mine, flat)
    full = [p.full_tensor() for p in params]  # type: ignore[attr-defined]
    first = out.view(2, -1)[0]
    assert torch.equal(first[:8].view(2, 4), full[0][:2])


def _s_pinned_rolls_back(mesh: Any) -> None:
    from flatpool import FlatPool, PinnedStorageError, local_tensor, storage_of

    (p,) = _params(mesh, [(6, 2)], 4)
    hidden = {"stash": local_tensor(p).detach()}
    key = int(storage_of(p)._cdata)
    pool = FlatPool(capacity=4096)
    try:
        pool.adopt(p)
    except PinnedStorageError as exc:
        assert "['stash']" in str(exc), str(exc)
    else:
        raise AssertionError("a pinned DTensor shard was adopted")
    assert int(storage_of(p)._cdata) == key and pool.slices() == ()
    del hidden
    assert pool.adopt(p).all_released


def _s_meta_materialize(mesh: Any) -> None:
    from torch.distributed.tensor import DTensor, Shard

    from flatpool import FlatPool, census, local_tensor

    with torch.device("meta"):
        local = torch.empty(3, 4)  # this rank's shard of a (6, 4) parameter
    p = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))
    del local
    ident = id(p)
    pool = FlatPool(name="meta")
    with together():
        (slc,) = pool.materialize_into(p)
    assert id(p) == ident and pool.slice_of(local_tensor(p)) == slc
    g = torch.Generator().manual_seed(7)
    full = torch.randn(6, 4, generator=g)
    with torch.no_grad():
        local_tensor(p).copy_(full.chunk(2)[dist.get_rank()])
    assert torch.equal(p.full_tensor(), full)  # type: ignore[attr-defined]
    c = census(p, pools=[pool])
    assert len(c.records) == 1 and c.records[0].pool == "meta"


def _s_grow_then_train(mesh: Any) -> None:
    from torch.multiprocessing.reductions import StorageWeakRef

    from flatpool import FlatPool, local_tensor

    params = _params(mesh, [(4, 4)], 5)
    ref = [torch.nn.Parameter(copy.deepcopy(p.data)) for p in params]
    targets = [torch.zeros_like(p) for p in params]
    opt, ref_opt = torch.optim.SGD(params, lr=0.1), torch.optim.SGD(ref, lr=0.1)
    pool = FlatPool(capacity=1024)
    pool.adopt(list(params))
    old = StorageWeakRef(pool.storage)
    pool.grow(4096)
    assert old.expired() and pool.owns(local_tensor(params[0]))
    _step(params, targets, opt)
    _step(ref, targets, ref_opt)
    assert torch.equal(local_tensor(params[0]), local_tensor(ref[0]))


def run_all() -> dict[str, str | None]:
    """Every scenario on this rank (the process group is up): ``{scenario: None | traceback}``."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,))
    return run_scenarios({name: lambda n=name: globals()[f"_s_{n}"](mesh) for name in SCENARIOS})


# -- test side ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_rank_results() -> dict[int, dict[str, str | None]]:
    """One 2-rank job (a file rendezvous: no port to race for). A scenario failing on one rank
    before a collective leaves the other waiting: launch's timeout turns that into a failure
    naming the ranks instead of a hang."""
    from examples.launch import launch

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("gloo is not available")
    return dict(enumerate(launch(run_all, world_size=2, timeout_s=180)))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_two_rank_dtensor(scenario: str, two_rank_results: dict[int, dict[str, str | None]]) -> None:
    failures = {r: res[scenario] for r, res in two_rank_results.items() if res[scenario]}
    assert not failures, "\n".join(f"rank {r}:\n{tb}" for r, tb in failures.items())
