"""FSDP2 reduce-scatters each group's gradients straight into its gradient pool.

FSDP2's reduce-scatter output is one flat tensor per group and every ``.grad`` it makes is an
``as_strided`` view of it at an *absolute* storage offset (``foreach_reduce``). A group's
gradient pool has its parameter pool's offsets, and a fused group's pool packs the members'
padded shards in FSDP2's order from byte 0 without gaps: so the gradient pool, viewed flat from
storage offset 0, *is* a valid reduce-scatter output, and FSDP2's own ``.grad`` views are the
pooled gradients (no zeroing, no per-member ``add_``, no transient output). The hand-out goes
through the public ``FSDPModule.set_custom_reduce_scatter``; the collective itself and every
other buffer are torch's ``DefaultReduceScatter``'s. Where any condition fails, the output is
torch's fresh buffer and the step copies the gradients into the pool (exact, not zero-copy).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from attrs import define
from torch.distributed.fsdp import FSDPModule

from flatpool import _torch_compat as tc
from flatpool._warn import logger, warn
from flatpool.errors import FlatStepWarning
from flatpool.optim import FlatOptimizer

from .members import padded_size

if TYPE_CHECKING:
    from .fsdp2 import FusedModule


def _static_reason(group: Any, default: type) -> str | None:
    """Why a group's gradients cannot be reduce-scattered into its pool at all, or ``None``."""
    comm = tc.fsdp_group_reduce_scatter_comm(group)
    if isinstance(comm, _IntoPool) and comm._fo.closed:  # a closed flat optimizer's: ours
        comm = comm._default
    if type(comm) is not default:
        return (f"a custom reduce-scatter is set ({type(comm).__name__}): it stays, and the "
                "gradients are added into the pooled .grad")
    if tc.fsdp_group_is_hsdp(group):
        return "HSDP's replicate dimension all-reduces FSDP2's own output after the reduce-scatter"
    mp = getattr(group, "mp_policy", None)
    dtypes = {p.sharded_param.dtype for p in group.fsdp_params}
    for name in ("param_dtype", "reduce_dtype"):
        d = getattr(mp, name, None)
        if d is not None and dtypes - {d}:
            return f"MixedPrecisionPolicy({name}={d}) reduces in another dtype and casts"
    if type(getattr(group, "offload_policy", None)).__name__ == "CPUOffloadPolicy":
        return "CPU offload copies FSDP2's output to the CPU"
    return None


class _IntoPool:
    """One group's reduce-scatter: its output is the group's gradient pool when that is exact.

    FSDP2 calls ``allocate`` twice per reduction: the input (world x output elements), then,
    inside its reduce-scatter stream context, the output. The pool is allocated there by torch's
    caching allocator on that current stream, as FSDP2's own output would be.
    """

    def __init__(self, fo: FlatOptimizer, fused: FusedModule, index: int, default: Any) -> None:
        self._fo, self._fused, self._index, self._default = fo, fused, index, default
        self._expect: int | None = None
        """Elements of the output expected next (set by the input's allocation)."""
        self._layout: tuple[tuple[Any, int | None, int], _Layout] | None = None
        """FSDP2's layout as last read: for (pool, storage, the optimizer's replans)."""
        self._said: set[str] = set()
        self.handed = 0
        """How many reduce-scatters wrote into the gradient pool (for tests and benchmarks)."""

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        numel = math.prod(size)
        expect, self._expect = self._expect, None
        if expect is not None and numel == expect:
            try:
                out = self._output(numel, dtype, torch.device(device))
            except Exception as e:  # inside FSDP2's backward: never break what plain FSDP2 trains
                self._say(f"handing out the gradient pool failed ({type(e).__name__}: {e})")
                out = None
            if out is not None:
                self.handed += 1
                return out
        else:
            world = max(1, int(getattr(self._group.mesh_info, "shard_mesh_size", 1)))
            self._expect = numel // world
        made: torch.Tensor = self._default.allocate(size, dtype=dtype, device=device)
        return made

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 op: Any, async_op: bool = False) -> Any:
        return self._default(output_tensor, input_tensor, group, op, async_op)

    @property
    def _group(self) -> Any:
        return self._fused.groups[self._index]

    def _output(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        fo = self._fo
        if fo.closed:
            return None
        buf = self._fused.buffers[self._index]
        if not buf.adopted or len(buf.buckets) != 1:
            return None
        bucket = buf.buckets[0]
        if bucket.dtype != dtype or bucket.pool.device != device:
            return None
        layout = self._fsdp_layout(bucket.pool, dtype)
        why = fo.check_collective_output(bucket.pool, layout.params, layout.offsets)
        if why is not None:
            self._say(why)
            return None
        if layout.numel != numel:
            return None
        return fo.collective_output(bucket.pool, layout.params, layout.offsets, numel, dtype)

    def _fsdp_layout(self, pool: Any, dtype: torch.dtype) -> _Layout:
        """FSDP2's parameters of the group and their padded shards' byte offsets packed from
        byte 0 (per-member work: read again only for a new pool, storage or plan; the same
        tuples let the optimizer reuse its check)."""
        key = (pool, pool.storage_key, self._fo.replans)
        have = self._layout
        if have is not None and have[0][0] is pool and have[0][1:] == key[1:]:
            return have[1]
        params = self._group.fsdp_params
        offsets, at = [], 0
        for k, p in enumerate(params):
            offsets.append(at * dtype.itemsize)
            at += padded_size(p, k).numel()
        found = _Layout(tuple(p.sharded_param for p in params), tuple(offsets), at)
        self._layout = (key, found)
        return found

    def _say(self, why: str) -> None:
        if why not in self._said:
            self._said.add(why)
            warn(f"fsdp{self._index}: FSDP2 reduce-scatters into its own buffer and the step "
                 f"copies the gradients into the pool: {why}", FlatStepWarning, past_torch=True)


@define(frozen=True)
class _Layout:
    """A group's reduce-scatter output as FSDP2 lays it out: its parameters in FSDP2's order,
    their byte offsets and the output's elements."""

    params: tuple[torch.Tensor, ...]
    offsets: tuple[int, ...]
    numel: int


def _sharded_params(group: Any) -> list[torch.Tensor]:
    return [p.sharded_param for p in group.fsdp_params]


def reduce_into_pools(fused: FusedModule, fo: FlatOptimizer) -> list[_IntoPool]:
    """Hand every group's gradient pool to FSDP2 as its reduce-scatter output where that can be
    exact; elsewhere warn once why and keep the pre-installed pooled ``.grad`` path."""
    api = tc.fsdp_reduce_scatter_api()
    if api is None:
        warn(f"torch {torch.__version__} has no FSDPModule.set_custom_reduce_scatter (added in "
             f"torch {tc.REDUCE_SCATTER_API_SINCE}): FSDP2 adds each gradient into the pooled "
             ".grad (exact, one add per member)", FlatStepWarning)
        return []
    interface, default = api
    interface.register(_IntoPool)  # type: ignore[attr-defined]  # an ABC: a virtual subclass
    index = {id(g): i for i, g in enumerate(fused.groups)}
    comms = []
    for sub in fused.module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        groups = tc.fsdp_module_param_groups(sub)
        for g in groups:
            why = ("several param groups (per-parameter meshes): set_custom_reduce_scatter "
                   "refuses them" if len(groups) > 1 else _static_reason(g, default))
            i = index.get(id(g))
            if i is None:
                continue
            if why is not None:
                warn(f"fsdp{i}: FSDP2 adds each gradient into the pooled .grad (exact, not "
                     f"zero-copy): {why}", FlatStepWarning)
                continue
            comm = _IntoPool(fo, fused, i, default())
            sub.set_custom_reduce_scatter(comm)  # type: ignore[arg-type]
            fo._serve(functools.partial(_sharded_params, g))
            comms.append(comm)
    logger.info("flatpool: %d FSDP2 group(s) reduce-scatter into their gradient pools",
                len(comms))
    return comms


__all__ = ["reduce_into_pools"]
