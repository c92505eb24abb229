"""A faithful test double of HyperParallel's torch fully_shard / HSDP comm-fusion path.

The parts (each its own module, facts and sources in HP-NOTES.md):

* ``hp_faithful_dtensor``: the ``_make_subclass`` DTensor: shares the local shard's storage,
  answers ``shape``/``size()``/``numel()`` globally, dispatches ops through a whitelist + rule
  table and raises for the rest; ``data`` setter routed (pre-fix) or rebinding (newest).
* ``hp_faithful_param``: ``TorchHSDPParamV2`` (even-only or padded generation, reset logic).
* ``hp_faithful_group``: ``HSDPParamGroup`` in the V1 / ``enable_zero_copy`` shape and in the
  newest bucketed shape, with the flat-buffer init/validity methods replaceable.

This module adds the ``HSDPState`` part a test needs (build a module, shard it, materialize
meta parameters the two ways HyperParallel's tests do, ``lazy_init``, unshard -> forward ->
backward -> reduce-scatter -> reshard -> optimizer step) and the measurements (live storages,
originals still alive and who holds them, what the Parameter wrapper reads).

Plugging a hook in: ``FullyShardUnit(cfg, init_flat=fn, is_valid=fn)``. For the V1 group the
functions take the group (``fn(group)``); for the bucketed group they take a bucket and the
device (``fn(bucket, device)`` / ``fn(bucket)``). A group subclass works as well.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, Literal

import torch
import torch.distributed as dist
from attrs import define, field
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from hp_faithful_dtensor import (
    HPDTensorBase,
    dtensor_class,
    skip_dtensor_dispatch,
    wrapper_local_geometry,
    wrapper_own_values,
    wrapper_storage_key,
)
from hp_faithful_group import AllGatherBucket, HSDPParamGroupBucketed, HSDPParamGroupV1
from hp_faithful_param import HSDPParam, MixedPrecisionPolicy, ShardMesh

GroupKind = Literal["none", "v1", "zero_copy", "bucketed"]
Materialize = Literal["eager", "to_empty", "local_assign"]
MiB = 1 << 20


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


class TwoWeights(nn.Module):
    """Two ``rows x cols`` weights (the bug report's model): ``relu(x @ w1.T) @ w2``."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(rows, cols))
        self.w2 = nn.Parameter(torch.empty(rows, cols))

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
        self.mesh = ShardMesh.world()
        self.dtensor_cls = dtensor_class(cfg.setter, cfg.data_ptr)
        mp = MixedPrecisionPolicy(param_dtype=cfg.param_dtype)
        meta = cfg.materialize != "eager"
        with torch.device("meta") if meta else nullcontext():
            self.module = TwoWeights(cfg.rows, cfg.cols)
        if not meta:
            with torch.no_grad():
                for w, full in zip((self.module.w1, self.module.w2), full_weights(cfg)):
                    w.copy_(full)
        self.hsdp_params = [
            HSDPParam(self.module, name, self.mesh, dtensor_cls=self.dtensor_cls,
                      flavor=cfg.flavor, mp_policy=mp)
            for name in ("w1", "w2")
        ]
        self.originals = Originals.of(self)  # before the group: V1 fuses inside __init__
        self.group: Any = None
        if cfg.group in ("v1", "zero_copy"):
            cls = group_cls or HSDPParamGroupV1
            self.group = cls(self.hsdp_params, self.mesh, torch.device("cpu"), mp,
                             None if cfg.group == "v1" else True,
                             init_flat=init_flat, is_valid=is_valid)
        elif cfg.group == "bucketed":
            cls = group_cls or HSDPParamGroupBucketed
            self.group = cls(self.hsdp_params, torch.device("cpu"), True, mp_policy=mp,
                             init_flat=init_flat, is_valid=is_valid)
        else:
            for p in self.hsdp_params:
                p.init_dtype_attrs(mp)
        self._reset_done = False

    # ---- deferred init -------------------------------------------------------------------
    def materialize(self) -> None:
        """Give meta parameters memory the way HyperParallel's defer-init tests do, then fill."""
        if self.cfg.materialize == "to_empty":
            self.module.to_empty(device="cpu")
        elif self.cfg.materialize == "local_assign":  # init_empty_weights + replace _local_tensor
            for p in self.module.parameters():
                local = p._local_tensor  # type: ignore[attr-defined]
                if local.is_meta:
                    p._local_tensor = torch.empty(  # type: ignore[attr-defined]
                        local.shape, dtype=local.dtype, requires_grad=local.requires_grad)
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
        x, y = batch(self.cfg, step, self.mesh.shard_mesh_rank)
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


# ---- measurements ------------------------------------------------------------------------------
def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    with torch._C.DisableTorchFunctionSubclass():
        if torch.Tensor.is_meta.__get__(t):  # type: ignore[attr-defined]
            return None
        return t.untyped_storage()


def _chain(t: torch.Tensor | None) -> list[torch.Tensor]:
    out = []
    while isinstance(t, torch.Tensor):
        out.append(t)
        with torch._C.DisableTorchFunctionSubclass():  # the wrapper's own _base, not the local's
            t = t._base
    return out


def member_holders(p: HSDPParam) -> list[tuple[str, torch.Tensor]]:
    """Every tensor through which a member reaches a storage, named by role."""
    rows = [(f"{p.param_name}.data", t) for t in _chain(p._sharded_param_data)]
    rows += [(f"{p.param_name}.local", t)
             for t in _chain(p.sharded_param._local_tensor)]  # type: ignore[attr-defined]
    rows.append((f"{p.param_name}.wrapper", p.sharded_param))
    return rows


@define(frozen=True)
class StorageRow:
    key: int
    nbytes: int
    holders: tuple[str, ...]


def live_storages(unit: FullyShardUnit, extra: list[tuple[str, torch.Tensor]] = ()) -> list[StorageRow]:  # type: ignore[assignment]
    """Distinct live storages reachable from the unit's members and its group's buffers."""
    found: dict[int, tuple[int, list[str]]] = {}
    named: list[tuple[str, torch.Tensor]] = []
    for p in unit.hsdp_params:
        named += member_holders(p)
    named += [(f"group.flat{i}", t) for i, t in enumerate(unit.flat_buffers())]
    named += list(extra)
    for name, t in named:
        s = _storage(t)
        if s is None or s.nbytes() == 0:
            continue
        key = int(s._cdata)
        found.setdefault(key, (s.nbytes(), []))[1].append(name)
    return [StorageRow(k, n, tuple(sorted(set(h)))) for k, (n, h) in found.items()]


@define
class Originals:
    """Weak references to the members' storages taken before fusion."""

    refs: list[tuple[str, int, int, Any]] = field(factory=list)

    @classmethod
    def of(cls, unit: FullyShardUnit) -> Originals:
        out, seen = cls(), set()
        for p in unit.hsdp_params:
            for name, t in member_holders(p):
                s = _storage(t)
                if s is None or s.nbytes() == 0 or int(s._cdata) in seen:
                    continue
                seen.add(int(s._cdata))
                out.refs.append((p.param_name, s.nbytes(), int(s._cdata), StorageWeakRef(s)))  # type: ignore[no-untyped-call]
        return out

    def alive(self) -> list[tuple[str, int]]:
        return [(n, b) for n, b, _, r in self.refs if not r.expired()]

    def alive_held_by_wrappers(self, unit: FullyShardUnit) -> int:
        """How many live originals are exactly the storage a Parameter wrapper sits on."""
        wrappers = {wrapper_storage_key(p.sharded_param) for p in unit.hsdp_params}
        alive = {k for _, _, k, r in self.refs if not r.expired()}
        return len(alive & {k for k in wrappers if k is not None})


def wrapper_is_stale(p: HSDPParam) -> bool | None:
    """Does the Parameter wrapper's own memory differ from the local tensor it fronts?"""
    if wrapper_storage_key(p.sharded_param) is None:
        return None
    own = wrapper_own_values(p.sharded_param)
    local = p.sharded_param._local_tensor.detach()  # type: ignore[attr-defined]
    return not torch.equal(own, local)


def wrapper_view(p: HSDPParam) -> dict[str, Any]:
    """What the wrapper says about itself, through each door."""
    w = p.sharded_param
    geom = None if wrapper_storage_key(w) is None else wrapper_local_geometry(w)
    return {"shape": tuple(w.shape), "size": tuple(w.size()), "impl_geometry": geom,
            "meta": wrapper_storage_key(w) is None}


def census(unit: FullyShardUnit, originals: Originals | None = None) -> dict[str, Any]:
    rows = live_storages(unit)
    out: dict[str, Any] = {
        "live": len(rows),
        "live_mib": sum(r.nbytes for r in rows) / MiB,
        "rows": [(r.nbytes / MiB, r.holders) for r in sorted(rows, key=lambda r: -r.nbytes)],
        "valid": unit.is_valid(),
        "stale_wrappers": [wrapper_is_stale(p) for p in unit.hsdp_params],
        "wrappers": [wrapper_view(p) for p in unit.hsdp_params],
    }
    if originals is not None:
        out["originals_alive"] = len(originals.alive())
        out["originals_held_by_wrappers"] = originals.alive_held_by_wrappers(unit)
    return out


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


def digest(t: torch.Tensor) -> str:
    """Bit-exact fingerprint of a tensor (results cross process boundaries as plain data)."""
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def expected_flat_mib(cfg: Config) -> float:
    world = dist.get_world_size()
    per = math.ceil(cfg.rows / world)
    return 2 * per * cfg.cols * 4 / MiB


__all__ = [
    "AllGatherBucket", "Config", "FullyShardUnit", "HPDTensorBase", "HSDPParam",
    "HSDPParamGroupBucketed", "HSDPParamGroupV1", "MiB", "Originals", "StorageRow", "TwoWeights",
    "batch", "census", "digest", "full_weights", "live_storages", "measure", "member_holders", "run",
    "wrapper_is_stale", "wrapper_view",
]
