"""Type-checked (never run by pytest): the public API used the way sharding code uses it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from flatpool import (
    AdoptSpec,
    AliasingError,
    FlatPool,
    Holder,
    PoolExhaustedError,
    Slice,
    byte_range,
    check_no_aliasing,
    live_pools,
    overlaps,
    same_storage,
)


def plan_shards(
    shapes: Mapping[str, torch.Size], dtype: torch.dtype
) -> tuple[FlatPool, dict[str, Slice]]:
    """One pool per bucket; slices planned from shapes (real or meta)."""
    pool = FlatPool("cpu", alignment=512, name="bucket0")
    slices = {name: pool.allocate(shape, dtype) for name, shape in shapes.items()}
    return pool, slices


def plan_like(tensors: Sequence[torch.Tensor]) -> list[Slice]:
    pool = FlatPool(device=torch.device("cpu"))
    return [pool.allocate_like(t) for t in tensors]


def bind(pool: FlatPool, slices: Mapping[str, Slice]) -> dict[str, torch.Tensor]:
    pool.materialize()
    views = {name: slc.tensor() for name, slc in slices.items()}
    check_no_aliasing(views)
    check_no_aliasing(list(views.values()))
    return views


def owner_of(pool: FlatPool, t: torch.Tensor) -> int:
    slc = pool.slice_of(t)
    if slc is None:
        return -1
    return byte_range(t).start - slc.offset


def all_gather_input(pool: FlatPool) -> torch.Tensor:
    flat: torch.Tensor = pool.flat()
    raw: torch.Tensor = pool.flat(torch.uint8)
    assert same_storage(flat, raw) and overlaps(flat, raw)
    return flat


def try_allocate(pool: FlatPool, n: int) -> Slice | None:
    try:
        return pool.allocate((n,), torch.float32)
    except PoolExhaustedError as err:
        needed: int = err.requested - err.largest_free
        assert needed > 0
        return None


def release(pool: FlatPool, slc: Slice) -> None:
    with pool.lock:
        if slc.is_live:
            pool.free(slc)


def offenders(tensors: dict[str, torch.Tensor]) -> tuple[tuple[str, str], ...]:
    try:
        check_no_aliasing(tensors)
    except AliasingError as err:
        return err.offenders
    return ()


def shapes_of(pool: FlatPool) -> list[tuple[int, ...]]:
    return [s.shape for s in pool.slices() if s.dtype.is_floating_point]


def grow_the_pool_of(slc: Slice, spec_views: list[torch.Tensor], lin: torch.nn.Linear) -> int:
    """A slice's pool is the public FlatPool: its whole API is there."""
    slc.pool.grow(slc.pool.capacity * 2)
    report = slc.pool.adopt([AdoptSpec(lin.weight, views=spec_views,
                                       holders=[Holder(lin, "weight")])])
    assert report.all_released
    return len(slc.pool.slices())


def pool_names() -> list[str]:
    return [pool.name for pool in live_pools()]
