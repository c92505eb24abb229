"""``adopt_group``: the hook a fusion group calls to move its shards into one pool per dtype.

Done by hand, original storages survive whenever a holder is missed; :meth:`FlatPool.adopt`
rebinds every named holder and proves each original died. Members are bucketed by dtype in
group order and packed without gaps (``alignment=1``), so the flat buffer is the
concatenation the group's split sizes describe.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from attrs import define, field

from flatpool import AdoptSpec, FlatPool, Holder, InvalidRequestError, OnPinned, Slice
from flatpool import _torch_compat as tc
from flatpool._devices import DeviceLike, resolve_device
from flatpool._gcpause import gc_paused
from flatpool._interrupts import guarded_call
from flatpool.ownership import adopt_many

from ._kept import KeptAlive
from .layout import Bucket, MemberLayout
from .members import data_all, data_of, impl_device, impl_size
from .members import local_of, member_name, padded_size, shard_dim
from ._protocol import ShardedParam
from ._wrappers import WrapperKinds


@define(frozen=True)
class GroupBuffers:
    """What :func:`adopt_group` did for one group (``skipped``: why nothing was touched)."""

    buckets: tuple[Bucket, ...] = ()
    skipped: str | None = None
    freed_bytes: int = 0
    """Bytes of original shard storages proven released by the adoption."""
    wrapper_kinds: WrapperKinds = field(factory=WrapperKinds, eq=False, repr=False)
    """The per-step check's cache of member wrappers."""
    kept: KeptAlive = field(factory=KeptAlive, eq=False, repr=False)
    """Originals a fail-safe (``on_pinned="warn"``) fusion left alive, until they die."""
    final: bool = False
    """Skipped for good: the reason is the group's structure (:func:`structural_skip`), which
    never changes, so the hooks never try it again."""

    @property
    def adopted(self) -> bool:
        return self.skipped is None

    @property
    def kept_alive(self) -> int:
        """How many original shard storages this group's fusion keeps alive now."""
        return self.kept.refresh()

    def __repr__(self) -> str:
        if not self.adopted:
            return f"GroupBuffers(skipped={self.skipped!r})"
        parts = [f"{str(b.dtype).replace('torch.', '')}: {len(b.members)} members, "
                 f"{b.pool.capacity} bytes" for b in self.buckets]
        kept = f", {len(self.kept)} original(s) kept alive" if len(self.kept) else ""
        return f"GroupBuffers([{'; '.join(parts)}], freed_bytes={self.freed_bytes}{kept})"

    def flats(self) -> list[torch.Tensor]:
        """One 1-D tensor per bucket over its whole pool: zero-copy all-gather inputs."""
        return [b.flat() for b in self.buckets]

    def bucket(self, dtype: torch.dtype) -> Bucket:
        for b in self.buckets:
            if b.dtype == dtype:
                return b
        raise InvalidRequestError(
            f"no bucket of {dtype} (have {[str(b.dtype) for b in self.buckets]})")

    def pools(self) -> list[FlatPool]:
        return [b.pool for b in self.buckets]


def structural_skip(params: Sequence[ShardedParam], world_size: int | None) -> str | None:
    """Why a group can never be fused (fixed when the group is made), or ``None``."""
    if not params:
        return "empty group: nothing to fuse"
    if world_size is not None and world_size <= 1:
        return f"shard world size is {world_size}: nothing is all-gathered, a flat buffer buys nothing"
    if any(p.offload_to_cpu for p in params):
        return "CPU offload: shards stay on the host and are copied per parameter anyway"
    return None


def skip_reason(
    params: Sequence[ShardedParam], world_size: int | None,
    data: Sequence[torch.Tensor] | None = None,
) -> str | None:
    """Why a group must not be fused now (HyperParallel's skip cases), or ``None``."""
    final = structural_skip(params, world_size)
    if final is not None:
        return final
    data = data_all(params) if data is None else data
    with tc.no_torch_function():
        meta = [i for i, (d, p) in enumerate(zip(data, params))
                if tc.impl_is_meta(d) or tc.impl_is_meta(local_of(p.sharded_param))]
    if meta:
        return (
            f"{len(meta)} member(s) have meta shards (deferred init): use materialize_group() "
            "to allocate them in the pool, or call adopt_group()/readopt_group() after to_empty()")
    return None


def _size(shape: object) -> torch.Size:
    """``shape`` as a ``torch.Size``, shared when it is one already (immutable)."""
    return shape if type(shape) is torch.Size else torch.Size(shape)  # type: ignore[arg-type]


def layout_of(
    p: ShardedParam, index: int, offset: int, slc: Slice | None = None,
    padded: torch.Size | None = None, size: torch.Size | None = None,
) -> MemberLayout:
    """Where member ``p`` goes, checking its padded data is what the protocol says."""
    if size is None:
        size = impl_size(data_of(p, index))
    if padded is None:
        padded = padded_size(p, index)
    numel = math.prod(padded)
    if len(size) != 1 or size[0] != numel:
        raise InvalidRequestError(
            f"member {index}: _sharded_param_data must be 1-D with {numel} elements "
            f"(padded size {tuple(padded)}), got shape {tuple(size)}")
    orig = getattr(p, "_orig_size", None)
    # The *global* shape is wanted here, which is what a DTensor's Python ``shape`` answers.
    orig_size = _size(orig) if orig is not None else torch.Size(p.sharded_param.shape)
    return MemberLayout(index=index, offset=offset, numel=size[0], padded_size=padded,
                        sharded_size=_size(p.sharded_size), orig_size=orig_size,
                        shard_dim=shard_dim(p), slice=slc)


def adopt_spec(p: ShardedParam, slc: Slice | None = None) -> AdoptSpec:
    """How one member moves: the padded data is the primary and the parameter a view (its
    object kept); ``_sharded_param_data`` is remembered as a holder for re-adoption."""
    return AdoptSpec(p._sharded_param_data, views=(p.sharded_param,),
                     holders=(Holder(p, "_sharded_param_data"),), slice=slc)


def bucket_members(
    params: Sequence[ShardedParam], data: Sequence[torch.Tensor] | None = None,
) -> dict[torch.dtype, list[int]]:
    """Member indices per dtype of the padded data, first-seen dtype first, in group order."""
    data = data_all(params) if data is None else data
    with tc.no_torch_function():
        dtypes = list(map(tc.impl_dtype_of, data))
    if len(set(dtypes)) == 1:
        return {dtypes[0]: list(range(len(dtypes)))}
    out: dict[torch.dtype, list[int]] = {}
    for i, dt in enumerate(dtypes):
        out.setdefault(dt, []).append(i)
    return out


@define(frozen=True)
class GroupRequest:
    """One group for :func:`adopt_groups`: its members and :func:`adopt_group`'s arguments."""

    params: Sequence[ShardedParam]
    device: DeviceLike | None = None
    world_size: int | None = None
    name: str = "group"
    kept: KeptAlive | None = None
    """The tracker to record into (a re-planned group keeps its old one)."""


def adopt_group(
    params: Sequence[ShardedParam],
    *,
    device: DeviceLike | None = None,
    world_size: int | None = None,
    alignment: int = 1,
    name: str = "group",
    on_pinned: OnPinned = "raise",
    kept: KeptAlive | None = None,
) -> GroupBuffers:
    """Move a group's shards (in all-gather order) into one pool per dtype, all or nothing.

    Skips (``skipped`` set, nothing touched) an empty group, ``world_size <= 1``, CPU offload
    or meta shards. ``alignment=1`` packs members so the flat buffer matches the group's
    split sizes; under ``on_pinned="warn"`` a pinned original is kept alive in ``kept``.
    """
    request = GroupRequest(list(params), device, world_size, name, kept)
    return adopt_groups([request], alignment=alignment, on_pinned=on_pinned)[0]


def adopt_groups(groups: Sequence[GroupRequest], *, alignment: int = 1,
                 on_pinned: OnPinned = "raise") -> list[GroupBuffers]:
    """:func:`adopt_group` for several groups in one transaction over all their pools."""
    # the gc pause is taken and let go with signals deferred (a Ctrl-C there would leave the
    # process's gc paused)
    return guarded_call(lambda: _adopt_groups(groups, alignment, on_pinned), gc_paused())


def _adopt_groups(groups: Sequence[GroupRequest], alignment: int,
                  on_pinned: OnPinned) -> list[GroupBuffers]:
    out: list[GroupBuffers | None] = []
    planned: list[tuple[int, list[ShardedParam], list[BucketPlan]]] = []
    for g in groups:
        params = list(g.params)
        final = structural_skip(params, g.world_size)
        if final is not None:
            out.append(GroupBuffers(skipped=final, final=True))
            continue
        data = data_all(params)
        reason = skip_reason(params, g.world_size, data)
        if reason is not None:
            out.append(GroupBuffers(skipped=reason))
            continue
        dev = resolve_device(g.device) if g.device is not None else impl_device(data[0])
        planned.append((len(out), params, plan_buckets(params, dev, alignment, g.name, data)))
        out.append(None)

    # One transaction over every bucket's pool: all of them adopted, or every member as it was.
    reports = iter(adopt_many([(pool, _specs(params, layouts))
                               for _, params, plans in planned for _, pool, layouts in plans],
                              on_pinned=on_pinned))
    for i, params, plans in planned:
        given = groups[i].kept
        kept = given if given is not None else KeptAlive()
        freed = 0
        for _, pool, layouts in plans:
            report = next(reports)
            freed += report.freed_bytes
            if report.items and not report.all_released:  # something kept alive: name its members
                kept.note(pool, report, [member_name(params[m.index], m.index)
                                         for m in layouts if m.slice is not None])
        buckets = tuple([Bucket(dtype, pool, tuple(layouts)) for dtype, pool, layouts in plans])
        out[i] = GroupBuffers(buckets=buckets, freed_bytes=freed, kept=kept)
    done = [b for b in out if b is not None]
    assert len(done) == len(out)
    return done


def _specs(params: Sequence[ShardedParam], layouts: list[MemberLayout]) -> list[AdoptSpec]:
    """:func:`adopt_spec` of each member with a slice."""
    return [adopt_spec(params[m.index], m.slice) for m in layouts if m.slice is not None]


BucketPlan = tuple[torch.dtype, FlatPool, list[MemberLayout]]


def plan_buckets(
    params: Sequence[ShardedParam], device: torch.device, alignment: int, name: str,
    data: Sequence[torch.Tensor] | None = None,
) -> list[BucketPlan]:
    """One planned pool per dtype, a slice per member in group order (a member with no
    element gets none: its place in the flat buffer has no width)."""
    data = data_all(params) if data is None else data
    plans: list[BucketPlan] = []
    for dtype, indices in bucket_members(params, data).items():
        # One dtype: max(alignment, itemsize) gives the same layout, placed in one step.
        pool = FlatPool(device, alignment=max(alignment, dtype.itemsize),
                        name=f"{name}/{str(dtype).replace('torch.', '')}")
        padded = [padded_size(params[i], i) for i in indices]
        with tc.no_torch_function():
            sizes = [tc.impl_size(data[i]) for i in indices]
        counts = list(map(math.prod, padded))
        item = dtype.itemsize
        slices = iter(pool.allocate_many([(tuple(shape), dtype)
                                          for shape, n in zip(padded, counts) if n]))
        end = 0  # (the pool is new: a member with no element before the first slice sits at 0)
        layouts = []
        for i, shape, n, size in zip(indices, padded, counts, sizes):
            if not n:
                layouts.append(layout_of(params[i], i, end // item, padded=shape, size=size))
                continue
            slc = next(slices)
            end = slc.offset + n * item
            layouts.append(layout_of(params[i], i, slc.offset // item, slc, shape, size))
        plans.append((dtype, pool, layouts))
    return plans


__all__ = [
    "BucketPlan", "GroupBuffers", "GroupRequest", "adopt_group", "adopt_groups", "adopt_spec",
    "bucket_members",
    "layout_of", "plan_buckets", "skip_reason", "structural_skip",
]
