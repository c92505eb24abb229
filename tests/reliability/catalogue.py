"""The catalogue of bad inputs: each row is a call flatpool must refuse with a typed error,
changing nothing.

Every row builds fresh fixtures through a :class:`Ctx` (pools, tensors and holder places it
registers are snapshotted before the call and compared after) and returns the bad call.
``test_bad_inputs.py`` runs every row; ``docs/bad-inputs.md`` holds the table rendered from
these rows, regenerated with ``python -m tests.reliability.catalogue``.
"""

from __future__ import annotations

import functools
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from attrs import define
from torch import nn

import flatpool
from flatpool import AdoptSpec, FlatPool, Holder, Slice
from flatpool.errors import FlatStepWarning
from flatpool.optim import UnsupportedOptimizerError

from .npu_stand_in import Format, npu_formats
from .scenarios import Box, Wrapper, ints, one_rank_mesh

DOC = Path(__file__).resolve().parents[2] / "docs" / "bad-inputs.md"
START, END = "<!-- catalogue:start -->", "<!-- catalogue:end -->"

NOTHING = "nothing changed"


class Ctx:
    """Fresh fixtures for one row; everything registered here is checked for changes."""

    def __init__(self) -> None:
        self.pools: list[FlatPool] = []
        self.tensors: dict[str, torch.Tensor] = {}
        self.places: dict[str, tuple[Any, Any, bool]] = {}
        self.keep: list[Any] = []

    def pool(self, **kw: Any) -> FlatPool:
        kw.setdefault("alignment", 64)
        kw.setdefault("capacity", 4096)
        p = FlatPool(name=f"p{len(self.pools)}", **kw)
        self.pools.append(p)
        return p

    def tensor(self, name: str, t: torch.Tensor) -> torch.Tensor:
        self.tensors[name] = t
        return t

    def adopted(self, pool: FlatPool, name: str, t: torch.Tensor) -> torch.Tensor:
        pool.adopt(t)
        return self.tensor(name, t)

    def slice(self, pool: FlatPool, shape: Any = (4,), dtype: torch.dtype = torch.float32,
              fill: float = 9.0) -> Slice:
        s = pool.allocate(shape, dtype)
        s.tensor().fill_(fill)
        return s

    def dtensor(self, local: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(local, one_rank_mesh(), [Shard(0)], run_check=False)


Call = Callable[[], object]


@define(frozen=True)
class Row:
    id: str
    input: str
    arrange: Callable[[Ctx], Call]
    error: type[BaseException] | None
    """The typed error; a ``Warning`` subclass for an input that is accepted with a warning;
    ``None`` for one that is accepted (the call then asserts its own outcome)."""
    match: str
    """A regex the message must contain (what makes it helpful: the cause or the way out)."""
    guarantee: str = NOTHING
    xfail: str | None = None
    """A known flatpool bug this row exposes (the test is a strict xfail until fixed)."""

    @property
    def accepted(self) -> bool:
        return self.error is None or issubclass(self.error, Warning)


# -- row bodies ----------------------------------------------------------------------------


def _other_device(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", torch.ones(4, device="meta"))
    return lambda: p.adopt(t)


def _meta_readopt(c: Ctx) -> Call:
    p = c.pool()
    box = Box(data=ints(4))
    p.adopt(AdoptSpec(box.data, holders=(Holder(box, "data"),)))
    box.data = torch.empty(4, device="meta")  # what a framework's re-init left there
    c.tensor("meta", box.data)
    c.places["box.data"] = (box, "data", False)
    return lambda: p.readopt()


def _materialize_real(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", ints(4))
    return lambda: p.materialize_into(t)


def _transposed_view(c: Ctx) -> Call:
    p = c.pool()
    base = c.tensor("base", ints(3, 4))
    t = c.tensor("t", base.t())
    return lambda: p.adopt(t)


def _expanded(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", ints(1).expand(4))
    return lambda: p.adopt(t)


def _overlapping_strides(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", torch.empty_strided((3, 2), (1, 1)).fill_(1.0))
    return lambda: p.adopt(t)


def _noncontig_into_slice(c: Ctx) -> Call:
    p = c.pool()
    s = c.slice(p, (3, 4))  # 12 float32 elements
    bad = c.tensor("bad", torch.empty_strided((3, 4), (1, 5)).fill_(2.0))  # spans 18 elements
    return lambda: p.adopt(AdoptSpec(bad, slice=s))


def _zero_size_alloc(c: Ctx) -> Call:
    p = c.pool()
    return lambda: p.allocate((4, 0), torch.float32)


def _zero_size_adopt(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", torch.empty(0))
    return lambda: p.adopt(t)


def _adopted_twice(c: Ctx) -> Call:
    p = c.pool()
    t = c.adopted(p, "t", ints(4))
    return lambda: p.adopt(t)


def _two_pools(c: Ctx) -> Call:
    p, q = c.pool(), c.pool()
    t = c.adopted(p, "t", ints(4))
    return lambda: q.adopt(t)


def _twice_in_batch(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", ints(4))
    return lambda: p.adopt([t, t])


def _overlapping_primaries(c: Ctx) -> Call:
    p = c.pool()
    base = c.tensor("base", ints(8))
    part = c.tensor("part", base[2:6])
    return lambda: p.adopt([base, part])


def _foreign_free(c: Ctx) -> Call:
    p, q = c.pool(), c.pool()
    s = c.slice(q)
    return lambda: p.free(s)


def _foreign_target_slice(c: Ctx) -> Call:
    p, q = c.pool(), c.pool()
    s = c.slice(q)
    t = c.tensor("t", ints(4))
    return lambda: p.adopt(AdoptSpec(t, slice=s))


def _freed_free(c: Ctx) -> Call:
    p = c.pool()
    c.slice(p)
    s = p.allocate(4, torch.float32)
    p.free(s)
    return lambda: p.free(s)


def _freed_tensor(c: Ctx) -> Call:
    p = c.pool()
    s = p.allocate(4, torch.float32)
    p.free(s)
    c.slice(p)  # the range now belongs to another slice
    return lambda: s.tensor()


def _compacted_handle(c: Ctx) -> Call:
    p = c.pool()
    gap = p.allocate(4, torch.float32)
    s = c.slice(p)
    p.free(gap)
    p.compact()  # s moves to offset 0 under a new handle
    return lambda: s.bytes()


def _freed_target_slice(c: Ctx) -> Call:
    p = c.pool()
    s = p.allocate(4, torch.float32)
    c.slice(p, (8,))
    p.free(s)
    t = c.tensor("t", ints(4))
    return lambda: p.adopt(AdoptSpec(t, slice=s))


def _overflow_shape(c: Ctx) -> Call:
    p = c.pool(capacity=None)
    return lambda: p.allocate((1 << 40, 1 << 40), torch.float32)


def _overflow_capacity(c: Ctx) -> Call:
    return lambda: FlatPool(capacity=1 << 70)


def _overflow_grow(c: Ctx) -> Call:
    p = c.pool(capacity=256)
    c.slice(p)
    return lambda: p.grow(1 << 70)


def _unallocatable(c: Ctx) -> Call:
    p = c.pool(capacity=None)
    p.allocate((1 << 58,), torch.uint8)  # planned: fine; no device has 256 PiB
    return lambda: p.materialize()


def _negative_dim(c: Ctx) -> Call:
    p = c.pool()
    return lambda: p.allocate((4, -1), torch.float32)


def _bool_dim(c: Ctx) -> Call:
    p = c.pool()
    return lambda: p.allocate((True, 4), torch.float32)


def _str_dtype(c: Ctx) -> Call:
    p = c.pool()
    return lambda: p.allocate(4, "float32")  # type: ignore[arg-type]


def _dtype_mismatch(c: Ctx) -> Call:
    p = c.pool()
    s = c.slice(p, (4,), torch.float32)
    t = c.tensor("t", torch.arange(4, dtype=torch.int32))
    return lambda: p.adopt(AdoptSpec(t, slice=s))


def _size_mismatch(c: Ctx) -> Call:
    p = c.pool()
    s = c.slice(p, (4,), torch.float32)
    t = c.tensor("t", ints(5))
    return lambda: p.adopt(AdoptSpec(t, slice=s))


def _meta_slice_mismatch(c: Ctx) -> Call:
    p = c.pool()
    s = p.allocate((4,), torch.float16)
    t = c.tensor("t", torch.empty(4, device="meta"))
    return lambda: p.materialize_into(t, [s])


def _backward_hook(c: Ctx) -> Call:
    p = c.pool()
    x = c.tensor("x", torch.ones(3, requires_grad=True))
    victim = c.tensor("victim", ints(4))

    def hook(g: torch.Tensor) -> torch.Tensor:
        p.adopt(victim)
        return g

    x.register_hook(hook)
    return lambda: (x * 2).sum().backward()


def _saved_for_backward(c: Ctx) -> Call:
    p = c.pool()
    w = c.tensor("w", nn.Parameter(ints(4)))
    loss = (w[1:] * w[1:]).sum()  # autograd saved views of w: a pending backward pins it
    c.keep.append(loss)
    return lambda: p.adopt(w)


def _dtensor_local_not_shard(c: Ctx) -> Call:
    p = c.pool()
    shard = ints(4)
    c.tensor("shard", shard)
    w = c.tensor("w", Wrapper(shard))
    w._local_tensor = c.tensor("other", ints(4, start=10))  # no longer the wrapper's shard
    return lambda: p.adopt(w)


def _dtensor_padded_narrow(c: Ctx) -> Call:
    p = c.pool()
    padded = c.tensor("padded", ints(6))
    holder = Box(data=padded)
    dt = c.tensor("dt", c.dtensor(padded.narrow(0, 0, 5)))
    c.places["holder.data"] = (holder, "data", False)
    c.keep.append(holder)
    return lambda: p.adopt(dt)


def _pinned_by_view(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", ints(8))
    v = c.tensor("v", t[2:4])
    c.keep.append(v)
    return lambda: p.adopt(t)


def _view_elsewhere(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", ints(4))
    other = c.tensor("other", ints(4))
    return lambda: p.adopt(AdoptSpec(t, views=(other,)))


def _view_outside(c: Ctx) -> Call:
    p = c.pool()
    base = c.tensor("base", ints(8))
    inner = c.tensor("inner", base[0:4])
    whole = c.tensor("whole", base[0:8])
    return lambda: p.adopt(AdoptSpec(inner, views=(whole,)))


def _bad_holder(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", ints(4))
    box = Box(other=ints(4))
    c.places["box.other"] = (box, "other", False)
    return lambda: p.adopt(AdoptSpec(t, holders=(Holder(box, "other"),)))


def _missing_holder(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", ints(4))
    return lambda: p.adopt(AdoptSpec(t, holders=(Holder(Box(), "nothing"),)))


def _free_adopted(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", ints(4))
    s = p.adopt(t).slices[0]
    return lambda: p.free(s)


def _grow_smaller(c: Ctx) -> Call:
    p = c.pool(capacity=1024)
    c.slice(p)
    return lambda: p.grow(512)


def _grow_pinned(c: Ctx) -> Call:
    p = c.pool(capacity=1024)
    s = c.slice(p)
    c.adopted(p, "t", ints(4))
    kept = c.tensor("kept", s.tensor())  # a view the pool does not know pins its storage
    c.keep.append(kept)
    return lambda: p.grow(2048)


def _flat_mixed(c: Ctx) -> Call:
    p = c.pool()
    c.slice(p, (4,), torch.float32)
    c.slice(p, (4,), torch.int64)
    return lambda: p.flat(torch.float32)


def _on_pinned_typo(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", ints(4))
    return lambda: p.adopt(t, on_pinned="ignore")  # type: ignore[arg-type]


def _not_a_tensor(c: Ctx) -> Call:
    p = c.pool()
    return lambda: p.adopt({"w": ints(4)})  # type: ignore[arg-type]


def _empty_batch(c: Ctx) -> Call:
    p = c.pool()
    return lambda: p.adopt([])


def _readopt_reshaped(c: Ctx) -> Call:
    p = c.pool()
    t = c.adopted(p, "t", ints(4))
    t.data = ints(2, 2)
    return lambda: p.readopt()


def _meta_held_by_graph(c: Ctx) -> Call:
    p = c.pool()
    with torch.device("meta"):
        lin = nn.Linear(4, 3)
        loss = lin(torch.randn(2, 4)).sum()  # a meta forward: the graph holds the bias's impl
    c.keep += [lin, loss]
    c.tensors.update(weight=lin.weight, bias=lin.bias)
    return lambda: p.materialize_into([lin.weight, lin.bias])


def _bad_alignment(c: Ctx) -> Call:
    return lambda: FlatPool(alignment=48)


# -- hostile inputs (each one crashed, lied or raised an untyped error before) ------------------


class MySub(torch.Tensor):
    """A plain Python tensor subclass (``t.as_subclass(MySub)``): shares ``t``'s storage."""


def _two_tensor() -> torch.Tensor:
    from torch.testing._internal.two_tensor import TwoTensor

    return TwoTensor(ints(4), ints(4, start=10))


def _wrapper_subclass(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("two", _two_tensor())
    return lambda: p.adopt(t)


def _wrapper_in_batch(c: Ctx) -> Call:
    p = c.pool()
    good = c.tensor("good", ints(4))
    two = c.tensor("two", _two_tensor())
    return lambda: p.adopt([good, two])


def _functional(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("f", torch._to_functional_tensor(ints(4)))
    return lambda: p.adopt(t)


def _fake(c: Ctx) -> Call:
    from torch._subclasses.fake_tensor import FakeTensorMode

    p = c.pool()
    with FakeTensorMode():
        t = torch.empty(4)
    c.tensor("fake", t)
    return lambda: p.adopt(t)


def _dlpack_export_is_a_view() -> bool:
    """torch 2.7 hands a DLPack consumer a view of its own on the tensor's storage (a C++
    holder of the storage: flatpool names it "held only from C++", and the view keeps the
    original alive); later releases hand it the tensor's own impl, which the move takes along
    (flatpool: "held outside Python", and the pool keeps the original for the consumer)."""
    t = torch.zeros(4)
    storage = t.untyped_storage()
    before = flatpool._torch_compat.storage_users(storage)
    from torch.utils.dlpack import to_dlpack

    capsule = to_dlpack(t)
    after = flatpool._torch_compat.storage_users(storage)
    del capsule
    return after > before


DLPACK_VIEW = _dlpack_export_is_a_view()
DLPACK_PIN = r"held only from C\+\+" if DLPACK_VIEW else r"held outside Python.*DLPack"
"""What names a DLPack consumer's pin on this torch."""


def _dlpack_numpy(c: Ctx) -> Call:
    import numpy

    p = c.pool()
    t = c.tensor("t", torch.full((64,), 5.0))
    c.keep.append(numpy.from_dlpack(t))
    return lambda: p.adopt(t)


def _dlpack_warn(c: Ctx) -> Call:
    import numpy

    p = c.pool()
    t = torch.full((64,), 5.0)
    array = numpy.from_dlpack(t)

    def call() -> None:
        item = p.adopt(t, on_pinned="warn").items[0]
        assert not item.released and item.freed_bytes == 0 and p.owns(t)
        kept = p.unreleased_originals()
        assert len(kept) == 1 and kept[0].kept_by_pool is not DLPACK_VIEW
        t.fill_(1.0)  # the pool copy; the consumer still reads the original
        assert float(array.sum()) == 5.0 * 64

    return call


def _numpy_method(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", torch.full((64,), 5.0))
    c.keep.append(t.numpy())
    return lambda: p.adopt(t)


def _from_numpy(c: Ctx) -> Call:
    import numpy

    p = c.pool()
    array = numpy.full(64, 5.0, dtype=numpy.float32)
    t = torch.from_numpy(array)

    def call() -> None:
        item = p.adopt(t).items[0]
        assert item.external and item.released and item.freed_bytes == 0 and p.owns(t)
        array[:] = 1.0  # numpy's memory, no longer shared with t
        assert float(t.sum()) == 5.0 * 64

    return call


def _frombuffer(c: Ctx) -> Call:
    p = c.pool()
    buf = bytearray(torch.full((16,), 5.0).numpy().tobytes())
    t = torch.frombuffer(buf, dtype=torch.float32)

    def call() -> None:
        report = p.adopt(t)
        assert report.items[0].external and report.freed_bytes == 0 and p.owns(t)
        assert len(buf) == 64

    return call


def _shared_memory(c: Ctx) -> Call:
    p = c.pool()
    t = ints(16).share_memory_()  # what torch.multiprocessing hands to other processes

    def call() -> None:
        item = p.adopt(t).items[0]
        assert item.external and item.freed_bytes == 0 and p.owns(t)

    return call


def _raw_pointer(c: Ctx) -> Call:
    import ctypes

    import numpy

    p = c.pool()
    t = ints(16)
    raw = ctypes.cast(t.data_ptr(), ctypes.POINTER(ctypes.c_float))
    arrays = [numpy.ctypeslib.as_array(raw, shape=(16,))]  # a pointer only: torch knows nothing

    def call() -> None:
        report = p.adopt(t)
        assert report.all_released and p.owns(t)  # undetectable: the array now dangles
        arrays.clear()  # never read it: that would read freed memory

    return call


def _resized(nbytes: int = 0) -> torch.Tensor:
    t = ints(256)
    t.untyped_storage().resize_(nbytes)
    return t


def _resized_storage(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", _resized())
    return lambda: p.adopt(t)


def _resized_in_batch(c: Ctx) -> Call:
    p = c.pool()
    good = c.tensor("good", ints(8))
    base = c.tensor("base", ints(16))
    view = c.tensor("view", base[4:8])
    short = c.tensor("short", _resized(100))  # smaller than its 1024-byte extent
    return lambda: p.adopt([good, AdoptSpec(base, views=(view,)), short])


def _resized_readopt(c: Ctx) -> Call:
    p = c.pool()
    t = c.adopted(p, "t", ints(256))
    t.data = _resized()  # a framework freed the storage it re-materialized into
    return lambda: p.readopt()


def _resized_readopt_spec(c: Ctx) -> Call:
    p = c.pool()
    t = ints(256)
    s = p.adopt(t).slices[0]
    c.keep.append(t)
    u = c.tensor("u", _resized())
    return lambda: p.readopt([AdoptSpec(u, slice=s)])


def _quantized_adopt(c: Ctx) -> Call:
    p = c.pool()
    q = c.tensor("q", torch.quantize_per_tensor(ints(4), 0.5, 0, torch.qint8))
    return lambda: p.adopt(q)


def _quantized_materialize(c: Ctx) -> Call:
    p = c.pool()
    m = c.tensor("m", torch.empty(4, dtype=torch.qint8, device="meta"))
    return lambda: p.materialize_into(m)


def _shell_allocate(c: Ctx) -> Call:
    p = c.pool()
    return lambda: p.allocate(4, torch.uint4)


def _shell_adopt(c: Ctx) -> Call:
    p = c.pool()
    t = torch.empty(4, dtype=torch.uint4)
    c.keep.append(t)  # no kernel reads it, so it is not snapshotted
    return lambda: p.adopt(t)


def _inference_tensor(c: Ctx) -> Call:
    p = c.pool()
    with torch.inference_mode():
        t = torch.ones(4)
    c.tensor("t", t)
    return lambda: p.adopt(t)


def _non_leaf(c: Ctx) -> Call:
    p = c.pool()
    w = c.tensor("w", torch.ones(4, requires_grad=True))
    y = c.tensor("y", w * 2)
    return lambda: p.adopt([y])


def _computed_base_view(c: Ctx) -> Call:
    p = c.pool()
    w = c.tensor("w", torch.ones(4, requires_grad=True))
    y = c.tensor("y", (w * 2)[1:])  # (its computed base, held only as y._base, reaches past it)
    return lambda: p.adopt([y])


def _full_fixed_pool(c: Ctx) -> Call:
    p = c.pool(capacity=256)
    c.adopted(p, "a", ints(32))
    b = c.tensor("b", ints(64))
    return lambda: p.adopt([b])


def _growth_pinned_from_cxx(c: Ctx) -> Call:
    p = c.pool(capacity=None)
    w = c.adopted(p, "w", nn.Parameter(ints(4, 4)))
    u = w.view(16)  # an autograd view the graph saves; nothing in Python names it after this
    c.keep.append((u * u).sum())
    del u
    b = c.tensor("b", ints(256))
    return lambda: p.adopt([b])


def _inference_mode_pool(c: Ctx) -> Call:
    p = c.pool()
    a, b, w = ints(4), ints(8), nn.Parameter(ints(4))
    with torch.device("meta"):
        lin = nn.Linear(2, 2)

    def call() -> None:
        with torch.inference_mode():
            p.adopt(a)  # materializes the pool
            p.compact()
            p.grow(p.capacity + 1024)
            v = p.allocate(4, torch.float32).tensor()
            p.materialize_into([lin.weight, lin.bias])
        p.adopt([b, w])  # outside: the pool's storage is a normal tensor
        assert not p.flat().is_inference() and not v.is_inference()
        assert not lin.weight.is_inference()
        v.add_(1)
        (w * 2).sum().backward()
        nn.init.ones_(lin.weight)
        lin(torch.ones(1, 2)).sum().backward()
        assert w.grad is not None and lin.weight.grad is not None and p.is_valid()

    return call


def _census_mid_relocation(c: Ctx) -> Call:
    from flatpool.testing import set_fault_hook

    p = c.pool()
    t = ints(4)
    p.adopt(t)

    def reader(step: str) -> None:
        if step == "release":  # between the rebinding and the release proof
            assert p.owns(t) and p.is_valid() and p.slice_of(t) is not None
            assert not flatpool.census(t).stale and p.free_bytes >= 0

    def call() -> None:
        set_fault_hook(reader)
        try:
            p.grow(2 * p.capacity)
            p.compact()
        finally:
            set_fault_hook(None)
        assert p.owns(t) and p.is_valid() and not p.unreleased_originals()

    return call


def _gc_disable_mid_adopt(c: Ctx) -> Call:
    import gc

    from flatpool.testing import set_fault_hook

    p = c.pool()
    t = ints(4)

    def call() -> None:
        set_fault_hook(lambda step: gc.disable() if step == "rebind" else None)
        try:
            p.adopt(t)
            assert not gc.isenabled(), "the adoption turned the user's gc.disable() back on"
        finally:
            set_fault_hook(None)
            gc.enable()

    return call


def _census_bad_pools(c: Ctx) -> Call:
    t = c.tensor("t", ints(4))
    return lambda: flatpool.census(t, pools=["p0"])  # type: ignore[list-item]


def _csr(c: Ctx) -> torch.Tensor:
    return c.tensor("csr", torch.eye(3).to_sparse_csr())


def _sparse_adopt(c: Ctx) -> Call:
    p = c.pool()
    t = _csr(c)
    return lambda: p.adopt(t)


def _sparse_byte_range(c: Ctx) -> Call:
    t = _csr(c)
    return lambda: flatpool.byte_range(t)


def _sparse_aliasing(c: Ctx) -> Call:
    t = _csr(c)
    return lambda: flatpool.check_no_aliasing({"w": ints(4), "csr": t})


def _nested_strided(c: Ctx) -> torch.Tensor:
    return c.tensor("nested", torch.nested.nested_tensor([ints(2), ints(3)]))


def _nested_adopt(c: Ctx) -> Call:
    p = c.pool()
    good = c.tensor("good", ints(4))
    t = _nested_strided(c)
    return lambda: p.adopt([good, t])


def _jagged_adopt(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("jagged", torch.nested.nested_tensor([ints(2, 4), ints(3, 4)],
                                                      layout=torch.jagged))
    return lambda: p.adopt(t)


def _nested_byte_range(c: Ctx) -> Call:
    t = _nested_strided(c)
    return lambda: flatpool.byte_range(t)


def _nested_aliasing(c: Ctx) -> Call:
    t = _nested_strided(c)
    return lambda: flatpool.check_no_aliasing([t, ints(2)])


def _nested_allocate_like(c: Ctx) -> Call:
    p = c.pool()
    t = _nested_strided(c)
    return lambda: p.allocate_like(t)


def _mkldnn_adopt(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("mkldnn", ints(4).to_mkldnn())
    return lambda: p.adopt(t)


def _wrapper_byte_range(c: Ctx) -> Call:
    t = c.tensor("two", _two_tensor())
    return lambda: flatpool.byte_range(t)


def _wrapper_aliasing(c: Ctx) -> Call:
    t = c.tensor("two", _two_tensor())
    return lambda: flatpool.check_no_aliasing([t, t.a])  # type: ignore[attr-defined]


class _ReadOnly:
    def __init__(self, t: torch.Tensor) -> None:
        self._t = t

    @property
    def t(self) -> torch.Tensor:
        return self._t


def _holder_read_only(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", ints(4))
    owner = _ReadOnly(t)
    c.places["owner.t"] = (owner, "t", False)
    return lambda: p.adopt(AdoptSpec(t, holders=(Holder(owner, "t"),)))


def _holder_tuple(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", ints(4))
    slots = (t,)
    c.places["slots[0]"] = (slots, 0, True)
    return lambda: p.adopt(AdoptSpec(t, holders=(Holder(slots, 0, item=True),)))


class _Halve(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    def right_inverse(self, y: torch.Tensor) -> torch.Tensor:
        return y / 2


def _holder_parametrized(c: Ctx) -> Call:
    from torch.nn.utils import parametrize

    p = c.pool()
    lin = nn.Linear(3, 2)
    parametrize.register_parametrization(lin, "weight", _Halve())
    c.keep.append(lin)
    c.tensor("original", lin.parametrizations.weight.original)
    c.tensor("bias", lin.bias)
    c.places["parametrizations.weight.original"] = (lin.parametrizations.weight, "original", False)
    return lambda: p.adopt(AdoptSpec(lin.bias, holders=(Holder(lin, "weight"),)))


def _under_fake_mode(c: Ctx) -> Call:
    from torch._subclasses.fake_tensor import FakeTensorMode

    p = c.pool()
    t = c.tensor("t", ints(4))

    def call() -> None:
        with FakeTensorMode():
            p.adopt(t)

    return call


def _in_func_transform(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", ints(4))  # a plain tensor captured from outside the transform

    def loss(w: torch.Tensor) -> torch.Tensor:
        p.adopt(t)
        return (w * 2).sum()

    return lambda: torch.func.grad(loss)(torch.ones(3))


class _Strict(nn.Parameter):
    """A Parameter subclass whose ``__torch_function__`` refuses every function it does not know."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is not torch.Tensor.add:
            raise RuntimeError(f"_Strict does not support {func}")
        return super().__torch_function__(func, types, args, kwargs or {})


def _strict_parameter(c: Ctx) -> Call:
    p = c.pool()
    w = _Strict(ints(4))

    def call() -> None:
        assert p.adopt(w).all_released and p.owns(w) and type(w) is _Strict
        with torch._C.DisableTorchFunctionSubclass():
            assert torch.equal(w, ints(4))

    return call


def _interleaved_strides(c: Ctx) -> Call:
    p = c.pool()
    t = torch.as_strided(ints(8), (2, 3), (3, 2))  # elements 0 2 4 / 3 5 7: none shared
    want = t.clone()

    def call() -> None:
        assert p.adopt(t).all_released and p.owns(t) and t.stride() == (3, 2)
        assert torch.equal(t, want)

    return call


def _as_strided_overlap(c: Ctx) -> Call:
    p = c.pool()
    t = c.tensor("t", torch.as_strided(ints(8), (2, 3), (2, 1)))  # element 2 twice
    return lambda: p.adopt(t)


def _numpy_transient(c: Ctx) -> Call:
    p = c.pool()
    t = ints(16)
    array = t.numpy()
    del array  # the storage stays non-resizable for good

    def call() -> None:
        report = p.adopt(t)
        assert report.items[0].external and report.items[0].released
        assert report.freed_bytes == 0 and p.owns(t)

    return call


def _views_single_tensor(c: Ctx) -> Call:
    t = c.tensor("t", ints(4))
    return lambda: AdoptSpec(t, views=t)  # type: ignore[arg-type]


def _views_0d(c: Ctx) -> Call:
    t = c.tensor("t", ints(4))
    scalar = c.tensor("scalar", torch.tensor(1.0))
    return lambda: AdoptSpec(t, views=scalar)  # type: ignore[arg-type]


def _copy_pool(how: str) -> Callable[[Ctx], Call]:
    def arrange(c: Ctx) -> Call:
        import copy
        import pickle

        p = c.pool()
        c.adopted(p, "t", ints(4))
        return {"pickle": lambda: pickle.dumps(p), "copy": lambda: copy.copy(p),
                "deepcopy": lambda: copy.deepcopy(p)}[how]

    return arrange


def _pickle_slice(c: Ctx) -> Call:
    import pickle

    p = c.pool()
    s = c.slice(p)
    return lambda: pickle.dumps(s)


def _copy_slice(c: Ctx) -> Call:
    import copy

    p = c.pool()
    s = c.slice(p)

    def call() -> None:
        for dup in (copy.copy(s), copy.deepcopy(s), copy.deepcopy({"s": s})["s"]):
            assert dup == s and dup.is_live and torch.equal(dup.tensor(), s.tensor())
        p.free(copy.copy(s))  # the same handle: freeing the copy frees the slice
        assert not s.is_live

    return call


def _bool_tensor_dim(c: Ctx) -> Call:
    p = c.pool()
    return lambda: p.allocate((torch.tensor(True), 4), torch.float32)  # type: ignore[arg-type]


def _huge_alignment(c: Ctx) -> Call:
    return lambda: FlatPool(alignment=1 << 62)


def _as_subclass_held(c: Ctx) -> Call:
    p = c.pool()
    u = c.tensor("u", ints(8))
    v = c.tensor("v", u.as_subclass(MySub))
    return lambda: p.adopt(v)


def _as_subclass_alone(c: Ctx) -> Call:
    p = c.pool()
    v = ints(8).as_subclass(MySub)
    u = ints(8)
    w = u.as_subclass(MySub)

    def call() -> None:
        report = p.adopt([v, AdoptSpec(w, views=(u,))])
        assert report.all_released and p.owns(v) and p.owns(u) and p.owns(w)
        assert type(v) is MySub and torch.equal(v, ints(8))

    return call


def _math_bits(c: Ctx) -> Call:
    """Every way a tensor carries a lazy conj or neg bit, alone and in a batch."""
    z = torch.tensor([1 + 2j, 3 - 4j, -5 + 6j])
    want_conj = z.conj().resolve_conj()
    r = ints(3, start=1)
    want_neg = -r

    def call() -> None:
        p = c.pool()
        conj_view = z.clone().conj()  # its base dropped
        conj_detached = z.clone().conj().detach()  # no base, conj bit on the leaf
        neg_view = r.clone()._neg_view()
        neg_detached = r.clone()._neg_view().detach()
        base = z.clone()
        named = base.conj()
        p.adopt(conj_view)  # alone: the lean path's batch shape
        p.adopt(neg_detached)
        report = p.adopt([conj_detached, neg_view, AdoptSpec(base, views=(named,))])
        assert report.all_released
        for t, want in ((conj_view, want_conj), (conj_detached, want_conj), (named, want_conj),
                        (neg_view, want_neg), (neg_detached, want_neg), (base, z)):
            assert p.owns(t) and torch.equal(t, want), (t, want)
        p.readopt()
        assert torch.equal(conj_view, want_conj) and torch.equal(neg_view, want_neg)

    return call


def _leaf_view_grad(c: Ctx) -> Call:
    b = ints(8)
    v = b[2:6]
    v.requires_grad_(True)
    del b
    calls: list[str] = []
    v.register_hook(lambda g: calls.append("hook"))
    v.register_post_accumulate_grad_hook(lambda t: calls.append("post"))
    v.sum().backward()

    def call() -> None:
        assert c.pool().adopt(v).all_released and v._base is None
        v.sum().backward()
        assert calls == ["hook", "post"] * 2 and v.grad is not None
        assert torch.equal(v.grad, torch.full((4,), 2.0))

    return call


def _shared_counter(c: Ctx) -> Call:
    base = ints(12)
    data, local = base.narrow(0, 0, 12), base.narrow(0, 0, 10)
    del base

    def call() -> None:
        assert c.pool().adopt(AdoptSpec(data, views=(local,))).all_released
        v = data._version
        local.add_(0)
        assert data._version == v + 1  # one counter, as before

    return call


def _readopt_half(c: Ctx) -> Call:
    p = c.pool()
    lin = nn.Linear(2, 2)
    p.adopt([lin.weight, lin.bias])
    lin.half()
    c.keep.append(lin)
    c.tensors.update(weight=lin.weight, bias=lin.bias)
    return lambda: p.readopt()


def _npu_private_format(c: Ctx) -> Call:
    p = c.pool()
    a = c.tensor("a", ints(4))
    nz = c.tensor("nz", ints(4, start=4))

    def call() -> object:
        with npu_formats({nz: Format.FRACTAL_NZ}):
            return p.adopt([a, nz])

    return call


# -- the flat optimizer (flatpool.optim) ----------------------------------------------------


def _flat_setup(c: Ctx, cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
                **kw: Any) -> tuple[nn.Module, torch.optim.Optimizer, FlatPool]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    pool = c.pool()
    for name, p in model.named_parameters():
        c.adopted(pool, name, p)
    return model, cls(model.parameters(), **kw), pool


def _flat_not_optimizer(c: Ctx) -> Call:
    from flatpool.optim import FlatOptimizer

    model, _, pool = _flat_setup(c)
    return lambda: FlatOptimizer(model, [pool])  # type: ignore[arg-type]


def _flat_not_pool(c: Ctx) -> Call:
    from flatpool.optim import FlatOptimizer

    model, opt, _ = _flat_setup(c)
    return lambda: FlatOptimizer(opt, [list(model.parameters())])  # type: ignore[list-item]


def _flat_bad_fused(c: Ctx) -> Call:
    from flatpool.optim import FlatOptimizer

    _, opt, pool = _flat_setup(c)
    return lambda: FlatOptimizer(opt, [pool], fused="yes")  # type: ignore[arg-type]


def _flat_forward_no_module(c: Ctx) -> Call:
    from flatpool.optim import FlatOptimizer

    _, opt, pool = _flat_setup(c)
    return lambda: FlatOptimizer(opt, [pool], verify="forward")


def _flat_unsupported(c: Ctx) -> Call:
    from flatpool.optim import FlatOptimizer

    _, opt, pool = _flat_setup(c, torch.optim.Adagrad)
    return lambda: FlatOptimizer(opt, [pool])


def _flat_twice(c: Ctx) -> Call:
    from flatpool.optim import FlatOptimizer

    model, opt, pool = _flat_setup(c)
    FlatOptimizer(opt, [pool], module=model)
    c.keep.append(opt)
    return lambda: FlatOptimizer(opt, [pool], module=model)


def _flat_opaque_wrapper(c: Ctx) -> Call:
    from flatpool.optim import FlatOptimizer

    model, opt, pool = _flat_setup(c)
    opt.step = functools.partial(opt.step)  # type: ignore[method-assign]
    c.keep.append(opt)
    return lambda: FlatOptimizer(opt, [pool], module=model)


def _flat_clip_sharded(c: Ctx) -> Call:
    from flatpool.optim import FlatOptimizer

    p = nn.Parameter(c.dtensor(ints(4)))
    p.grad = c.dtensor(torch.ones(4))
    c.tensor("grad", flatpool.local_tensor(p.grad))
    with warnings.catch_warnings():  # outside the pools: torch's own step (another row)
        warnings.simplefilter("ignore", FlatStepWarning)
        fo = FlatOptimizer(torch.optim.SGD([p], lr=0.1), [c.pool()])
    c.keep.append(fo)
    return lambda: fo.clip_grad_norm_(1.0, exact=False)


def _flat_outside(c: Ctx) -> Call:
    from flatpool.optim import FlatOptimizer

    model, opt, pool = _flat_setup(c)
    extra = nn.Parameter(torch.ones(2))
    opt.add_param_group({"params": [extra]})
    fo = FlatOptimizer(opt, [pool], module=model)  # notes the reason; the step says it
    extra.grad = torch.ones(2)
    return fo.step


def _flat_half(c: Ctx) -> Call:
    from flatpool.optim import FlatOptimizer

    torch.manual_seed(0)
    model = nn.Linear(3, 2).to(torch.bfloat16)
    pool = c.pool()
    pool.adopt(list(model.parameters()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fo = FlatOptimizer(opt, [pool], module=model)  # notes the reason; the step says it
    model(torch.ones(1, 3, dtype=torch.bfloat16)).sum().backward()
    return fo.step


def _flat_capturable(c: Ctx) -> Call:
    from flatpool.optim import FlatOptimizer

    model, opt, pool = _flat_setup(c, torch.optim.Adam, capturable=True)
    fo = FlatOptimizer(opt, [pool])  # notes the reason; the step says it
    model(torch.ones(1, 3)).sum().backward()

    def step() -> None:
        try:
            fo.step()
        except AssertionError:  # torch's own capturable step refuses CPU, as without flatpool
            pass
    return step


def _flat_sparse(c: Ctx) -> Call:
    from flatpool.optim import FlatOptimizer

    torch.manual_seed(0)
    emb = nn.Embedding(5, 3, sparse=True)
    pool = c.pool()
    pool.adopt(emb.weight)
    opt = torch.optim.SGD(emb.parameters(), lr=0.1)
    FlatOptimizer(opt, [pool], module=emb)
    emb(torch.tensor([1, 3])).sum().backward()
    return lambda: opt.step()


ROWS: tuple[Row, ...] = (
    Row("other-device", "tensor on another device than the pool (a meta tensor into a CPU "
        "pool; a CUDA tensor into a CPU pool takes the same device check)", _other_device,
        flatpool.InvalidRequestError, r"meta tensor|is on .* but pool"),
    Row("meta-readopt", "re-adoption of a tensor a framework turned into a meta tensor",
        _meta_readopt, flatpool.InvalidRequestError, r"meta device.*materialize_into"),
    Row("real-into-materialize", "materialize_into() of a tensor that already has data",
        _materialize_real, flatpool.InvalidRequestError, r"takes meta tensors.*adopt"),
    Row("transposed-view", "a non-contiguous autograd view (t.t()) whose base someone else "
        "holds", _transposed_view, flatpool.PinnedStorageError, r"tensors\['base'\]"),
    Row("expanded", "an expanded/broadcast tensor (overlaps itself, stride 0)", _expanded,
        flatpool.InvalidRequestError, r"overlaps itself"),
    Row("self-overlapping", "an as_strided/empty_strided tensor whose elements overlap",
        _overlapping_strides, flatpool.InvalidRequestError, r"overlaps itself"),
    Row("strided-into-slice", "a strided tensor whose extent does not fit the given slice",
        _noncontig_into_slice, flatpool.InvalidRequestError, r"needs \d+ bytes.*slice \d+ has"),
    Row("zero-size-allocate", "allocate() of a shape with a zero dimension", _zero_size_alloc,
        flatpool.InvalidRequestError, r"holds no bytes"),
    Row("zero-size-adopt", "adopt() of a zero-size tensor", _zero_size_adopt,
        flatpool.InvalidRequestError, r"zero-size"),
    Row("adopted-twice", "adopting a tensor that already lives in this pool", _adopted_twice,
        flatpool.InvalidRequestError, r"already lives in this pool.*readopt"),
    Row("two-pools", "adopting a tensor that lives in another pool", _two_pools,
        flatpool.InvalidRequestError, r"already lives in pool 'p0'"),
    Row("twice-in-batch", "the same tensor twice in one batch", _twice_in_batch,
        flatpool.InvalidRequestError, r"given twice"),
    Row("overlapping-batch", "two overlapping tensors of one storage as separate targets",
        _overlapping_primaries, flatpool.AliasingError, r"share bytes.*views"),
    Row("foreign-free", "free() of a slice of another pool", _foreign_free,
        flatpool.ForeignSliceError, r"belongs to pool 'p1'"),
    Row("foreign-target", "AdoptSpec(slice=...) naming a slice of another pool",
        _foreign_target_slice, flatpool.ForeignSliceError, r"belongs to pool"),
    Row("double-free", "free() of an already freed slice", _freed_free,
        flatpool.FreedSliceError, r"was freed or relocated"),
    Row("freed-tensor", "tensor() of a freed slice whose range was reused", _freed_tensor,
        flatpool.FreedSliceError, r"was freed"),
    Row("compacted-handle", "a handle from before compact()", _compacted_handle,
        flatpool.FreedSliceError, r"relocated; use the handle returned"),
    Row("freed-target", "AdoptSpec(slice=...) naming a freed slice", _freed_target_slice,
        flatpool.FreedSliceError, r"was freed"),
    Row("overflow-shape", "a shape whose byte size overflows int64", _overflow_shape,
        flatpool.InvalidRequestError, r"past \d+ bytes"),
    Row("overflow-capacity", "FlatPool(capacity=2**70)", _overflow_capacity,
        flatpool.InvalidRequestError, r"exceeds"),
    Row("overflow-grow", "grow() to 2**70 bytes", _overflow_grow,
        flatpool.InvalidRequestError, r"exceeds"),
    Row("unallocatable", "materialize() of a plan larger than the device's memory",
        _unallocatable, flatpool.PoolExhaustedError, r"cannot allocate \d+ bytes",
        "pool stays planned, nothing changed"),
    Row("negative-dim", "a negative dimension", _negative_dim,
        flatpool.InvalidRequestError, r"negative dimension"),
    Row("bool-dim", "a bool as a dimension", _bool_dim,
        flatpool.InvalidTypeError, r"bool"),
    Row("str-dtype", "a string where a torch.dtype is needed", _str_dtype,
        flatpool.InvalidTypeError, r"torch\.dtype"),
    Row("dtype-mismatch", "adopting an int32 tensor into an existing float32 slice",
        _dtype_mismatch, flatpool.InvalidRequestError, r"int32.*float32"),
    Row("size-mismatch", "adopting 5 elements into an existing 4-element slice",
        _size_mismatch, flatpool.InvalidRequestError, r"needs 20 bytes"),
    Row("meta-slice-mismatch", "materialize_into() with a slice of another dtype",
        _meta_slice_mismatch, flatpool.InvalidRequestError, r"float32.*float16"),
    Row("during-backward", "adopt() from a backward hook (backward running)", _backward_hook,
        flatpool.AdoptionError, r"backward pass is running"),
    Row("pending-backward", "adopt() of a parameter whose views autograd saved for a pending "
        "backward", _saved_for_backward, flatpool.PinnedStorageError, r"C\+\+",
        "nothing changed; the backward still runs on the original"),
    Row("local-not-shard", "a DTensor-style wrapper whose _local_tensor is not the storage it "
        "wraps", _dtensor_local_not_shard, flatpool.InvalidRequestError,
        r"not its _local_tensor's"),
    Row("padded-local", "a DTensor whose local tensor is a narrow of a padded shard held "
        "elsewhere", _dtensor_padded_narrow, flatpool.PinnedStorageError,
        r"Box.data|autograd view", "nothing changed; the holder is named"),
    Row("pinned-view", "a tensor with a live view nobody named", _pinned_by_view,
        flatpool.PinnedStorageError, r"local variable|autograd view|held",
        "nothing changed; the holder is named"),
    Row("view-elsewhere", "AdoptSpec.views naming a tensor on another storage",
        _view_elsewhere, flatpool.InvalidRequestError, r"does not share its storage"),
    Row("view-outside", "AdoptSpec.views naming a view reaching past the primary",
        _view_outside, flatpool.InvalidRequestError, r"reaches bytes outside"),
    Row("holder-elsewhere", "a Holder whose tensor is on another storage", _bad_holder,
        flatpool.InvalidRequestError, r"does not hold a tensor on its storage"),
    Row("holder-missing", "a Holder naming a missing attribute", _missing_holder,
        flatpool.InvalidRequestError, r"holder Box.nothing"),
    Row("free-adopted", "free() of a slice that backs adopted tensors", _free_adopted,
        flatpool.InvalidRequestError, r"disown"),
    Row("grow-smaller", "grow() below the current capacity", _grow_smaller,
        flatpool.InvalidRequestError, r"compact"),
    Row("grow-pinned", "grow() while a slice.tensor() view is kept", _grow_pinned,
        flatpool.PinnedStorageError, r"old storage", "nothing changed; the holder is named"),
    Row("flat-mixed", "flat(torch.float32) over slices of several dtypes", _flat_mixed,
        flatpool.InvalidRequestError, r"reinterpret"),
    Row("on-pinned-typo", "on_pinned='ignore'", _on_pinned_typo,
        flatpool.InvalidRequestError, r"'raise', 'warn' or 'force'"),
    Row("not-a-tensor", "adopt() of a dict", _not_a_tensor, flatpool.InvalidTypeError,
        r"dict"),
    Row("empty-batch", "adopt([])", _empty_batch, flatpool.InvalidRequestError,
        r"nothing to adopt"),
    Row("readopt-reshaped", "re-adoption of a tensor whose shape changed", _readopt_reshaped,
        flatpool.InvalidRequestError, r"disown\(slice\) and pool.free\(slice\), then adopt"),
    Row("meta-held-by-graph", "materialize_into() of meta parameters a meta forward's graph "
        "still holds", _meta_held_by_graph, flatpool.AdoptionError, r"held outside Python"),
    Row("bad-alignment", "alignment that is not a power of two", _bad_alignment,
        flatpool.InvalidRequestError, r"power of two"),
    # Wrapper subclasses and placeholder storages: copying from them segfaulted.
    Row("wrapper-subclass", "a traceable wrapper subclass without _local_tensor "
        "(torch.testing._internal.two_tensor.TwoTensor): its own storage is a placeholder",
        _wrapper_subclass, flatpool.InvalidTypeError, r"TwoTensor.*\.a, \.b.*inner tensors",
        "nothing changed (it segfaulted in the copy before)"),
    Row("wrapper-in-batch", "a TwoTensor in a batch with a good tensor", _wrapper_in_batch,
        flatpool.InvalidTypeError, r"#1 TwoTensor", "nothing changed, the good tensor included"),
    Row("functional-tensor", "a C++ functional tensor (torch._to_functional_tensor(t))",
        _functional, flatpool.InvalidTypeError, r"functional tensor.*real tensor",
        "nothing changed (it segfaulted before)"),
    Row("fake-tensor", "a FakeTensor (made under FakeTensorMode)", _fake,
        flatpool.InvalidTypeError, r"FakeTensorMode.*no data"),
    # Memory something outside Python points into.
    Row("dlpack-numpy", "a tensor a DLPack consumer reads (numpy.from_dlpack(t))",
        _dlpack_numpy, flatpool.PinnedStorageError, DLPACK_PIN,
        "nothing changed; the consumer keeps reading the original (it read freed memory before)"),
    Row("dlpack-warn", "the same with on_pinned='warn'", _dlpack_warn,
        flatpool.OriginalKeptAliveWarning,
        DLPACK_PIN, "adopted; the original stays alive for the consumer (released=False, "
        "freed_bytes 0; kept_by_pool where the consumer holds the moved tensor itself, torch "
        ">= 2.8) until it lets go"),
    Row("numpy-method", "a tensor whose t.numpy() array is alive", _numpy_method,
        flatpool.PinnedStorageError, r"numpy array of t\.numpy\(\)",
        "nothing changed; the array's base tensor is named"),
    Row("from-numpy", "a torch.from_numpy(array) tensor", _from_numpy,
        flatpool.ExternalMemoryWarning,
        r"no longer shares", "adopted; external=True, freed_bytes 0 (numpy still owns that "
        "memory); the warning says the tensor stops sharing memory with the array"),
    Row("frombuffer", "a torch.frombuffer(bytearray) tensor", _frombuffer,
        flatpool.ExternalMemoryWarning,
        r"no longer shares", "adopted; external=True, freed_bytes 0"),
    Row("shared-memory", "a tensor in shared memory (t.share_memory_(), as torch.multiprocessing "
        "shares it)", _shared_memory, flatpool.ExternalMemoryWarning, r"no longer shares",
        "adopted; external=True, freed_bytes 0 (other processes keep the segment; it was "
        "reported freed before)"),
    Row("raw-pointer", "a consumer holding only t.data_ptr() (ctypes, numpy.ctypeslib.as_array, a "
        "__cuda_array_interface__ consumer that keeps just the address)", _raw_pointer, None, "",
        "**not detectable**: adopted and reported released; the consumer then reads freed memory. "
        "Hand out DLPack (counted) or numpy() arrays (named), or adopt first"),
    # Storages resized below the tensor (FSDP frees unsharded parameters with resize_(0)).
    Row("resized-storage", "a tensor whose storage was resized to 0 bytes "
        "(t.untyped_storage().resize_(0))", _resized_storage, flatpool.InvalidRequestError,
        r"holds only 0 bytes.*resize", "nothing changed (it was adopted with garbage before)"),
    Row("resized-in-batch", "a tensor whose storage is smaller than its extent, in a batch with "
        "good tensors and a view", _resized_in_batch, flatpool.InvalidRequestError,
        r"#2 .*holds only 100 bytes", "nothing changed; the short storage keeps its size (the "
        "rollback grew it before)"),
    Row("resized-readopt", "re-adoption of a bound tensor whose new storage was resized to 0",
        _resized_readopt, flatpool.InvalidRequestError, r"slice \d+ reaches byte .* 0 bytes",
        "nothing changed (it segfaulted in the copy)"),
    Row("resized-readopt-spec", "readopt([AdoptSpec(u, slice=s)]) with u's storage resized to 0",
        _resized_readopt_spec, flatpool.InvalidRequestError, r"holds only 0 bytes"),
    # One dtype rule for every entry point.
    Row("quantized-adopt", "adopt() of a quantized tensor (allocate() refuses its dtype)",
        _quantized_adopt, flatpool.InvalidTypeError, r"quantized dtype torch.qint8.*int_repr"),
    Row("quantized-materialize", "materialize_into() of a meta qint8 tensor",
        _quantized_materialize, flatpool.InvalidTypeError, r"target #0: quantized"),
    Row("shell-dtype-allocate", "allocate(4, torch.uint4): a sub-byte shell dtype without kernels",
        _shell_allocate, flatpool.InvalidTypeError, r"no kernels.*uint8"),
    Row("shell-dtype-adopt", "adopt() of a torch.uint4 tensor (its copy raised NotImplementedError)",
        _shell_adopt, flatpool.InvalidTypeError, r"no kernels"),
    # Inference mode.
    Row("inference-tensor", "adopt() of an inference tensor (made under torch.inference_mode())",
        _inference_tensor, flatpool.InvalidRequestError, r"inference tensor.*clone"),
    Row("non-leaf", "adopt() of a tensor autograd computed (`w * 2` with `w` requiring grad)",
        _non_leaf, flatpool.InvalidRequestError, r"not a leaf of autograd.*MulBackward.*no_grad"),
    Row("computed-base-view", "adopt() of a view inside a computed tensor (`(w * 2)[1:]`, the "
        "computed base held only as its `_base`)", _computed_base_view, flatpool.InvalidRequestError,
        r"view of a computed tensor.*outside.*no_grad",
        "nothing changed; the view keeps its `grad_fn` (it was adopted without one before, cutting "
        "the gradient to `w`)"),
    Row("adopt-full-fixed", "adopt() into a pool made with capacity= that lacks room",
        _full_fixed_pool, flatpool.PoolExhaustedError, r"cannot fit.*without capacity="),
    Row("growth-pinned", "adopt() that grows a default pool while autograd saved a view of its "
        "storage for backward", _growth_pinned_from_cxx, flatpool.PinnedStorageError,
        r"old storage is held by"),
    Row("inference-mode-pool", "a pool materialized by an adoption, compacted, grown, viewed and "
        "materialized into under torch.inference_mode(), then used outside", _inference_mode_pool, None, "",
        "works: the pool's storage is never an inference tensor (a later adoption outside "
        "raised a raw RuntimeError before)"),
    # Readers while a writer relocates; the gc pause.
    Row("census-mid-relocation", "owns/is_valid/slice_of/free_bytes/census() between grow()'s "
        "rebinding and its release proof (a reader holding the lock, here a fault hook)",
        _census_mid_relocation, None, "", "works: readers see the pool after the move and never "
        "pin the old storage (census made grow fail before); see docs/threading.md"),
    Row("gc-disable-mid-adopt", "gc.disable() called while an adoption runs (from a fault "
        "hook; another thread in practice)", _gc_disable_mid_adopt, None, "",
        "the user's setting stands: the pause never touches gc.isenabled()"),
    Row("census-bad-pools", "census(pools=['p0']) (names instead of pools)", _census_bad_pools,
        flatpool.InvalidTypeError, r"takes pools, got str"),
    # Layouts without one strided storage, everywhere.
    Row("sparse-adopt", "adopt() of a sparse CSR tensor", _sparse_adopt,
        flatpool.InvalidTypeError, r"sparse_csr.*to_dense"),
    Row("sparse-byte-range", "byte_range() of a sparse CSR tensor", _sparse_byte_range,
        flatpool.InvalidTypeError, r"sparse_csr"),
    Row("sparse-aliasing", "check_no_aliasing() with a sparse CSR tensor", _sparse_aliasing,
        flatpool.InvalidTypeError, r"csr has layout torch.sparse_csr"),
    Row("nested-adopt", "a strided nested tensor in a batch", _nested_adopt,
        flatpool.InvalidTypeError, r"#1 .*nested tensor.*unbind"),
    Row("jagged-adopt", "a jagged nested tensor (layout=torch.jagged)", _jagged_adopt,
        flatpool.InvalidTypeError, r"nested tensor"),
    Row("nested-byte-range", "byte_range() of a nested tensor", _nested_byte_range,
        flatpool.InvalidTypeError, r"nested tensor"),
    Row("nested-aliasing", "check_no_aliasing() with a nested tensor", _nested_aliasing,
        flatpool.InvalidTypeError, r"\[0\] is a nested tensor"),
    Row("nested-allocate-like", "allocate_like() of a nested tensor", _nested_allocate_like,
        flatpool.InvalidTypeError, r"nested tensor"),
    Row("mkldnn-adopt", "adopt() of an mkldnn tensor", _mkldnn_adopt, flatpool.InvalidTypeError,
        r"_mkldnn.*to_dense"),
    Row("wrapper-byte-range", "byte_range() of a TwoTensor (its placeholder storage says nothing "
        "about its data)", _wrapper_byte_range, flatpool.InvalidTypeError, r"TwoTensor"),
    Row("wrapper-aliasing", "check_no_aliasing([two, two.a]) (answered 'no aliasing' before)",
        _wrapper_aliasing, flatpool.InvalidTypeError, r"\[0\] is a TwoTensor"),
    # Holders and specs.
    Row("holder-read-only", "a Holder naming a read-only property", _holder_read_only,
        flatpool.InvalidTypeError, r"_ReadOnly.t .*cannot be assigned.*read-only property"),
    Row("holder-tuple", "a Holder naming a tuple slot", _holder_tuple,
        flatpool.InvalidTypeError, r"tuple\[0\] .*cannot be assigned"),
    Row("holder-parametrized", "a Holder naming a torch.nn.utils.parametrize module's "
        "parametrized weight, in a refused adoption", _holder_parametrized,
        flatpool.InvalidRequestError, r"ParametrizedLinear.weight .*does not hold a tensor",
        "nothing changed: assignability is judged from the owner's type, without writing (the "
        "write-back ran right_inverse, which replaced the parameter's storage)"),
    Row("fake-mode-active", "adopt() of a real tensor while a FakeTensorMode is active",
        _under_fake_mode, flatpool.InvalidRequestError, r"FakeTensorMode is active.*outside",
        "nothing changed (a raw AssertionError from the mode before)"),
    Row("func-transform", "adopt() inside torch.func.grad (or vmap), of a plain tensor captured "
        "from outside", _in_func_transform, flatpool.InvalidRequestError,
        r"torch.func transform.*before entering", "nothing changed (a raw NotImplementedError "
        "from a TensorWrapper before)"),
    Row("strict-torch-function", "a Parameter subclass whose __torch_function__ refuses every "
        "function it does not know", _strict_parameter, None, "",
        "adopted, class kept: flatpool reads the TensorImpl with __torch_function__ off (one "
        "read bypassed that and failed with the subclass's error before)"),
    Row("interleaved-strides", "a tensor with sizes (2, 3) and strides (3, 2): interleaved, "
        "but no element reached twice", _interleaved_strides, None, "",
        "adopted, strides kept (refused as 'an expanded/broadcast view' before)"),
    Row("as-strided-overlap", "an as_strided view reaching an element twice (sizes (2, 3), "
        "strides (2, 1))", _as_strided_overlap, flatpool.InvalidRequestError,
        r"overlaps itself \(strides \(2, 1\) .*twice"),
    Row("numpy-transient", "a tensor whose t.numpy() array is gone (numpy left its storage "
        "non-resizable)", _numpy_transient, flatpool.ExternalMemoryWarning, r"no longer shares",
        "adopted, original proven dead, but reported external=True, freed_bytes 0 (with a "
        "warning): torch does not say which allocator made a storage, and flatpool reads no raw "
        "memory, so every non-resizable storage counts as another owner's"),
    Row("views-single-tensor", "AdoptSpec(t, views=t) (a tensor, not a sequence)",
        _views_single_tensor, flatpool.InvalidTypeError, r"views=\[t\]"),
    Row("views-0d", "AdoptSpec(t, views=<0-d tensor>)", _views_0d, flatpool.InvalidTypeError,
        r"single tensor"),
    # Copying.
    Row("pickle-pool", "pickle.dumps(pool)", _copy_pool("pickle"), flatpool.InvalidTypeError,
        r"cannot be pickled or copied.*state_dict"),
    Row("copy-pool", "copy.copy(pool)", _copy_pool("copy"), flatpool.InvalidTypeError,
        r"cannot be pickled or copied"),
    Row("deepcopy-pool", "copy.deepcopy(pool)", _copy_pool("deepcopy"), flatpool.InvalidTypeError,
        r"cannot be pickled or copied"),
    Row("pickle-slice", "pickle.dumps(slice)", _pickle_slice, flatpool.InvalidTypeError,
        r"slice \d+ of pool 'p0' cannot be pickled"),
    Row("copy-slice", "copy.copy(slice), copy.deepcopy(slice)", _copy_slice, None, "",
        "the same handle: equal, live, frees the same slice (a copy said 'was freed' before)"),
    # Small things.
    Row("bool-tensor-dim", "torch.tensor(True) as a shape dimension", _bool_tensor_dim,
        flatpool.InvalidTypeError, r"bool dimension"),
    Row("huge-alignment", "alignment=2**62", _huge_alignment, flatpool.InvalidRequestError,
        r"power of two from 1 to \d+ \(1 GiB\)"),
    Row("as-subclass-held", "t.as_subclass(MySub) while t is still referenced", _as_subclass_held,
        flatpool.PinnedStorageError, r"\A(?!.*autograd view).*'u'",
        "nothing changed; the holder of t is named (it was called an autograd view before)"),
    Row("as-subclass", "t.as_subclass(MySub) alone, or with t in AdoptSpec.views",
        _as_subclass_alone, None, "", "adopted, identity and class kept"),
    Row("conj-neg-bits", "tensors read through a lazy conj or neg bit: x.conj() with x "
        "dropped, x.conj().detach(), x._neg_view() (with and without its base), a conj view "
        "named in AdoptSpec.views", _math_bits, None, "",
        "adopted, each reading the same values as before (the bit is kept on the moved tensor; "
        "a conj view read unconjugated values, the others raised a raw RuntimeError or were "
        "called held outside Python before)"),
    Row("leaf-view-grad-hooks", "a leaf autograd view (b[2:6].requires_grad_(), b dropped) "
        "with a .grad, register_hook and register_post_accumulate_grad_hook", _leaf_view_grad,
        None, "", "adopted; its .grad and hooks stay with it (they were lost silently when it "
        "moved off its base)"),
    Row("aliases-version-counter", "aliases sharing a version counter (FSDP2's padded data and "
        "local tensor: two views of a dropped base)", _shared_counter, None, "",
        "adopted; they still share one counter, so autograd sees an in-place write through "
        "either (each had its own before: backward ran on modified values)"),
    Row("readopt-half", "readopt() after module.half()", _readopt_half,
        flatpool.InvalidRequestError, r"disown\(slice\) and pool.free\(slice\), then adopt",
        "nothing changed; following the advice works (test_hostile.py)"),
    Row("npu-private-format", "an NPU tensor whose storage is in a private torch_npu format "
        "(FRACTAL_NZ after npu_format_cast_; run on CPU with a stand-in for "
        "torch_npu.get_npu_format, not yet on an NPU)", _npu_private_format,
        flatpool.NpuFormatError, r"FRACTAL_NZ \(29\).*npu_format_cast\(t, 2\)",
        "nothing changed; ND, NCHW and NCDHW tensors are adopted (test_npu_format.py)"),
    # The flat optimizer.
    Row("optim-not-an-optimizer", "FlatOptimizer(a module, pools)", _flat_not_optimizer,
        flatpool.InvalidTypeError, r"needs a torch.optim.Optimizer"),
    Row("optim-not-a-pool", "FlatOptimizer(opt, [a list of tensors])", _flat_not_pool,
        flatpool.InvalidTypeError, r"pools must be FlatPools"),
    Row("optim-bad-fused", "FlatOptimizer(opt, pools, fused='yes')", _flat_bad_fused,
        flatpool.InvalidTypeError, r"'exact', 'foreach' or 'fused'"),
    Row("optim-forward-no-module", "FlatOptimizer(opt, pools, verify='forward') without module=",
        _flat_forward_no_module, flatpool.InvalidRequestError, r"pass module="),
    Row("optim-unsupported", "an optimizer without a flat rule (Adagrad, LBFGS, a subclass)",
        _flat_unsupported, UnsupportedOptimizerError, r"no flat rule.*optimizer.step\(\)",
        "nothing changed: no gradient or state touched, optimizer.step is torch's"),
    Row("optim-twice", "a second FlatOptimizer on an optimizer one already steps",
        _flat_twice, flatpool.InvalidRequestError, r"close\(\) that one first",
        "nothing changed; the first one keeps stepping"),
    Row("optim-opaque-step-wrapper", "optimizer.step replaced before setup by a callable "
        "holding torch's step other than in a closure (a functools.partial, an object)",
        _flat_opaque_wrapper, flatpool.InvalidRequestError, r"set it after FlatOptimizer",
        "nothing changed; a closure wrapper (a decorator) is kept and wraps the flat step"),
    Row("optim-clip-sharded-inexact", "clip_grad_norm_(exact=False) with DTensor gradients",
        _flat_clip_sharded, flatpool.InvalidRequestError, r"exact=True", "nothing scaled"),
    Row("optim-outside-pools", "a param group with parameters in none of the pools",
        _flat_outside, FlatStepWarning, r"stepped per parameter by torch's own step.*in none "
        r"of the given pools", "accepted: torch's own step steps that group, per parameter; "
        "flat again once they are adopted"),
    Row("optim-half", "float16/bfloat16 parameters", _flat_half, FlatStepWarning,
        r"not bit-identical.*torch's own step runs them",
        "accepted: torch's own step over their pooled state (a flat half-precision step rounds "
        "differently)"),
    Row("optim-capturable", "capturable/differentiable groups, a tensor lr or betas",
        _flat_capturable, FlatStepWarning, r"capturable=True",
        "accepted: torch's own step steps that group"),
    Row("optim-sparse-grad", "a sparse gradient (Embedding(sparse=True))", _flat_sparse,
        FlatStepWarning, r"sparse", "accepted: torch's own step handles the group (SGD steps "
        "it, Adam raises its own RuntimeError)"),
)


# -- the documentation table -------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """The markdown table of the catalogue, as it appears in ``docs/bad-inputs.md``."""
    lines = ["| id | input | error | guarantee |", "| --- | --- | --- | --- |"]
    for r in ROWS:
        guarantee = r.guarantee + (f" (**known bug**: {r.xfail})" if r.xfail else "")
        if r.error is None:
            error = "none (accepted)"
        elif issubclass(r.error, Warning):
            error = f"`{r.error.__name__}` (accepted)"
        else:
            error = f"`{r.error.__name__}`"
        lines.append(f"| `{r.id}` | {_cell(r.input)} | {error} | {_cell(guarantee)} |")
    return "\n".join(lines)


def _section(text: str) -> re.Match[str]:
    m = re.search(re.escape(START) + r"\n(.*?)" + re.escape(END), text, re.S)
    if m is None:
        raise ValueError(f"{DOC} has no {START} ... {END} section")
    return m


def doc_table(text: str) -> str:
    """The table currently in the doc (between the markers)."""
    return _section(text).group(1).rstrip("\n")


def write_doc(path: Path = DOC) -> None:
    text = path.read_text()
    m = _section(text)
    path.write_text(text[: m.start(1)] + render() + "\n" + text[m.end(1):])


if __name__ == "__main__":
    write_doc()
    print(f"wrote {len(ROWS)} rows to {DOC}", file=sys.stderr)
