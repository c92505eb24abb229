"""Asynchronous interrupts at every line: an operation either completes or changes nothing.

A Ctrl-C (or any asynchronous exception) can land between any two bytecodes. The tracer here
raises :class:`Interrupt` at the k-th line executed inside flatpool during an operation (adopt
on both paths, adopt into existing slices, readopt, grow, compact, materialize_into), for
k = 0, 1, 2, ... Afterwards the world must be either exactly as before (every tensor's
storage, geometry, values and identity, every holder, the pool's layout, bytes and registry)
or fully done (everything in the pool, valid, optimizer still stepping the same objects).
After a rollback the same operation must then succeed. A second interrupt can also be raised
at every line of the rollback itself, which must still finish.

The default run samples the lines evenly; ``--slow`` runs every line.

Not interrupted: the lines of the guard's own primitives (``flatpool/_interrupts.py``, the gc
pause), the lines of ``with`` statements and bare ``try:`` lines. CPython cannot run a context
manager's exit atomically (an exception landing right before ``__exit__`` on the normal path
skips it, bpo-29988; so does one a tracer raises at a ``try:`` line inside a ``with`` block,
measured on 3.11), so flatpool defers signals across those exits instead. Signals land only
where the interpreter checks for them, never at those points; a synchronous raise placed there
by a tracer is outside what any Python code can guarantee.
"""

from __future__ import annotations

import gc
import linecache
import os
import signal
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

import flatpool
from flatpool import FlatPool, Slice
from flatpool.ownership import _transaction as transaction

from .scenarios import World, batch_world, ints, sharded_world, values_of
from .state import Snapshot, check_layout
from .test_faults import OPERATIONS, _check_after_success

FLATPOOL_DIR = os.path.dirname(os.path.abspath(flatpool.__file__))
PRIMITIVES = tuple(os.path.join(FLATPOOL_DIR, f) for f in ("_interrupts.py", "_gcpause.py"))


def _interruptible(frame: types.FrameType) -> bool:
    code = frame.f_code
    if code.co_filename.startswith(PRIMITIVES):
        return False
    line = linecache.getline(code.co_filename, frame.f_lineno).strip()
    return not (line.startswith("with ") or line == "try:")


class Interrupt(BaseException):
    """Stands for a KeyboardInterrupt or any asynchronous exception."""


def _plain_world() -> World:
    """Only plain tensors and parameters: the lean path."""
    w = World()
    pool = FlatPool(alignment=64, capacity=1 << 14, name="plain")
    w.pools.append(pool)
    lin = torch.nn.Linear(4, 3)
    with torch.no_grad():
        lin.weight.copy_(ints(3, 4))
        lin.bias.copy_(ints(3, start=50))
    opt = torch.optim.SGD(lin.parameters(), lr=0.5, momentum=0.9)
    plain, strided = ints(2, 3, start=200), ints(4, 5, start=300).t()
    w.targets = [lin.weight, lin.bias, plain, strided]
    w.tensors = dict(weight=lin.weight, bias=lin.bias, plain=plain, strided=strided)
    w.keep = [lin, None]
    w.opt = opt
    return w


def _big_world(count: int, numel: int, large: int = 0, large_numel: int = 1 << 20) -> World:
    """``count`` plain tensors of ``numel`` floats (and ``large`` of ``large_numel``) into a
    growable pool: batches big enough for the threaded copy (:mod:`flatpool.ownership.copying`)."""
    w = World()
    w.pools.append(FlatPool(name="big"))
    sizes = [numel] * count + [large_numel] * large
    w.targets = [torch.full((n,), float(i % 251)) for i, n in enumerate(sizes)]
    w.tensors = {f"t{i}": t for i, t in enumerate(w.targets)}
    return w


Ops = dict[str, tuple[Callable[[], World], Callable[[World], Callable[[], Any]]]]


def _adopt_targets(w: World) -> Callable[[], Any]:
    return lambda: w.pool.adopt(w.targets)


OPS: Ops = {
    "adopt-plain": (_plain_world, _adopt_targets),
    "adopt-sharded": (sharded_world, _adopt_targets),  # the sharded lean path
    **OPERATIONS,
}

def _fragmented() -> tuple[FlatPool, list[Slice]]:
    """A fixed pool with slices and gaps between them: allocations split a gap (best fit),
    frees merge with the gaps on both sides."""
    pool = FlatPool(alignment=64, capacity=1 << 12, name="alloc")
    slices = [pool.allocate((16,), torch.float32) for _ in range(6)]
    pool.free(slices[1])
    pool.free(slices[3])
    return pool, [slices[0], slices[2], slices[4], slices[5]]


def _alloc_world(growable: bool = False) -> World:
    w = World()
    if growable:  # planned, with a gap in the middle and none at the tail
        pool = FlatPool(alignment=64, name="planned")
        a, b, c = (pool.allocate((8,), torch.float32) for _ in range(3))
        pool.free(b)
        w.keep = [a, c]
    else:
        pool, w.keep = _fragmented()
    w.targets = list(w.keep)  # the slices it was built with
    w.pools.append(pool)
    return w


def _allocate(w: World) -> Callable[[], Any]:
    return lambda: w.keep.append(w.pool.allocate((40,), torch.float32))


def _allocate_many(w: World) -> Callable[[], Any]:
    return lambda: w.keep.extend(w.pool.allocate_many(
        [((8,), torch.float32), ((300,), torch.float32), ((5,), torch.int64)]))


def _free(w: World) -> Callable[[], Any]:
    return lambda: w.pool.free(w.targets[1])  # gaps on both sides: three free ranges merge


ALLOC_OPS: Ops = {
    "allocate": (_alloc_world, _allocate),
    "allocate-grow": (lambda: _alloc_world(growable=True),
                      lambda w: lambda: w.keep.append(w.pool.allocate((64,), torch.float32))),
    "allocate_many": (_alloc_world, _allocate_many),
    "allocate_many-planned": (lambda: _alloc_world(growable=True), _allocate_many),
    "free": (_alloc_world, _free),
}
"""The allocator's own operations (no transaction: every-line test only)."""


ALLOCATED = {"allocate": [(40,)], "allocate-grow": [(64,)],
             "allocate_many": [(8,), (300,), (5,)], "allocate_many-planned": [(8,), (300,), (5,)]}


def _alloc_done(op: str, w: World) -> None:
    """Fully done: the new slices (or the freed one's absence) in a consistent layout, and the
    pool still serves an allocation and a free. (An interrupt at the ``return`` gives the
    caller no handle although the slices exist: that is done, as any call returning a
    resource is; the new slices are told apart by their shapes.)"""
    pool = w.pool
    check_layout(pool)
    live = set(pool.slices())
    if op == "free":
        assert not w.targets[1].is_live and live == set(w.targets) - {w.targets[1]}
    else:
        built = set(w.targets)
        made = sorted(live - built, key=lambda s: s.slice_id)
        assert built <= live and set(w.keep) - built <= set(made), (live, w.keep)
        assert [s.shape for s in made] == ALLOCATED[op], (made, op)
    extra = pool.allocate((1,), torch.float32)
    pool.free(extra)
    check_layout(pool)


def _adopt_general(w: World) -> Callable[[], Any]:
    return lambda: w.pool.adopt(w.targets, on_pinned="force")  # (the general path)


BIG_OPS: Ops = {
    # 2,000 x 24 KiB: many small copies; 16 x 4 MiB: large copies; the two mixed. The lean
    # path copies in the calling thread; the general path's small copies are threaded, and
    # there the calling thread copies the large ones while the workers copy the small ones.
    "adopt-plain-2000x24KiB": (lambda: _big_world(2000, 6144), _adopt_targets),
    "adopt-plain-16x4MiB": (lambda: _big_world(0, 0, 16), _adopt_targets),
    "adopt-plain-mixed": (lambda: _big_world(1000, 6144, 4), _adopt_targets),
    "adopt-general-2000x24KiB": (lambda: _big_world(2000, 6144), _adopt_general),
    "adopt-general-mixed": (lambda: _big_world(1000, 6144, 4), _adopt_general),
}
"""Plain batches for the SIGALRM fuzz (too many lines for the every-line test)."""

EVERY_LINE: Ops = {**OPS, **ALLOC_OPS}


def _done(op: str, w: World, before: dict[str, torch.Tensor]) -> None:
    if op in ALLOC_OPS:
        _alloc_done(op, w)
        return
    if op.startswith(("adopt-plain", "adopt-general")) or op == "adopt-sharded":
        pool = w.pool
        check_layout(pool)
        assert pool.is_valid()
        for name, t in w.tensors.items():
            assert pool.owns(t) and torch.equal(t.detach(), before[name]), name
        return
    _check_after_success(op, w, before)


class LineTracer:
    """Raise :class:`Interrupt` at the ``k``-th line executed in flatpool's files (``k=None``:
    only count). Raising from a trace function also removes it, as CPython does."""

    def __init__(self, k: int | None) -> None:
        self.k = k
        self.lines = 0

    def __call__(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code.co_filename.startswith(FLATPOOL_DIR):
            return self.local
        return None

    def local(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "line" and _interruptible(frame):
            if self.lines == self.k:
                self.lines += 1
                raise Interrupt(f"interrupt at line {frame.f_code.co_name}:{frame.f_lineno}")
            self.lines += 1
        return self.local


def _traced(run: Callable[[], Any], tracer: LineTracer) -> BaseException | None:
    sys.settrace(tracer)
    try:
        run()
    except Interrupt as exc:
        return exc
    finally:
        sys.settrace(None)
    return None


def count_lines(op: str, second: bool = False) -> int:
    """Lines flatpool executes for ``op`` (``second``: in the rollback after an interrupt)."""
    build, prepare = EVERY_LINE[op]
    w = build()
    tracer = LineTracer(None)
    if not second:
        _traced(prepare(w), tracer)
        return tracer.lines
    counter = LineTracer(None)
    with _second_interrupt(counter):
        _traced(prepare(w), LineTracer(0))
    return counter.lines


class _second_interrupt:
    """Arm ``tracer`` for the first rollback that runs (the retry after it is not traced)."""

    def __init__(self, tracer: LineTracer) -> None:
        self.tracer = tracer
        self.original = transaction.Transaction.rollback
        self.fired = False

    def __enter__(self) -> _second_interrupt:
        original, me = self.original, self

        def rollback(txn: transaction.Transaction) -> None:
            if me.fired:
                return original(txn)
            me.fired = True
            sys.settrace(me.tracer)
            try:
                return original(txn)
            finally:
                sys.settrace(None)

        transaction.Transaction.rollback = rollback  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        transaction.Transaction.rollback = self.original  # type: ignore[method-assign]


def _positions(n: int, budget: int, slow: bool) -> list[int]:
    if slow or n <= budget:
        return list(range(n))
    step = n / budget
    return sorted({int(i * step) for i in range(budget)} | {n - 1})


def interrupt_at(op: str, k: int, second: int | None = None, retry: bool = True) -> str:
    """Interrupt ``op`` at its ``k``-th line (and its rollback at line ``second``); check the
    outcome. Returns "rolled back", "done" or "not reached"."""
    build, prepare = EVERY_LINE[op]
    w = build()
    run = prepare(w)
    before = values_of(w)
    snap = Snapshot(w.pools, w.tensors, w.places)
    gc_was = gc.isenabled()
    handler = signal.getsignal(signal.SIGINT)
    if second is None:
        exc = _traced(run, LineTracer(k))
    else:
        with _second_interrupt(LineTracer(second)):
            exc = _traced(run, LineTracer(k))
    assert gc.isenabled() == gc_was, "the gc pause was not undone"
    assert signal.getsignal(signal.SIGINT) is handler, "a signal handler was left installed"
    if exc is None:
        _done(op, w, before)
        return "not reached"
    del exc
    try:
        outcome = settled(op, w, before, snap)
    except AssertionError as err:
        raise AssertionError(f"{op}: interrupt at line {k} (rollback line {second}) {err}") from None
    if outcome == "rolled back" and retry:
        run()
        _done(op, w, before)
    return outcome


def settled(op: str, w: World, before: dict[str, torch.Tensor], snap: Snapshot) -> str:
    """The verdict on an interrupted ``op``: "rolled back" (exactly as before, every pool's
    layout consistent) or "done" (fully); an AssertionError naming the mix otherwise."""
    problems = snap.diff()
    if not problems:
        for p in w.pools:
            check_layout(p)
        return "rolled back"
    try:
        _done(op, w, before)
    except AssertionError as err:
        raise AssertionError(
            "left a mix:\n" + "\n".join(problems) + f"\nand not fully done: {err}") from None
    return "done"


@pytest.fixture(scope="module")
def line_counts() -> dict[str, int]:
    return {op: count_lines(op) for op in EVERY_LINE}


@pytest.mark.parametrize("op", list(EVERY_LINE))
def test_interrupt_at_every_line(op: str, line_counts: dict[str, int],
                                 request: pytest.FixtureRequest) -> None:
    slow = bool(request.config.getoption("--slow")) or op in ALLOC_OPS  # those are short
    n = line_counts[op]
    assert n > (20 if op in ALLOC_OPS else 100), f"{op}: only {n} traced lines"
    outcomes: dict[str, int] = {}
    for i, k in enumerate(_positions(n, 24, slow)):
        outcome = interrupt_at(op, k, retry=slow or i % 4 == 0)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(f"{op}: {n} lines, interrupted at {sum(outcomes.values())}: {outcomes}")
    assert outcomes.get("rolled back", 0) > 0, outcomes
    assert outcomes.get("not reached", 0) == 0, outcomes


@pytest.mark.parametrize("op", list(OPS))
def test_second_interrupt_during_rollback(op: str, line_counts: dict[str, int],
                                          request: pytest.FixtureRequest) -> None:
    slow = bool(request.config.getoption("--slow"))
    firsts = _positions(line_counts[op], 2 if not slow else 8, False)
    runs = 0
    for k in firsts:
        n = count_lines_second(op, k)
        for j in _positions(n, 6, slow):
            assert interrupt_at(op, k, second=j, retry=slow) in ("rolled back", "done")
            runs += 1
    print(f"{op}: second interrupts at {runs} rollback lines after {len(firsts)} first ones")


def count_lines_second(op: str, k: int) -> int:
    build, prepare = OPS[op]
    w = build()
    counter = LineTracer(None)
    with _second_interrupt(counter):
        _traced(prepare(w), LineTracer(k))
    return max(counter.lines, 1)


def test_an_interrupt_leaves_no_handler_or_gc_change_behind() -> None:
    """The guard restores the user's SIGINT handler and gc setting exactly, interrupted or not.

    (A handler of the test's own: a process started in the background has SIGINT ignored, so
    Python's default handler is not a given.)"""

    def users_handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, users_handler)
    gc.disable()
    try:
        w = batch_world()
        exc = _traced(lambda: w.pool.adopt(w.targets), LineTracer(50))
        assert exc is not None
        assert not gc.isenabled() and signal.getsignal(signal.SIGINT) is users_handler
    finally:
        gc.enable()
        signal.signal(signal.SIGINT, previous)
