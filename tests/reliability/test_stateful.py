"""Stateful fuzzing: random sequences of pool operations over two pools keep every invariant.

Rules: allocate/free/write plain slices, materialize, adopt batches (plain tensors, parameters
under an optimizer, tensors with views), materialize from meta, user mutations through adopted
tensors and views, optimizer steps, framework re-materialization followed by ``readopt()``,
``grow()``, ``compact()``, release of adopted tensors, a tensor adopted into a second pool, and a
census. After every step: slices are disjoint, aligned and inside the capacity; the accounting
adds up; every adopted tensor aliases its slice and holds exactly the values of a shadow copy
kept outside the pool; every released original storage is expired; and a census of everything
adopted finds no stale storage outside the pools.

Quick mode runs a few hundred short programs; ``--slow`` runs thousands of longer ones.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from flatpool import AdoptSpec, FlatPool, InvalidRequestError, PoolExhaustedError, Slice, census
from flatpool._allocator import align_up

from .state import Snapshot, check_layout

DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16, torch.uint8]
shapes = st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple)


def filled(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Deterministic small integers, exact in every dtype used here."""
    n = 1
    for d in shape:
        n *= d
    return ((torch.arange(n) * 7 + seed) % 97).to(dtype).reshape(shape).clone()


class Entry:
    """One adopted original: its primary tensor, views on it, and the shadow of its values."""

    def __init__(self, pool: FlatPool, slc: Slice, primary: torch.Tensor, kind: str) -> None:
        self.pool, self.slice, self.primary, self.kind = pool, slc, primary, kind
        self.shadow = primary.detach().clone()
        self.views: list[tuple[torch.Tensor, slice]] = []
        self.group: Any = None  # module + optimizer for parameters


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pools = [
            FlatPool(alignment=64, name="A"),
            FlatPool(alignment=1, capacity=2048, name="B"),
        ]
        self.plain: list[tuple[FlatPool, Slice, torch.Tensor | None]] = []
        self.entries: list[Entry] = []
        self.released: list[Any] = []
        self.seed = 0

    # -- helpers -------------------------------------------------------------------------
    def _seed(self) -> int:
        self.seed += 1
        return self.seed

    def _adopt(self, pool: FlatPool, targets: list[Any], snap_tensors: dict[str, torch.Tensor]) -> Any:
        """Adopt; on exhaustion check nothing changed, grow and retry."""
        originals = [
            StorageWeakRef((t.tensor if isinstance(t, AdoptSpec) else t).untyped_storage())
            for t in targets
        ]
        snap = Snapshot(self.pools, snap_tensors)
        try:
            report = pool.adopt(targets)
        except PoolExhaustedError:
            snap.assert_unchanged()
            need = sum(
                align_up(t.numel() * t.element_size(), pool.alignment) + 64
                for t in (x.tensor if isinstance(x, AdoptSpec) else x for x in targets)
            )
            pool.grow(pool.capacity + need)
            report = pool.adopt(targets)
        del snap
        assert report.all_released
        self.released += originals
        return report

    def _remap(self, pool: FlatPool, mapping: dict[int, Slice]) -> None:
        self.plain = [
            (p, mapping[s.slice_id] if p is pool else s, sh) for p, s, sh in self.plain
        ]
        for e in self.entries:
            if e.pool is pool:
                e.slice = mapping[e.slice.slice_id]

    # -- plain slices ------------------------------------------------------------------
    @rule(i=st.integers(0, 1), shape=shapes, dtype=st.sampled_from(DTYPES))
    def allocate(self, i: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        pool = self.pools[i]
        try:
            slc = pool.allocate(shape, dtype)
        except PoolExhaustedError:
            return
        shadow = None
        if pool.is_materialized:
            shadow = filled(shape, dtype, self._seed())
            slc.tensor().copy_(shadow)
        self.plain.append((pool, slc, shadow))

    @precondition(lambda self: self.plain)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.plain) - 1))
        pool, slc, _ = self.plain.pop(i)
        pool.free(slc)
        assert not slc.is_live

    @precondition(lambda self: self.plain)
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.plain) - 1))
        pool, slc, _ = self.plain[i]
        shadow = filled(slc.shape, slc.dtype, self._seed())
        slc.tensor().copy_(shadow)
        self.plain[i] = (pool, slc, shadow)

    @rule(i=st.integers(0, 1))
    def materialize(self, i: int) -> None:
        self.pools[i].materialize()

    # -- adoption ------------------------------------------------------------------------
    @rule(i=st.integers(0, 1), specs=st.lists(st.tuples(shapes, st.sampled_from(DTYPES)),
                                             min_size=1, max_size=3))
    def adopt_plain(self, i: int, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> None:
        pool = self.pools[i]
        ts = [filled(shape, dt, self._seed()) for shape, dt in specs]
        report = self._adopt(pool, list(ts), {f"t{k}": t for k, t in enumerate(ts)})
        for t, slc in zip(ts, report.slices):
            self.entries.append(Entry(pool, slc, t, "plain"))

    @rule(i=st.integers(0, 1), n_in=st.integers(1, 4), n_out=st.integers(1, 4),
          momentum=st.booleans())
    def adopt_params(self, i: int, n_in: int, n_out: int, momentum: bool) -> None:
        pool = self.pools[i]
        lin = nn.Linear(n_in, n_out)
        with torch.no_grad():
            lin.weight.copy_(filled((n_out, n_in), torch.float32, self._seed()))
            lin.bias.copy_(filled((n_out,), torch.float32, self._seed()))
        opt = torch.optim.SGD(lin.parameters(), lr=1.0, momentum=0.5 if momentum else 0.0)
        report = self._adopt(pool, [lin.weight, lin.bias], {"w": lin.weight, "b": lin.bias})
        group = (lin, opt, momentum)
        for p, slc in zip((lin.weight, lin.bias), report.slices):
            e = Entry(pool, slc, p, "param")
            e.group = group
            self.entries.append(e)

    @rule(i=st.integers(0, 1), n=st.integers(2, 12), data=st.data())
    def adopt_with_views(self, i: int, n: int, data: st.DataObject) -> None:
        pool = self.pools[i]
        a = data.draw(st.integers(0, n - 1))
        b = data.draw(st.integers(a + 1, n))
        base = filled((n,), torch.float32, self._seed())
        view = base[a:b]
        report = self._adopt(pool, [AdoptSpec(base, views=(view,))], {"base": base, "view": view})
        e = Entry(pool, report.slices[0], base, "view")
        e.views.append((view, slice(a, b)))
        self.entries.append(e)

    @rule(i=st.integers(0, 1), n_in=st.integers(1, 4), n_out=st.integers(1, 4))
    def materialize_from_meta(self, i: int, n_in: int, n_out: int) -> None:
        pool = self.pools[i]
        with torch.device("meta"):
            lin = nn.Linear(n_in, n_out)
        try:
            slices = pool.materialize_into([lin.weight, lin.bias])
        except PoolExhaustedError as exc:
            assert lin.weight.is_meta and lin.bias.is_meta
            pool.grow(pool.capacity + 2 * exc.requested + 1024)
            slices = pool.materialize_into([lin.weight, lin.bias])
        with torch.no_grad():
            lin.weight.copy_(filled((n_out, n_in), torch.float32, self._seed()))
            lin.bias.copy_(filled((n_out,), torch.float32, self._seed()))
        opt = torch.optim.SGD(lin.parameters(), lr=1.0)
        group = (lin, opt, False)
        for p, slc in zip((lin.weight, lin.bias), slices):
            e = Entry(pool, slc, p, "param")
            e.group = group
            self.entries.append(e)

    # -- user activity -------------------------------------------------------------------
    @precondition(lambda self: self.entries)
    @rule(data=st.data(), amount=st.integers(1, 5))
    def mutate(self, data: st.DataObject, amount: int) -> None:
        e = data.draw(st.sampled_from(self.entries))
        with torch.no_grad():
            if e.views and data.draw(st.booleans()):
                view, where = e.views[0]
                view.add_(amount)
                e.shadow[where] += amount
            else:
                e.primary.add_(amount)
                e.shadow += amount

    @precondition(lambda self: any(e.kind == "param" for e in self.entries))
    @rule(data=st.data())
    def optimizer_step(self, data: st.DataObject) -> None:
        e = data.draw(st.sampled_from([e for e in self.entries if e.kind == "param"]))
        lin, opt, momentum = e.group
        if momentum:  # momentum buffers make the shadow arithmetic stateful: just step
            mine = [x for x in self.entries if x.group is e.group]
            opt.zero_grad()
            lin(torch.ones(1, lin.in_features)).sum().backward()
            opt.step()
            for x in mine:
                x.shadow = x.primary.detach().clone()
                assert x.pool.owns(x.primary)
            return
        for p in (lin.weight, lin.bias):
            p.grad = torch.ones_like(p) * 2
        opt.step()
        for x in self.entries:
            if x.group is e.group:
                x.shadow -= 2

    @precondition(lambda self: any(e.kind in ("plain", "param") for e in self.entries))
    @rule(data=st.data())
    def rematerialize_then_readopt(self, data: st.DataObject) -> None:
        """A framework gives some adopted tensors new storage; readopt() brings them back."""
        movable = [e for e in self.entries if e.kind in ("plain", "param")]
        chosen = data.draw(st.lists(st.sampled_from(movable), min_size=1, max_size=3,
                                    unique_by=id))
        fresh = []
        for e in chosen:
            e.primary.data = e.primary.data.clone() + 1
            e.shadow += 1
            fresh.append(StorageWeakRef(e.primary.untyped_storage()))
        pools = {id(e.pool): e.pool for e in chosen}
        for pool in pools.values():
            assert not pool.is_valid()
            pool.readopt()
        self.released += fresh

    @precondition(lambda self: any(e.kind in ("plain", "view") for e in self.entries))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        """The user drops an adopted tensor; its slice can then be freed."""
        e = data.draw(st.sampled_from([e for e in self.entries if e.kind in ("plain", "view")]))
        self.entries.remove(e)
        pool, slc = e.pool, e.slice
        e.primary = e.views = None  # type: ignore[assignment]
        del e
        pool.free(slc)

    @precondition(lambda self: self.entries)
    @rule(data=st.data())
    def adopt_into_other_pool(self, data: st.DataObject) -> None:
        e = data.draw(st.sampled_from(self.entries))
        other = self.pools[1] if e.pool is self.pools[0] else self.pools[0]
        snap = Snapshot(self.pools, {"t": e.primary})
        with pytest.raises(InvalidRequestError, match="already lives in"):
            other.adopt(e.primary)
        snap.assert_unchanged()

    # -- relocation ------------------------------------------------------------------------
    @rule(i=st.integers(0, 1), extra=st.integers(0, 4096))
    def grow(self, i: int, extra: int) -> None:
        pool = self.pools[i]
        before = {s.slice_id: s.offset for s in pool.slices()}
        pool.grow(pool.capacity + extra)
        assert {s.slice_id: s.offset for s in pool.slices()} == before

    @rule(i=st.integers(0, 1))
    def compact(self, i: int) -> None:
        pool = self.pools[i]
        mapping = pool.compact()
        self._remap(pool, mapping)
        pos = 0
        for s in pool.slices():  # packed: each slice at the first aligned offset
            assert s.offset == align_up(pos, pool.slice_alignment(s.dtype)), pool.describe()
            pos = s.end
        if pool.is_materialized:
            assert pool.capacity == align_up(pos, pool.alignment), pool.describe()

    @rule()
    def take_census(self) -> None:
        roots = [e.primary for e in self.entries] + [e.group[0] for e in self.entries if e.group]
        if not roots:  # census() without roots scans the whole process
            return
        c = census(*roots, pools=self.pools)
        assert not c.stale, c.render()
        for r in c.records:  # adopted data lives only in pools; grads and state are their own
            assert r.pool is not None or set(r.roles) <= {"grad", "optimizer state"}, c.render()

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def layout(self) -> None:
        for p in self.pools:
            check_layout(p)

    @invariant()
    def plain_values(self) -> None:
        for pool, slc, shadow in self.plain:
            assert slc.is_live
            if shadow is not None:
                assert torch.equal(slc.tensor(), shadow), slc

    @invariant()
    def adopted_alias_and_values(self) -> None:
        for e in self.entries:
            assert e.slice.is_live
            assert e.pool.slice_of(e.primary) == e.slice, (e.kind, e.slice)
            assert torch.equal(e.primary.detach(), e.shadow), e.kind
            for view, where in e.views:
                assert e.pool.slice_of(view) == e.slice
                assert torch.equal(view.detach(), e.shadow[where])
        for p in self.pools:
            assert p.is_valid()

    @invariant()
    def originals_released(self) -> None:
        assert all(ref.expired() for ref in self.released)


QUICK = settings(max_examples=150, stateful_step_count=30, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
SLOW = settings(max_examples=3000, stateful_step_count=60, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def test_pool_machine() -> None:
    PoolMachine.TestCase.settings = QUICK
    PoolMachine.TestCase().runTest()


@pytest.mark.slow
def test_pool_machine_slow() -> None:
    PoolMachine.TestCase.settings = SLOW
    PoolMachine.TestCase().runTest()
