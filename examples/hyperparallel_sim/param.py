"""A double of HyperParallel's ``TorchHSDPParamV2`` (``hyper_parallel/platform/torch/fully_shard/param.py``).

One member of a fully_shard unit: it shards a module parameter on dim 0, installs the sharded
``nn.Parameter(DTensor)`` on the module (the object the optimizer holds), and keeps
``_sharded_param_data`` (the flat, possibly padded, all-gather input). Two generations:

* ``flavor="even"`` (the version that rejects uneven sharding): only ``sharded_size``; no
  ``padded_sharded_param_size`` attribute at all; ``_sharded_param_data = shard.view(-1)``.
* ``flavor="padded"`` (newest): ceil-sized shards, ``padded_sharded_param_size``; trailing ranks
  get a zero-padded tensor whose ``narrow`` is the local tensor.

``reset_sharded_param`` follows each generation (it runs from ``lazy_init`` and from the
module's ``load_state_dict`` post-hook). Values are this project's reading of the public
sources; the code is its own.
"""

from __future__ import annotations

import enum
import math
from typing import Any, Literal

import torch
import torch.distributed as dist
from attrs import define
from torch import nn

from flatpool import _torch_compat as tc

from .dtensor import HPDTensorBase, ShardLayout

Flavor = Literal["even", "padded"]


class ShardedState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDED = "unsharded"


@define(frozen=True)
class Shard:
    dim: int = 0


@define(frozen=True)
class MixedPrecisionPolicy:
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None


@define
class ShardMesh:
    """The fields of HyperParallel's ``FSDPMeshInfo`` the group reads."""

    shard_process_group: Any
    shard_mesh_size: int
    shard_mesh_rank: int

    @classmethod
    def world(cls) -> ShardMesh:
        group = dist.group.WORLD
        return cls(group, dist.get_world_size(), dist.get_rank())


def contiguous_strides(size: torch.Size) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(size):
        out.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(out))


class HSDPParam:
    """``TorchHSDPParamV2``-shaped member of a fully_shard unit (dim-0 sharding only)."""

    _sharded_param_data: torch.Tensor
    sharded_param: nn.Parameter
    sharded_size: torch.Size
    padded_sharded_param_size: torch.Size  # absent (not just None) for flavor "even"

    def __init__(self, module: nn.Module, param_name: str, mesh: ShardMesh, *,
                 dtensor_cls: type[HPDTensorBase], flavor: Flavor = "padded",
                 mp_policy: MixedPrecisionPolicy | None = None) -> None:
        self.module = module
        self.param_name = param_name
        self.mesh_info = mesh
        self.flavor = flavor
        self.dtensor_cls = dtensor_cls
        self.mp_policy: MixedPrecisionPolicy = mp_policy or MixedPrecisionPolicy()
        self.offload_to_cpu = False
        self.pin_memory = False
        self.param_dtype: torch.dtype | None = None
        self.reduce_dtype: torch.dtype | None = None
        self.orig_dtype: torch.dtype | None = None
        self.hsdp_placement: Shard = Shard(0)
        self._unsharded_param: nn.Parameter | None = None
        self.all_gather_outputs: list[torch.Tensor] = []
        self._init_sharded_param(module._parameters[param_name])  # type: ignore[arg-type]

    # ---- construction --------------------------------------------------------------------
    @property
    def shard_world_size(self) -> int:
        return self.mesh_info.shard_mesh_size

    @property
    def shard_rank(self) -> int:
        return self.mesh_info.shard_mesh_rank

    def _layout(self) -> ShardLayout:
        return ShardLayout(self.shard_world_size, 0, tuple(self._orig_size))

    def to_sharded_dtensor(self, local: torch.Tensor) -> HPDTensorBase:
        return self.dtensor_cls.from_local(local, self._layout())

    @torch.no_grad()
    def _init_sharded_param(self, param: torch.Tensor) -> None:
        world, rank = self.shard_world_size, self.shard_rank
        self._orig_size = param.size()
        self._contiguous_orig_stride = contiguous_strides(self._orig_size)
        if self.flavor == "even":
            if param.size(0) % world != 0:
                raise NotImplementedError(
                    f"Uneven sharding on dim 0 not supported: shape={tuple(param.shape)}, "
                    f"world_size={world}")
            local = torch.chunk(param, world, dim=0)[rank].clone().contiguous()
            self.sharded_size = local.size()
            self._sharded_param_data = local.view(-1)
        else:
            rows = param.size(0)
            per = (rows + world - 1) // world
            start = min(rank * per, rows)
            length = min(per, rows - start)
            local = param.narrow(0, start, length).clone().contiguous()
            self.sharded_size = local.size()
            self.padded_sharded_param_size = torch.Size((per, *param.shape[1:]))
            if self.sharded_size == self.padded_sharded_param_size:
                self._sharded_param_data = local.view(-1)
            else:
                padded = local.new_zeros(self.padded_sharded_param_size)
                if local.numel() > 0:
                    padded.narrow(0, 0, length).copy_(local)
                self._sharded_param_data = padded.view(-1)
                local = padded.narrow(0, 0, length)
        self.contiguous_sharded_stride: tuple[int, ...] = contiguous_strides(self.sharded_size)
        # nn.Parameter(DTensor) takes torch's custom-tensor path: detach() -> a new wrapper
        # whose _local_tensor is local.detach(); both share local's storage.
        self.sharded_param = nn.Parameter(self.to_sharded_dtensor(local))
        self.sharded_param.requires_grad_(param.requires_grad)
        self._setattr_on_modules(self.sharded_param)
        self.sharded_param._hsdp_param_initialized = True  # type: ignore[attr-defined]
        self.sharded_state: ShardedState = ShardedState.SHARDED

    def init_dtype_attrs(self, mp: MixedPrecisionPolicy) -> None:
        param_dtype, reduce_dtype = mp.param_dtype, mp.reduce_dtype
        self.orig_dtype = self.sharded_param.dtype
        if reduce_dtype == param_dtype:
            reduce_dtype = None
        if param_dtype == self.orig_dtype:
            param_dtype = None
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype

    def _setattr_on_modules(self, param: nn.Parameter) -> None:
        self.module._parameters[self.param_name] = param

    @property
    def _sharded_local_tensor(self) -> torch.Tensor:
        return self.sharded_param._local_tensor  # type: ignore[attr-defined, no-any-return]

    # ---- reset after load_state_dict / to_empty (called by lazy_init) ---------------------
    def reset_sharded_param(self) -> None:
        if self.flavor == "even":
            self._reset_even()
        else:
            self._reset_padded()

    def _reset_even(self) -> None:
        new_param = getattr(self.module, self.param_name)
        if new_param is not self.sharded_param:
            if torch.__future__.get_swap_module_params_on_conversion():
                raise AssertionError("expected swap_tensors to preserve the parameter object")
            self.sharded_param = new_param
        if not hasattr(new_param, "_local_tensor"):  # to_empty left a plain Parameter
            local = new_param.data
            wrapped = nn.Parameter(self.to_sharded_dtensor(local))
            wrapped.requires_grad_(new_param.requires_grad)
            self.sharded_param = wrapped
            self._sharded_param_data = local.view(-1)
            self._setattr_on_modules(wrapped)
            return
        local = new_param._local_tensor
        if local.is_meta:
            return
        same = self._same_storage_as_data(local)
        if local.size() != self.sharded_size and not same:
            raise AssertionError(f"Expected sharded_size {self.sharded_size}, got {local.size()}")
        if not same:
            self._sharded_param_data = local.view(-1)

    def _reset_padded(self) -> None:
        new_param = getattr(self.module, self.param_name)
        if new_param is not self.sharded_param:
            if torch.__future__.get_swap_module_params_on_conversion():
                raise AssertionError("expected swap_tensors to preserve the parameter object")
            if isinstance(new_param, HPDTensorBase):
                self.sharded_param = new_param  # type: ignore[assignment]
        local = new_param._local_tensor if isinstance(new_param, HPDTensorBase) else new_param
        if local.is_meta:
            return
        same = self._same_storage_as_data(local)
        if not same and local.size() != self.sharded_size:
            raise AssertionError(f"Expected sharded_size {self.sharded_size}, got {local.size()}")
        if not same:
            length = self.sharded_size[0]
            if self.sharded_size == self.padded_sharded_param_size:
                local = local.contiguous()
                self._sharded_param_data = local.view(-1)
                view = local.detach()
            else:
                padded = local.new_zeros(self.padded_sharded_param_size)
                if local.numel() > 0:
                    padded.narrow(0, 0, length).copy_(local)
                self._sharded_param_data = padded.view(-1)
                view = padded.narrow(0, 0, length).detach()
            if view.requires_grad != self.sharded_param.requires_grad:
                view.requires_grad_(self.sharded_param.requires_grad)
            self.sharded_param._local_tensor = view  # type: ignore[attr-defined]
        self._setattr_on_modules(self.sharded_param)

    def _same_storage_as_data(self, local: torch.Tensor) -> bool:
        ptr = self._sharded_param_data.untyped_storage().data_ptr()
        return bool(ptr > 0 and ptr == local.untyped_storage().data_ptr())

    # ---- communication (the non-fused path and what a group reads) ------------------------
    @property
    def all_gather_inputs(self) -> list[torch.Tensor]:
        if self.sharded_state is not ShardedState.SHARDED:
            raise AssertionError(f"expected SHARDED, got {self.sharded_state}")
        data = self._sharded_param_data
        if self.param_dtype is not None and self.param_dtype != data.dtype:
            return [data.to(self.param_dtype)]
        return [data]

    @torch.no_grad()
    def unshard(self) -> None:
        """Per-parameter all-gather (comm_fusion off): the reference path."""
        inp = self.all_gather_inputs[0]
        out = torch.empty(inp.numel() * self.shard_world_size, dtype=inp.dtype, device=inp.device)
        tc.all_gather_single(out, inp, group=self.mesh_info.shard_process_group)
        self.all_gather_outputs = [out]

    def init_unsharded_param(self) -> None:
        (out,) = self.all_gather_outputs
        full = torch.as_strided(out, self._orig_size, self._contiguous_orig_stride, 0)
        self._unsharded_param = nn.Parameter(full, requires_grad=self.sharded_param.requires_grad)

    def to_unsharded(self) -> None:
        assert self._unsharded_param is not None
        self._setattr_on_modules(self._unsharded_param)
        self.sharded_state = ShardedState.UNSHARDED

    def to_sharded(self) -> None:
        self._setattr_on_modules(self.sharded_param)
        self._unsharded_param = None
        self.all_gather_outputs = []
        self.sharded_state = ShardedState.SHARDED

    @torch.no_grad()
    def reduce_scatter_grad(self) -> None:
        """AVG reduce-scatter of the full gradient into this rank's (unpadded) sharded grad."""
        assert self._unsharded_param is not None and self._unsharded_param.grad is not None
        grad = self._unsharded_param.grad
        if self.reduce_dtype is not None:
            grad = grad.to(self.reduce_dtype)
        world = self.shard_world_size
        per = self.padded_size()[0]
        if grad.size(0) != per * world:
            padded = grad.new_zeros((per * world, *grad.shape[1:]))
            padded.narrow(0, 0, grad.size(0)).copy_(grad)
            grad = padded
        out = grad.new_empty(grad.numel() // world)
        tc.reduce_scatter_single(out, grad.contiguous().view(-1), op=dist.ReduceOp.AVG,
                                   group=self.mesh_info.shard_process_group)
        shard = out.narrow(0, 0, math.prod(self.sharded_size)).view(self.sharded_size)
        if shard.dtype != self.orig_dtype:
            shard = shard.to(self.orig_dtype)
        self._unsharded_param.grad = None
        self.sharded_param.grad = self.to_sharded_dtensor(shard)

    def padded_size(self) -> torch.Size:
        """The padded shard shape whatever the flavor (``sharded_size`` when even)."""
        return getattr(self, "padded_sharded_param_size", self.sharded_size)


__all__ = ["Flavor", "HSDPParam", "MixedPrecisionPolicy", "Shard", "ShardMesh", "ShardedState",
           "contiguous_strides"]
