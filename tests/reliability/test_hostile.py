"""Hostile inputs whose check needs more than one catalogue row: following an error's advice,
and outcomes on several objects at once. The crash cases are in ``test_hostile_crash.py``, the
readers and the gc pause in ``test_relocation_readers.py``, the dtype rule in
``test_dtype_agreement.py``; every input is also a row of ``catalogue.py``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from flatpool import AdoptSpec, FlatPool, InvalidRequestError

from .scenarios import ints


def test_readopt_after_half_follow_the_advice() -> None:
    """The error after ``module.half()`` advised ``free()``, which then refused until
    ``disown()``: the advice now names both, in order, and following it works."""
    pool = FlatPool(alignment=64)
    lin = nn.Linear(3, 2)
    pool.adopt([lin.weight, lin.bias])
    lin.half()
    with pytest.raises(InvalidRequestError) as info:
        pool.readopt()
    message = str(info.value)
    assert "pool.disown(slice) and pool.free(slice), then adopt it anew" in message
    for slc in pool.moved():  # what the message tells the user to do, step by step
        pool.disown(slc)
        pool.free(slc)
    assert pool.slices() == ()
    pool.grow(pool.capacity + 1024)  # with `info` alive: its traceback must not pin the pool
    report = pool.adopt([lin.weight, lin.bias])
    assert report.all_released and pool.is_valid()
    assert lin.weight.dtype == torch.float16 and pool.owns(lin.weight)
    lin(torch.ones(1, 3, dtype=torch.float16)).sum().backward()


def test_resized_storage_in_a_batch_never_grows() -> None:
    """A batch holding a storage resized to 0 used to adopt it (reading garbage) and, when the
    batch failed later, roll it back by growing the original storage to its old size. Now it is
    refused before anything moves, on the lean path (plain tensors) and the general one."""
    pool = FlatPool(alignment=64)
    good, other = ints(8), ints(4)
    short = ints(256)
    short.untyped_storage().resize_(0)
    for targets in ([good, short, other], [AdoptSpec(good, views=(good[1:3],)), short]):
        with pytest.raises(InvalidRequestError, match="holds only 0 bytes"):
            pool.adopt(targets)
        assert short.untyped_storage().nbytes() == 0
        assert pool.slices() == () and not pool.owns(good) and torch.equal(good, ints(8))


def test_slice_copies_are_the_same_handle_across_relocation() -> None:
    """A copied handle compared equal but raised "was freed"; copies now follow the handle's
    life: live until its slice is freed or relocated, then refused like the original."""
    pool = FlatPool(alignment=64, capacity=1024)
    gap = pool.allocate(4, torch.float32)
    s = pool.allocate(4, torch.float32)
    dup = copy.deepcopy(s)
    assert dup is s and copy.copy(s) is s
    pool.free(gap)
    mapping = pool.compact()
    assert not dup.is_live and mapping[s.slice_id].is_live


def test_a_finalizers_free_inside_a_refused_adopt_stays_done() -> None:
    """``weakref.finalize(obj, pool.free, s)`` run by the gc pass inside an adoption (explaining
    a pin) freed ``s``; the adoption's rollback then restored the layout from before and the
    slice was live again, leaked. A free by anyone else during an operation now stands."""
    import gc
    import weakref

    import flatpool

    pool = FlatPool(alignment=64, capacity=4096)
    s = pool.allocate((4,), torch.float32)
    other = pool.allocate((4,), torch.float32)

    class Cycle:
        pass

    was = gc.isenabled()
    gc.disable()  # the cycle is left for the adoption's own gc pass
    try:
        obj = Cycle()
        obj.me = obj  # type: ignore[attr-defined]
        done = weakref.finalize(obj, pool.free, s)
        del obj
        t = ints(4)
        pin = t[1:]  # pinned: the adoption explains the pin (a gc pass), then rolls back
        with pytest.raises(flatpool.PinnedStorageError):
            pool.adopt(t)
    finally:
        if was:
            gc.enable()
    assert not done.alive, "the finalizer did not run inside the adoption"
    assert not s.is_live and pool.slices() == (other,) and not pool.owns(t)
    assert pool.allocate((4,), torch.float32).offset == s.offset  # its bytes are free again
    del pin
