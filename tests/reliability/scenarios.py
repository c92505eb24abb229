"""Fresh fixtures shared by the fault-injection, bad-input and crash tests.

Each builder returns a :class:`World`: pools, the adoption targets, every tensor object and
holder place whose state a failed call must leave untouched, and the objects that keep the
scenario alive (module, optimizer, holders).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flatpool import AdoptSpec, FlatPool, Holder


class Wrapper(torch.Tensor):
    """HyperParallel-style DTensor stand-in: a ``_make_subclass`` wrapper sharing its local
    tensor's storage and carrying it as ``_local_tensor`` (same as ``tests/conftest.py``)."""

    _local_tensor: torch.Tensor

    @staticmethod
    def __new__(cls, local: torch.Tensor) -> Wrapper:
        out = torch.Tensor._make_subclass(cls, local, local.requires_grad)
        out._local_tensor = local
        return out


class Box:
    """An object holding tensors as attributes (like an FSDP2 param holding its shard)."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        self.__dict__.update(tensors)


class World:
    def __init__(self) -> None:
        self.pools: list[FlatPool] = []
        self.targets: list[Any] = []
        self.tensors: dict[str, torch.Tensor] = {}
        self.places: dict[str, tuple[Any, Any, bool]] = {}
        self.keep: list[Any] = []
        self.opt: torch.optim.Optimizer | None = None

    @property
    def pool(self) -> FlatPool:
        return self.pools[0]


def one_rank_mesh() -> Any:
    """A 1-rank gloo mesh (reusing the default group when one exists, as conftest does)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    return DeviceMesh("cpu", list(range(dist.get_world_size())))


class ShardedMember:
    """An FSDP2 member as lazy init lays it out: a padded tensor nobody names,
    ``_sharded_param_data`` a flat autograd view of it, the local tensor a base-less tensor on
    the same storage (its first ``rows`` rows), ``sharded_param`` a torch DTensor parameter over
    the local tensor. :meth:`spec` is what ``adopt_group`` passes for it."""

    def __init__(self, rows: int, padded_rows: int, cols: int, start: float,
                 mesh: Any = None) -> None:
        from torch.distributed.tensor import DTensor, Shard

        mesh = one_rank_mesh() if mesh is None else mesh
        padded = ints(padded_rows, cols, start=start)
        self._sharded_param_data = padded.view(-1)
        local = torch.empty(0).set_(padded.untyped_storage(), 0, (rows, cols), (cols, 1))
        spec = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)._spec
        self.sharded_param = nn.Parameter(DTensor(local, spec, requires_grad=True))  # type: ignore[no-untyped-call]

    def spec(self) -> AdoptSpec:
        return AdoptSpec(self._sharded_param_data, views=(self.sharded_param,),
                         holders=(Holder(self, "_sharded_param_data"),))


def sharded_world() -> World:
    """FSDP2-shaped members (one padded) into a planned pool: the sharded lean path."""
    w = World()
    w.pools.append(FlatPool(alignment=1, name="sharded"))
    members = [ShardedMember(3, 3, 4, 100.0), ShardedMember(5, 6, 2, 200.0),
               ShardedMember(2, 2, 3, 300.0)]
    w.targets = [m.spec() for m in members]
    for i, m in enumerate(members):
        w.tensors[f"data{i}"] = m._sharded_param_data
        w.tensors[f"local{i}"] = m.sharded_param._local_tensor
        w.places[f"member{i}"] = (m, "_sharded_param_data", False)
        w.places[f"wrapper{i}"] = (m.sharded_param, "_local_tensor", False)
    w.keep = members
    return w


def ints(*shape: int, start: float = 0.0) -> torch.Tensor:
    """Integer-valued floats: arithmetic on them is exact, so shadows compare bit for bit."""
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n, dtype=torch.float32) + start).reshape(shape).clone()


def batch_world(*, capacity: int | None = 1 << 14, alignment: int = 64) -> World:
    """A materialized pool holding one written slice, and a batch of every adoptable kind:
    parameters under an optimizer, a plain tensor, a tensor with a view, a padded shard whose
    narrow is held elsewhere, a storage-sharing wrapper, and an int64 tensor."""
    w = World()
    pool = FlatPool(alignment=alignment, capacity=capacity, name="main")
    keep = pool.allocate((5,), torch.float32)
    pool.materialize()
    keep.tensor().copy_(ints(5, start=100))
    w.pools.append(pool)

    lin = nn.Linear(4, 3)
    with torch.no_grad():
        lin.weight.copy_(ints(3, 4))
        lin.bias.copy_(ints(3, start=50))
    opt = torch.optim.SGD(lin.parameters(), lr=0.5, momentum=0.9)
    lin(torch.ones(2, 4)).sum().backward()
    opt.step()  # optimizer state (momentum buffers) exists before adoption
    plain = ints(2, 3, start=200)
    base = ints(20, start=300)
    view = base[2:8].view(2, 3)
    shard = Box(data=ints(12, start=400))
    shard.local = shard.data.narrow(0, 0, 10)
    local = ints(6, start=500)
    wrapped = Wrapper(local)
    idx = torch.arange(7, dtype=torch.int64) * 3

    w.targets = [
        lin.weight,
        lin.bias,
        AdoptSpec(plain),
        AdoptSpec(base, views=(view,)),
        AdoptSpec(shard.data, holders=(Holder(shard, "local"),)),
        wrapped,
        idx,
    ]
    w.tensors = dict(
        weight=lin.weight, bias=lin.bias, plain=plain, base=base, view=view, data=shard.data,
        wrapped=wrapped, idx=idx,
    )
    w.places = dict(shard_local=(shard, "local", False), module_weight=(lin._parameters, "weight", True))
    w.keep = [lin, shard, keep]
    w.opt = opt
    return w


def meta_world() -> World:
    """A pool with a free planned slice and a module built on the meta device."""
    w = World()
    pool = FlatPool(alignment=64, name="meta")
    pool.allocate((3,), torch.float32)
    w.pools.append(pool)
    with torch.device("meta"):
        lin = nn.Linear(4, 3)
    w.targets = [lin.weight, lin.bias]
    w.tensors = dict(weight=lin.weight, bias=lin.bias)
    w.keep = [lin]
    return w


def values_of(w: World) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in w.tensors.items()}
