"""census(): distinct live storages from roots (or the whole process), stale copies, rendering."""

from __future__ import annotations

import copy
import gc

import torch

from flatpool import Census, FlatPool, StorageRecord, census, storage_of

CAP = 1 << 16


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _naive_rebase(pool: FlatPool, model: torch.nn.Module) -> None:
    """The bug this project grew from: copy shards into a flat buffer, keep the originals."""
    for p in model.parameters():
        slc = pool.allocate(tuple(p.shape), p.dtype)
        slc.tensor().copy_(p.detach())


def test_naive_rebase_is_flagged_stale_and_adoption_clears_it() -> None:
    model = _model()
    pool = FlatPool(capacity=CAP, name="bucket")
    _naive_rebase(pool, model)
    c = census(model, pools=[pool])
    assert isinstance(c, Census) and all(isinstance(r, StorageRecord) for r in c.records)
    assert len(c.records) == 4 and len(c.stale) == 4
    assert {r.stale_of for r in c.stale} == {f"bucket:{s.slice_id}" for s in pool.slices()}
    names = {n for r in c.stale for n in r.referrers}
    assert names == {"0.weight", "0.bias", "2.weight", "2.bias"}
    table = c.render()
    assert "STALE (copy of bucket:0)" in table and "0.weight" in table
    assert "stale 332 bytes in 4 storage(s)" in table  # 48+8+24+3 floats

    # The fix: adopt into the slices already holding the bytes.
    from flatpool import AdoptSpec

    specs = [AdoptSpec(p, slice=s) for p, s in zip(model.parameters(), pool.slices())]
    assert pool.adopt(specs).all_released
    c2 = census(model, pools=[pool])
    assert c2.stale == ()
    assert len(c2.records) == 1  # only the pool's storage is left
    rec = c2.records[0]
    assert rec.pool == "bucket" and rec.slices == tuple(s.slice_id for s in pool.slices())
    assert rec.nbytes == pool.capacity and c2.pool_bytes == pool.capacity
    assert set(rec.referrers) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert "pool" in c2.render() and "stale 0 bytes" in c2.render()


def test_grads_and_optimizer_state_are_never_stale() -> None:
    model = _model(1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    pool = FlatPool(capacity=CAP)
    pool.adopt(list(model.parameters()))
    # Copies of grad and state bytes in the pool do not make them stale.
    for p in model.parameters():
        assert p.grad is not None
        pool.allocate(tuple(p.shape), p.dtype).tensor().copy_(p.grad)
    c = census(model, opt, pools=[pool])
    assert c.stale == ()
    roles = {role for r in c.records for role in r.roles}
    assert roles == {"parameter", "grad", "optimizer state"}
    in_pool = [r for r in c.records if r.pool is not None]
    assert len(in_pool) == 1
    # One storage per grad, per exp_avg/exp_avg_sq, per step (Adam keeps a tensor step).
    grads = [r for r in c.records if "grad" in r.roles]
    assert len(grads) == 4
    state = [r for r in c.records if "optimizer state" in r.roles]
    assert any(any(n.endswith(".exp_avg") for n in r.referrers) for r in state)
    assert any("root1.param[0][0]" in n for r in state for n in r.referrers)


def test_storages_are_distinct_and_counted_once() -> None:
    base = torch.randn(10)
    views = {"a": base[:5], "b": base[5:], "c": base.view(2, 5)}
    other = torch.randn(3)
    c = census(views, [other, other], pools=[])
    assert len(c.records) == 2
    rec = next(r for r in c.records if r.nbytes == 40)
    assert set(rec.referrers) == {"root0.a", "root0.b", "root0.c"}
    assert c.total_bytes == 40 + 12


def test_objects_dicts_and_lists_as_roots() -> None:
    class Holder:
        def __init__(self) -> None:
            self.w = torch.randn(4)
            self.stuff = {"k": [torch.randn(2)]}

    h = Holder()
    c = census(h, pools=[])
    names = sorted(n for r in c.records for n in r.referrers)
    assert names == ["Holder.stuff.k.0", "Holder.w"]


def test_whole_process_census_finds_a_stale_copy() -> None:
    pool = FlatPool(capacity=CAP, name="proc")
    kept = torch.randn(16)
    slc = pool.allocate(16, torch.float32)
    slc.tensor().copy_(kept)
    c = census(pools=[pool])  # every tensor in the process
    stale = [r for r in c.stale if r.stale_of == f"proc:{slc.slice_id}"]
    assert len(stale) == 1 and stale[0].nbytes == 64
    assert any(r.pool == "proc" for r in c.records) or pool.is_materialized
    pool.disown(slc)
    assert pool.adopt(kept).all_released is True
    gc.collect()
    c2 = census(pools=[pool])
    assert not [r for r in c2.stale if r.stale_of and r.stale_of.startswith("proc:")]
    assert any(r.pool == "proc" for r in c2.records)


def test_dtensor_and_wrapper_params_are_seen_through(dtensor_from_local, hp_wrap) -> None:  # type: ignore[no-untyped-def]
    d = torch.nn.Parameter(dtensor_from_local(torch.randn(4, 2)))
    w = hp_wrap(torch.randn(3))
    pool = FlatPool(capacity=CAP, name="dt")
    pool.adopt([d, w])
    c = census({"d": d, "w": w}, pools=[pool])
    assert len(c.records) == 1 and c.records[0].pool == "dt" and len(c.records[0].slices) == 2


def test_allocator_counters_absent_on_cpu() -> None:
    pool = FlatPool(capacity=CAP)
    pool.materialize()
    c = census(torch.randn(2), pools=[pool])
    assert c.allocator == {}
    assert "allocator" not in c.render()


def test_census_after_adoption_matches_training_model() -> None:
    """The report scenario: after adoption only the pool holds parameter bytes, and training
    (which creates grads and state) adds no parameter-sized stale storage."""
    model = _model(2)
    ref = copy.deepcopy(model)
    pool = FlatPool(capacity=CAP, name="train")
    pool.adopt(list(model.parameters()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(3, 6)
    for m, o in ((model, opt), (ref, ref_opt)):
        for _ in range(2):
            o.zero_grad()
            m(x).sum().backward()
            o.step()
    c = census(model, opt, pools=[pool])
    assert c.stale == ()
    params = [r for r in c.records if "parameter" in r.roles]
    assert len(params) == 1 and params[0].pool == "train"
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q) and storage_of(p).data_ptr() == pool.storage.data_ptr()


def test_stale_check_compares_each_tensor_with_its_own_copy_only(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Issue 32.4: thousands of same-shape members (a fused model's parameters, gradient and
    state pools) beside as many tensors of that shape outside the pools made the stale check
    compare every tensor with every slice. Now each slice's bytes are read about once, and a
    tensor only against the slices that can hold its bytes. Counted, not timed: every read of
    a slice's bytes goes through ``slice_bytes`` (the real method, counted)."""
    from flatpool._state import PoolState

    n = 300
    g = torch.Generator().manual_seed(0)
    members = [torch.randn(16, generator=g) for _ in range(n)]
    pool = FlatPool(name="members")
    pool.adopt(members)
    outside = [torch.randn(16, generator=g) for _ in range(n)]  # same shape, other bytes
    copy_of_7 = members[7].clone()  # a real stale copy among them
    reads: list[int] = []
    real = PoolState.slice_bytes

    def counted(self: PoolState, slc):  # type: ignore[no-untyped-def]
        reads.append(slc.slice_id)
        return real(self, slc)

    monkeypatch.setattr(PoolState, "slice_bytes", counted)
    c = census(outside, copy_of_7, pools=[pool])
    monkeypatch.undo()
    assert [r.stale_of for r in c.stale] == ["members:7"]
    assert len(c.records) == n + 1
    assert len(reads) <= n + 2, f"{len(reads)} slice reads for {n} slices"  # was n * (n + 1)


def test_stale_check_looks_at_every_byte() -> None:
    """A tensor that matches a slice everywhere but in bytes no summary looks at (two bytes
    swapped: same byte sum) is not called a copy; only equal bytes are."""
    pool = FlatPool(name="p")
    t = torch.arange(256, dtype=torch.uint8)
    pool.adopt([t])
    near = torch.arange(256, dtype=torch.uint8)
    near[[1, 2]] = near[[2, 1]]  # bytes 1 and 2 swapped; 0, 16, 32, ... and the last kept
    exact = torch.arange(256, dtype=torch.uint8)
    c = census({"near": near, "exact": exact}, pools=[pool])
    stale = {r.referrers[0]: r.stale_of for r in c.records if r.pool is None}
    assert stale == {"near": None, "exact": "p:0"}
