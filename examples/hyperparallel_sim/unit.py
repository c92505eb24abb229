"""One simulated fully_shard unit (HyperParallel's ``HSDPState``) over the bug report's model.

Builds a two-weight module (eagerly, or on meta for deferred init), shards it into
:class:`~.param.HSDPParam` members, groups them in one of HyperParallel's three group shapes
(or none: per-parameter all-gathers, the reference), materializes meta parameters the two ways
HyperParallel's defer-init tests do, and trains: ``lazy_init`` -> unshard (the group's fused
all-gather) -> forward -> backward -> reduce-scatter -> reshard -> optimizer step.

Plugging a flat-buffer implementation in: ``FullyShardUnit(cfg, init_flat=fn, is_valid=fn)``.
For the one-buffer group the functions take the group (``fn(group)``); for the bucketed group a
bucket and the device (``fn(bucket, device)`` / ``fn(bucket)``). A group subclass works too.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, Literal

import torch
from attrs import define
from torch import nn

from .dtensor import HPDTensorBase, dtensor_class, skip_dtensor_dispatch
from .group import HSDPParamGroupBucketed, HSDPParamGroupV1
from .measure import Originals, census, digest
from .param import HSDPParam, MixedPrecisionPolicy, ShardMesh

GroupKind = Literal["none", "v1", "zero_copy", "bucketed"]
Materialize = Literal["eager", "to_empty", "local_assign"]

@define(frozen=True)
class Config:
    """One HyperParallel generation and scenario.

    As shipped before the fix: ``group="v1", setter="routed", flavor="even"``. Newest upstream:
    ``group="bucketed", setter="rebind", flavor="padded"``.
    """

    rows: int = 2048
    cols: int = 1024
    group: GroupKind = "v1"
    setter: Literal["routed", "rebind"] = "routed"
    data_ptr: Literal["local", "dispatch"] = "local"
    flavor: Literal["even", "padded"] = "even"
    materialize: Materialize = "eager"
    param_dtype: torch.dtype | None = None
    optimizer: Literal["adam", "sgd"] = "adam"
    dispatch: Literal["skip", "rules"] = "skip"
    """``skip``: optimizer steps under SkipDTensorDispatch, as HyperParallel's tests do."""
    seed: int = 0
    device: str = "cpu"


class TwoWeights(nn.Module):
    """Two ``rows x cols`` weights (the bug report's model): ``relu(x @ w1.T) @ w2``."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.w1: nn.Parameter = nn.Parameter(torch.empty(rows, cols))
        self.w2: nn.Parameter = nn.Parameter(torch.empty(rows, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w1.T) @ self.w2


def full_weights(cfg: Config) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed)
    return [torch.randn(cfg.rows, cfg.cols, generator=g) * 0.02 for _ in range(2)]


def batch(cfg: Config, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank + 7)
    return torch.randn(4, cfg.cols, generator=g), torch.randn(4, cfg.cols, generator=g)


class FullyShardUnit:
    """The ``HSDPState`` of one fully_shard unit over a :class:`TwoWeights` module."""

    def __init__(self, cfg: Config, *, init_flat: Callable[..., Any] | None = None,
                 is_valid: Callable[..., Any] | None = None,
                 group_cls: type | None = None) -> None:
        self.cfg = cfg
        self.mesh: ShardMesh = ShardMesh.world()
        self.dtensor_cls: type[HPDTensorBase] = dtensor_class(cfg.setter, cfg.data_ptr)
        mp = MixedPrecisionPolicy(param_dtype=cfg.param_dtype)
        meta = cfg.materialize != "eager"
        self.device: torch.device = torch.device(cfg.device)
        with torch.device("meta") if meta else self.device:
            self.module: TwoWeights = TwoWeights(cfg.rows, cfg.cols)
        if not meta:
            with torch.no_grad():
                for w, full in zip((self.module.w1, self.module.w2), full_weights(cfg)):
                    w.copy_(full)
        self.hsdp_params: list[HSDPParam] = [
            HSDPParam(self.module, name, self.mesh, dtensor_cls=self.dtensor_cls,
                      flavor=cfg.flavor, mp_policy=mp)
            for name in ("w1", "w2")
        ]
        self.originals: Originals = Originals.of(self)  # before the group: V1 fuses inside __init__
        self.group: Any = None
        if cfg.group in ("v1", "zero_copy"):
            cls = group_cls or HSDPParamGroupV1
            self.group = cls(self.hsdp_params, self.mesh, self.device, mp,
                             None if cfg.group == "v1" else True,
                             init_flat=init_flat, is_valid=is_valid)
        elif cfg.group == "bucketed":
            cls = group_cls or HSDPParamGroupBucketed
            self.group = cls(self.hsdp_params, self.device, True, mp_policy=mp,
                             init_flat=init_flat, is_valid=is_valid)
        else:
            for p in self.hsdp_params:
                p.init_dtype_attrs(mp)
        self._reset_done = False

    # ---- deferred init -------------------------------------------------------------------
    def materialize(self) -> None:
        """Give meta parameters memory the way HyperParallel's defer-init tests do, then fill."""
        if self.cfg.materialize == "to_empty":
            self.module.to_empty(device=self.device)
        elif self.cfg.materialize == "local_assign":  # init_empty_weights + replace _local_tensor
            for p in self.module.parameters():
                local = p._local_tensor  # type: ignore[attr-defined]
                if local.is_meta:
                    p._local_tensor = torch.empty(  # type: ignore[attr-defined]
                        local.shape, dtype=local.dtype, device=self.device,
                        requires_grad=local.requires_grad)
        self.fill_in_place()

    @torch.no_grad()
    def fill_in_place(self) -> None:
        """``reset_parameters()``: write this rank's rows of the seeded weights in place."""
        world, rank = self.mesh.shard_mesh_size, self.mesh.shard_mesh_rank
        for name, full in zip(("w1", "w2"), full_weights(self.cfg)):
            param = self.module._parameters[name]
            local = param._local_tensor  # type: ignore[union-attr]
            rows = full.size(0)
            per = (rows + world - 1) // world if self.cfg.flavor == "padded" else rows // world
            start = min(rank * per, rows)
            local.copy_(full.narrow(0, start, local.size(0)))

    def lazy_init(self) -> None:
        """``HSDPState.lazy_init``: reset_sharded_param once, then refuse meta parameters."""
        if not self._reset_done:
            for p in self.hsdp_params:
                p.reset_sharded_param()
            self._reset_done = True
        on_meta = [p.param_name for p in self.hsdp_params if p.sharded_param.device.type == "meta"]
        if on_meta:  # NB: DTensor.device is the *local* tensor's device
            raise RuntimeError(f"HSDP parameters still on meta device: {on_meta}")

    # ---- one training step -----------------------------------------------------------------
    def unshard(self) -> None:
        if self.group is None:
            for p in self.hsdp_params:
                p.unshard()
                p.init_unsharded_param()
                p.to_unsharded()
        else:
            self.group.unshard()
            self.group.wait_for_unshard()

    def reshard(self) -> None:
        for p in self.hsdp_params:
            p.to_sharded()

    def make_optimizer(self) -> torch.optim.Optimizer:
        params = list(self.module.parameters())
        if self.cfg.optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=False)
        return torch.optim.Adam(params, lr=1e-3, foreach=False)

    def train_step(self, step: int, opt: torch.optim.Optimizer) -> float:
        self.lazy_init()
        x, y = (t.to(self.device) for t in batch(self.cfg, step, self.mesh.shard_mesh_rank))
        self.unshard()
        out = self.module(x.to(self.cfg.param_dtype or torch.float32))
        loss = nn.functional.mse_loss(out.float(), y)
        loss.backward()  # type: ignore[no-untyped-call]
        for p in self.hsdp_params:
            p.reduce_scatter_grad()
        self.reshard()
        opt_ids = {id(q) for g in opt.param_groups for q in g["params"]}
        if opt_ids != {id(q) for q in self.module.parameters()}:
            raise AssertionError("optimizer and module hold different parameter objects")
        with skip_dtensor_dispatch() if self.cfg.dispatch == "skip" else nullcontext():
            opt.step()
            opt.zero_grad()
        return float(loss.item())

    # ---- what the group is backed by -------------------------------------------------------
    def flat_buffers(self) -> list[torch.Tensor]:
        return [] if self.group is None else self.group.flat_buffers()

    def is_valid(self) -> bool | None:
        return None if self.group is None else bool(self.group.is_valid())

    def local_values(self) -> list[torch.Tensor]:
        return [p.sharded_param._local_tensor.detach().clone()  # type: ignore[attr-defined]
                for p in self.hsdp_params]


def run(cfg: Config, steps: int = 2, **unit_kwargs: Any) -> dict[str, Any]:
    """Build, (materialize,) train ``steps`` steps; census after fully_shard and after training."""
    return measure(FullyShardUnit(cfg, **unit_kwargs), steps)


def measure(unit: FullyShardUnit, steps: int = 2) -> dict[str, Any]:
    """:func:`run` on a unit the caller built (and may inspect afterwards)."""
    cfg = unit.cfg
    res: dict[str, Any] = {"error": None}
    originals = unit.originals
    res["after_fully_shard"] = census(unit, originals)
    try:
        if cfg.materialize != "eager":
            unit.materialize()
            unit.lazy_init()  # reset_sharded_param: members pick up the materialized tensors
            originals = Originals.of(unit)  # the materialized storages are the originals now
            res["after_materialize"] = census(unit, originals)
        opt = unit.make_optimizer()
        res["losses"] = [unit.train_step(s, opt) for s in range(steps)]
        res["after_training"] = census(unit, originals)
        res["locals_sha256"] = [digest(t) for t in unit.local_values()]
    except Exception as e:  # report, the tests decide whether it was expected
        res["error"] = f"{type(e).__name__}: {e}"
        res["at_error"] = census(unit, originals)
    res["calls"] = list(getattr(unit.group, "calls", []))
    return res


__all__ = ["Config", "FullyShardUnit", "GroupKind", "Materialize", "TwoWeights", "batch",
           "full_weights", "measure", "run"]
