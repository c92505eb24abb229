"""Doubles of HyperParallel's ``HSDPParamGroup`` comm-fusion paths
(``hyper_parallel/platform/torch/fully_shard/param_group.py``), in two of its three shapes.

* :class:`HSDPParamGroupV1`: one flat buffer per group. ``enable_zero_copy=None`` is the first
  shape (``_init_flat_param_buffer`` called unconditionally in ``__init__`` and re-called by
  ``foreach_all_gather`` whenever ``_is_flat_buffer_valid()`` is false); ``True``/``False`` is
  the second (the same methods, gated by ``self.enable_zero_copy``). Validity compares member 0's
  ``_sharded_param_data.data_ptr()`` with the buffer's. With ``param_dtype`` set the group keeps
  a ``_flat_cast_buffer`` and copies the flat buffer into it before each all-gather.
* :class:`HSDPParamGroupBucketed`: the newest shape. ``all_gather_buckets`` are built at the
  first ``foreach_all_gather`` (one :class:`AllGatherBucket` per (shard group, communication
  dtype)); each bucket's ``init_flat_param_buffer(device)`` packs the *padded* shards, and
  ``is_flat_buffer_valid()`` compares every member's ``_sharded_param_data`` storage pointer.
  A cast happens per all-gather (``flat.to(dtype)``); there is no cast buffer.

Collectives: the double adds one ``all_gather_object`` after every flat-buffer init and
validity call (:func:`agreed`), so an exception on one rank is raised on every rank instead of
leaving the others blocked in the all-gather that follows (HyperParallel has no such step).
The validity call shares every rank's verdict (:func:`agreed_verdicts`): where the ranks differ
(a rank whose fusion failed), HyperParallel re-initializes only the invalid ranks' buffers, and
the double's agreement on that init must still run on every rank, or the double itself would
make the collective mismatch that HyperParallel does not.

Hooks: the flat-buffer methods are looked up on the instance, so a test can subclass, or pass
``init_flat=`` / ``is_valid=`` functions to the constructor (for the bucketed group they are
bound to every bucket, taking ``(bucket, device)`` / ``(bucket,)``). ``calls`` logs every
init/validity call in order, with its result, at the points HyperParallel makes them.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from attrs import define, field

from flatpool import _torch_compat as tc

from .param import HSDPParam, MixedPrecisionPolicy, ShardMesh


@define
class AllGatherMetadata:
    param_input_dtypes: list[list[torch.dtype]]
    param_input_numels: list[list[int]]
    dtype: torch.dtype
    inp_split_sizes: list[int]
    total_input_numel: int


def get_all_gather_metadata(params: Sequence[HSDPParam]) -> AllGatherMetadata:
    dtypes, numels, splits, total, first = [], [], [], 0, None
    for p in params:
        inputs = p.all_gather_inputs
        first = first or inputs[0].dtype
        if inputs[0].dtype != first:
            raise ValueError("All parameters in the group must have a uniform dtype.")
        dtypes.append([t.dtype for t in inputs])
        numels.append([t.numel() for t in inputs])
        splits.extend(numels[-1])
        total += sum(numels[-1])
    assert first is not None
    return AllGatherMetadata(dtypes, numels, first, splits, total)


def all_gather_copy_in(inputs: list[torch.Tensor], output: torch.Tensor, splits: list[int],
                       numel: int, rank: int) -> torch.Tensor:
    mine = output.narrow(0, numel * rank, numel)
    with torch.no_grad():
        torch._foreach_copy_(list(torch.split(mine, splits)), inputs)
    return mine


@torch.no_grad()
def copy_out(params: Sequence[HSDPParam], output: torch.Tensor, metadata: AllGatherMetadata,
             world: int) -> None:
    """Split the gathered rows into each member's all-gather output (dim-0 sharding)."""
    outs = []
    for numels, dtypes, p in zip(metadata.param_input_numels, metadata.param_input_dtypes, params):
        p.all_gather_outputs = [torch.empty(n * world, dtype=d, device=output.device)
                                for n, d in zip(numels, dtypes)]
        outs.extend(p.all_gather_outputs)
    torch.split_with_sizes_copy(output.view(world, -1), metadata.inp_split_sizes, dim=1,
                                out=[o.view(world, -1) for o in outs])


class PeerRankError(RuntimeError):
    """Another rank raised in the same flat-buffer call; this rank stops too."""


def agreed(where: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on every rank; if any rank raised, raise on all (the original on its rank)."""
    return _agreed(where, fn, lambda out: None)[0]


def agreed_verdicts(where: str, fn: Callable[[], bool]) -> list[bool]:
    """:func:`agreed` for a validity call: every rank's verdict, in rank order (one rank's
    verdict alone must not decide a collective that only that rank would then make)."""
    out, verdicts = _agreed(where, lambda: bool(fn()), lambda ok: ok)
    return [out] if verdicts is None else verdicts


def _agreed(where: str, fn: Callable[[], Any], share: Callable[[Any], Any],
            ) -> tuple[Any, list[Any] | None]:
    """``fn()`` here, and ``share(result)`` from every rank (``None`` without a process group)."""
    err: BaseException | None = None
    out = None
    try:
        out = fn()
    except Exception as e:  # re-raised below, after the other ranks heard of it
        err = e
    shared = None
    if dist.is_available() and dist.is_initialized():
        msgs: list[tuple[str | None, Any]] = [(None, None)] * dist.get_world_size()
        mine = (None, share(out)) if err is None else (f"{type(err).__name__}: {err}", None)
        dist.all_gather_object(msgs, mine)
        if err is None and any(m for m, _ in msgs):
            raise PeerRankError(f"{where}: {[(r, m) for r, (m, _) in enumerate(msgs) if m]}")
        shared = [value for _, value in msgs]
    if err is not None:
        raise err
    return out, shared


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _nothing() -> None:
    """What a rank whose flat buffer is valid runs while the others re-initialize theirs."""


def _bind(obj: object, name: str, fn: Callable[..., Any] | None) -> None:
    if fn is not None:
        setattr(obj, name, types.MethodType(fn, obj))


class HSDPParamGroupV1:
    """The one-flat-buffer group (first shape; second with ``enable_zero_copy`` set)."""

    def __init__(self, hsdp_params: list[HSDPParam], mesh: ShardMesh,
                 device: torch.device | None = None, mp_policy: MixedPrecisionPolicy | None = None,
                 enable_zero_copy: bool | None = None, *,
                 init_flat: Callable[[Any], None] | None = None,
                 is_valid: Callable[[Any], bool] | None = None) -> None:
        _bind(self, "_init_flat_param_buffer", init_flat)
        _bind(self, "_is_flat_buffer_valid", is_valid)
        self.calls: list[tuple[str, Any]] = []
        self.hsdp_params = hsdp_params
        self.mesh_info = mesh
        self.device: torch.device = device or torch.device("cpu")
        self.shard_rank: int = mesh.shard_mesh_rank
        self.shard_world_size: int = mesh.shard_mesh_size
        self.shard_group: Any = mesh.shard_process_group
        self.mp_policy: MixedPrecisionPolicy = mp_policy or MixedPrecisionPolicy()
        self.enable_zero_copy = enable_zero_copy
        self.ag_output: torch.Tensor | None = None
        self._metadata: AllGatherMetadata | None = None
        self._result: tuple[torch.Tensor, AllGatherMetadata, Any] | None = None
        self._init_mp_dtypes()
        self._flat_param_buffer: torch.Tensor | None = None
        self._flat_cast_buffer: torch.Tensor | None = None
        if enable_zero_copy is None or enable_zero_copy:
            self._call_init("__init__")

    def _init_mp_dtypes(self) -> None:
        for p in self.hsdp_params:
            p.init_dtype_attrs(self.mp_policy)

    # ---- the two methods a fix replaces ---------------------------------------------------
    def _init_flat_param_buffer(self) -> None:
        if self.shard_world_size <= 1 or not self.hsdp_params:
            return
        if any(p.offload_to_cpu or p.sharded_param.device.type == "meta" for p in self.hsdp_params):
            return  # NB: DTensor.device answers with the *local* tensor's device
        total = sum(p._sharded_param_data.numel() for p in self.hsdp_params)
        dtype = self.hsdp_params[0]._sharded_param_data.dtype
        flat = torch.empty(total, dtype=dtype, device=self.device)
        offset = 0
        for p in self.hsdp_params:
            n = p._sharded_param_data.numel()
            piece = flat.narrow(0, offset, n)
            piece.copy_(p._sharded_param_data)
            p._sharded_param_data = piece
            new_local = piece.view(p.sharded_size)
            req_grad = p.sharded_param.requires_grad
            p.sharded_param._local_tensor = new_local  # type: ignore[attr-defined]
            p.sharded_param.data = new_local
            if req_grad:
                new_local.requires_grad_(True)
                p.sharded_param.requires_grad_(True)
            offset += n
        self._flat_param_buffer = flat
        cast = next((p.param_dtype for p in self.hsdp_params if p.param_dtype is not None), None)
        if cast is not None:
            self._flat_cast_buffer = torch.empty(total, dtype=cast, device=self.device)

    def _is_flat_buffer_valid(self) -> bool:
        if self._flat_param_buffer is None or not self.hsdp_params:
            return False
        return bool(self.hsdp_params[0]._sharded_param_data.data_ptr()
                    == self._flat_param_buffer.data_ptr())

    def _call_init(self, where: str, here: bool = True) -> None:
        """Init the flat buffer on this rank if ``here``; the agreement runs on every rank."""
        if here:
            self.calls.append(("init", where))
        agreed("_init_flat_param_buffer", self._init_flat_param_buffer if here else _nothing)

    def _call_valid(self, where: str) -> list[bool]:
        """Every rank's verdict (this rank's is logged)."""
        self.calls.append(("valid", (where, "raised")))
        verdicts = agreed_verdicts("_is_flat_buffer_valid", self._is_flat_buffer_valid)
        self.calls[-1] = ("valid", (where, verdicts[_rank()]))
        return verdicts

    # ---- all-gather ------------------------------------------------------------------------
    def unshard(self) -> None:
        if self._result is not None:
            return
        if self.shard_world_size == 1:
            raise NotImplementedError("the double models shard world size > 1 only")
        self.foreach_all_gather()

    @torch.no_grad()
    def foreach_all_gather(self) -> None:
        if self._metadata is None:
            self._metadata = get_all_gather_metadata(self.hsdp_params)
        md = self._metadata
        world, rank = self.shard_group.size(), self.shard_group.rank()
        total_out = md.total_input_numel * world
        if self.ag_output is None:
            self.ag_output = torch.empty(total_out, dtype=md.dtype, device=self.device)
        elif self.ag_output.untyped_storage().size() != total_out * self.ag_output.itemsize:
            self.ag_output.untyped_storage().resize_(total_out * self.ag_output.itemsize)
        gated = self.enable_zero_copy is not None
        if not gated or self.enable_zero_copy:
            verdicts = self._call_valid("foreach_all_gather")
            if not all(verdicts):  # (HyperParallel re-inits where invalid: the ranks may differ)
                self._call_init("foreach_all_gather", here=not verdicts[_rank()])
        use_flat = (not gated or bool(self.enable_zero_copy)) and self._flat_param_buffer is not None
        if use_flat:
            assert self._flat_param_buffer is not None
            if self._flat_cast_buffer is not None:
                self._flat_cast_buffer.copy_(self._flat_param_buffer)
                inp = self._flat_cast_buffer
            else:
                inp = self._flat_param_buffer
        else:
            inputs = [t for p in self.hsdp_params for t in p.all_gather_inputs]
            inp = all_gather_copy_in(inputs, self.ag_output, md.inp_split_sizes,
                                     md.total_input_numel, rank)
        self.last_all_gather_input = inp
        handle = tc.all_gather_single(self.ag_output, inp, group=self.shard_group)
        self._result = (self.ag_output, md, handle)

    def wait_for_unshard(self) -> None:
        if self._result is None:
            return
        output, md, _ = self._result
        copy_out(self.hsdp_params, output, md, self.shard_world_size)
        self._result = None
        output.untyped_storage().resize_(0)  # free_all_gather_output
        for p in self.hsdp_params:
            p.init_unsharded_param()
            p.to_unsharded()

    def flat_buffers(self) -> list[torch.Tensor]:
        return [t for t in (self._flat_param_buffer, self._flat_cast_buffer) if t is not None]

    def is_valid(self) -> bool:
        """The group's own validity verdict (what HyperParallel would decide)."""
        return bool(self._is_flat_buffer_valid())


@define(eq=False, slots=False)  # not slotted: hooks are bound on the instance
class AllGatherBucket:
    """One (shard group, communication dtype) bucket of the newest group."""

    hsdp_params: list[HSDPParam]
    shard_group: Any
    shard_rank: int
    shard_world_size: int
    dtype: torch.dtype
    metadata: AllGatherMetadata
    all_gather_result: tuple[torch.Tensor, torch.Tensor, Any] | None = None
    flat_param_buffer: torch.Tensor | None = None
    extra: dict[str, Any] = field(factory=dict)
    """Free space for an injected hook (e.g. flatpool's GroupBuffers)."""

    def init_flat_param_buffer(self, device: torch.device | None) -> None:
        storage_dtype = self.hsdp_params[0]._sharded_param_data.dtype
        if any(p._sharded_param_data.dtype != storage_dtype for p in self.hsdp_params[1:]):
            self.flat_param_buffer = None
            return
        if any(p.offload_to_cpu or p.sharded_param.device.type == "meta" for p in self.hsdp_params):
            self.flat_param_buffer = None
            return
        total = sum(p._sharded_param_data.numel() for p in self.hsdp_params)
        flat = torch.empty(total, dtype=storage_dtype, device=device)
        offset = 0
        for p in self.hsdp_params:
            n = p._sharded_param_data.numel()
            view = flat.narrow(0, offset, n)
            view.copy_(p._sharded_param_data)
            p._sharded_param_data = view
            padded = view.view(p.padded_sharded_param_size)  # AttributeError on "even" members
            local = padded.narrow(p.hsdp_placement.dim, 0, p.sharded_size[p.hsdp_placement.dim])
            req_grad = p.sharded_param.requires_grad
            p.sharded_param._local_tensor = local  # type: ignore[attr-defined]
            p.sharded_param.data = local
            if req_grad:
                local.requires_grad_(True)
                p.sharded_param.requires_grad_(True)
            offset += n
        self.flat_param_buffer = flat

    def is_flat_buffer_valid(self) -> bool:
        if self.flat_param_buffer is None:
            return False
        ptr = self.flat_param_buffer.untyped_storage().data_ptr()
        return all(p._sharded_param_data.untyped_storage().data_ptr() == ptr
                   for p in self.hsdp_params)


class HSDPParamGroupBucketed:
    """The newest group: buckets per (shard group, dtype), padded flat buffer per bucket."""

    def __init__(self, hsdp_params: list[HSDPParam], device: torch.device | None = None,
                 enable_zero_copy: bool = True, *, mp_policy: MixedPrecisionPolicy | None = None,
                 bucket_cls: type[AllGatherBucket] = AllGatherBucket,
                 init_flat: Callable[[Any, Any], None] | None = None,
                 is_valid: Callable[[Any], bool] | None = None) -> None:
        self.hsdp_params = hsdp_params
        self.device: torch.device = device or torch.device("cpu")
        self.enable_zero_copy = enable_zero_copy
        self.mp_policy: MixedPrecisionPolicy = mp_policy or MixedPrecisionPolicy()
        self.bucket_cls = bucket_cls
        self._init_flat_hook = init_flat
        self._is_valid_hook = is_valid
        self.all_gather_buckets: list[AllGatherBucket] = []
        self.calls: list[tuple[str, Any]] = []
        for p in hsdp_params:  # HSDPState._init_mp_dtypes does this in lazy_init upstream
            p.init_dtype_attrs(self.mp_policy)

    def _init_all_gather_buckets(self) -> None:
        by_key: dict[tuple[int, torch.dtype | None], list[HSDPParam]] = {}
        groups: dict[tuple[int, torch.dtype | None], Any] = {}
        for p in self.hsdp_params:
            if p.shard_world_size <= 1:
                continue
            group = p.mesh_info.shard_process_group
            key = (id(group), p.param_dtype or p.orig_dtype)
            by_key.setdefault(key, []).append(p)
            groups[key] = group
        self.all_gather_buckets = []
        for key, params in by_key.items():
            numels = [[p._sharded_param_data.numel()] for p in params]
            splits = [n[0] for n in numels]
            dtype = key[1]
            assert dtype is not None
            md = AllGatherMetadata([[dtype] for _ in params], numels, dtype, splits, sum(splits))
            group = groups[key]
            bucket = self.bucket_cls(params, group, group.rank(), group.size(), dtype, md)
            _bind(bucket, "init_flat_param_buffer", self._init_flat_hook)
            _bind(bucket, "is_flat_buffer_valid", self._is_valid_hook)
            self.all_gather_buckets.append(bucket)

    def unshard(self) -> None:
        if self.all_gather_buckets and any(b.all_gather_result is not None
                                           for b in self.all_gather_buckets):
            return
        self.foreach_all_gather()

    def _valid(self, i: int, bucket: AllGatherBucket, where: str) -> list[bool]:
        """Every rank's verdict on bucket ``i`` (this rank's is logged)."""
        self.calls.append(("valid", (i, where, "raised")))
        verdicts = agreed_verdicts("is_flat_buffer_valid", bucket.is_flat_buffer_valid)
        self.calls[-1] = ("valid", (i, where, verdicts[_rank()]))
        return verdicts

    @torch.no_grad()
    def foreach_all_gather(self) -> None:
        if not self.all_gather_buckets:
            self._init_all_gather_buckets()
        for i, b in enumerate(self.all_gather_buckets):
            if b.all_gather_result is not None:
                continue
            if self.enable_zero_copy:
                verdicts = self._valid(i, b, "before_init")
                here = not verdicts[_rank()]
                if here:
                    self.calls.append(("init", i))
                if not all(verdicts):  # (the agreement runs on every rank; the init where invalid)
                    agreed("init_flat_param_buffer",
                           (lambda: b.init_flat_param_buffer(self.device)) if here else _nothing)
            md = b.metadata
            out = torch.empty(md.total_input_numel * b.shard_world_size, dtype=b.dtype,
                              device=self.device)
            if self.enable_zero_copy and self._valid(i, b, "before_use")[_rank()]:
                assert b.flat_param_buffer is not None
                flat = b.flat_param_buffer
                inp = flat if flat.dtype == b.dtype else flat.to(b.dtype)
            else:
                inputs = [t for p in b.hsdp_params for t in p.all_gather_inputs]
                inp = all_gather_copy_in(inputs, out, md.inp_split_sizes, md.total_input_numel,
                                         b.shard_rank)
            handle = tc.all_gather_single(out, inp, group=b.shard_group)
            b.all_gather_result = (inp, out, handle)

    def wait_for_unshard(self) -> None:
        for b in self.all_gather_buckets:
            if b.all_gather_result is None:
                continue
            _, out, _ = b.all_gather_result
            copy_out(b.hsdp_params, out, b.metadata, b.shard_world_size)
            b.all_gather_result = None
        for p in self.hsdp_params:
            p.init_unsharded_param()
            p.to_unsharded()

    def flat_buffers(self) -> list[torch.Tensor]:
        return [b.flat_param_buffer for b in self.all_gather_buckets
                if b.flat_param_buffer is not None]

    def is_valid(self) -> bool:
        return bool(self.all_gather_buckets) and all(
            bool(b.is_flat_buffer_valid()) for b in self.all_gather_buckets)


__all__ = ["AllGatherBucket", "AllGatherMetadata", "PeerRankError", "agreed", "agreed_verdicts", "HSDPParamGroupBucketed", "HSDPParamGroupV1",
           "all_gather_copy_in", "copy_out", "get_all_gather_metadata"]
