"""A HyperParallel-shaped test double: members with a ``_make_subclass`` DTensor wrapper, and a
group whose flat-buffer initialization mirrors ``HSDPParamGroup._init_flat_param_buffer``.

HyperParallel's torch DTensor is built with ``Tensor._make_subclass``: the wrapper *shares* the
shard's storage (torch's DTensor has none). Its pre-fix flat-buffer init pointed
``_sharded_param_data`` and ``_local_tensor`` at the flat buffer but not the wrapper, which is
the Parameter the module and optimizer hold: the old shard storages stayed alive next to the
flat buffer (the bug report), and the optimizer stepped memory the all-gather no longer read.
``HPGroup(..., hook="flatpool")`` calls :func:`flatpool.integrations.hsdp.adopt_group` instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from flatpool import local_tensor, same_storage
from flatpool.integrations.hsdp import fused_all_gather
from examples.census import OriginalStorages, live_storages
from flatpool.integrations.hsdp.group import GroupBuffers, adopt_group
from flatpool.integrations.hsdp.validity import is_valid


class HPDTensor(nn.Parameter):
    """``_make_subclass`` wrapper sharing its local tensor's storage, like HyperParallel's."""

    _local_tensor: torch.Tensor

    def __new__(cls, local: torch.Tensor, requires_grad: bool = True) -> HPDTensor:
        t = torch.Tensor._make_subclass(cls, local, requires_grad)
        t._local_tensor = local
        return t  # type: ignore[no-any-return]

    def data_ptr(self) -> int:  # HyperParallel answers with the local tensor's pointer
        return self._local_tensor.data_ptr()


class HPParam:
    """Mirrors TorchHSDPParamV2's sharded state for a dim-0 shard of ``full``."""

    def __init__(self, full: torch.Tensor, rank: int, world: int) -> None:
        chunks = torch.chunk(full, world, dim=0)
        mine = chunks[rank] if rank < len(chunks) else full[:0]
        self._orig_size = full.shape
        self.padded_sharded_param_size = chunks[0].shape
        self.sharded_size = mine.shape
        self.offload_to_cpu = False
        padded = full.new_zeros(self.padded_sharded_param_size)
        padded.narrow(0, 0, mine.shape[0]).copy_(mine)
        self._sharded_param_data = padded.view(-1)
        self.sharded_param: nn.Parameter = HPDTensor(padded.narrow(0, 0, mine.shape[0]))


class HPGroup:
    """The part of HSDPParamGroup that builds and checks the flat buffer, and gathers from it."""

    def __init__(self, params: list[HPParam], world: int, hook: str) -> None:
        self.hsdp_params = params
        self.shard_world_size = world
        self.hook = hook  # "none" | "naive" (pre-fix) | "flatpool"
        self._flat_param_buffer: torch.Tensor | None = None
        self._buffers: GroupBuffers | None = None
        self._init_flat_param_buffer()

    def _init_flat_param_buffer(self) -> None:
        if self.hook == "flatpool":
            # The lines an HSDPParamGroup calls (see docs/integration.md).
            self._buffers = adopt_group(
                self.hsdp_params, world_size=self.shard_world_size, name="hsdp"
            )
            self._flat_param_buffer = self._buffers.flats()[0] if self._buffers.adopted else None
        elif self.hook == "naive":  # pre-fix HyperParallel: the wrapper is not rebased
            total = sum(p._sharded_param_data.numel() for p in self.hsdp_params)
            flat = torch.empty(total, dtype=self.hsdp_params[0]._sharded_param_data.dtype)
            offset = 0
            for p in self.hsdp_params:
                n = p._sharded_param_data.numel()
                piece = flat.narrow(0, offset, n)
                piece.copy_(p._sharded_param_data)
                p._sharded_param_data = piece
                padded = piece.view(p.padded_sharded_param_size)
                p.sharded_param._local_tensor = padded.narrow(0, 0, p.sharded_size[0])
                offset += n
            self._flat_param_buffer = flat

    def _is_flat_buffer_valid(self) -> bool:
        if self.hook == "flatpool":
            return self._buffers is not None and is_valid(self._buffers, self.hsdp_params)
        return self._flat_param_buffer is not None

    @torch.no_grad()
    def unshard(self) -> list[torch.Tensor]:
        """Full parameters: from the flat buffer when fused, else per parameter."""
        if self.hook != "none":
            if not self._is_flat_buffer_valid():
                self._init_flat_param_buffer()
            if self._buffers is not None:
                return fused_all_gather(self._buffers.buckets[0])
            flat = self._flat_param_buffer
            assert flat is not None
            out = torch.empty(self.shard_world_size * flat.numel())
            dist.all_gather_into_tensor(out, flat)
            rows = out.view(self.shard_world_size, -1)
            res, off = [], 0
            for p in self.hsdp_params:
                n = p._sharded_param_data.numel()
                full = rows[:, off : off + n].reshape(-1, *p.padded_sharded_param_size[1:])
                res.append(full[: p._orig_size[0]].clone())
                off += n
            return res
        res = []
        for p in self.hsdp_params:
            data = p._sharded_param_data
            out = torch.empty(self.shard_world_size * data.numel())
            dist.all_gather_into_tensor(out, data)
            res.append(out.view(-1, *p.padded_sharded_param_size[1:])[: p._orig_size[0]].clone())
        return res


def _run(hook: str) -> tuple[list[float], list[str], HPGroup, OriginalStorages]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    fulls = [torch.randn(7, 5), torch.randn(3, 7)]
    params = [HPParam(f, rank, world) for f in fulls]
    originals = OriginalStorages(params)
    group = HPGroup(params, world, hook)
    opt = torch.optim.SGD([p.sharded_param for p in params], lr=0.1, momentum=0.9)
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
        w1, w2 = (w.requires_grad_() for w in group.unshard())
        loss = nn.functional.mse_loss(torch.relu(x @ w1.T) @ w2.T, y)
        loss.backward()  # type: ignore[no-untyped-call]
        for p, w in zip(params, (w1, w2)):
            assert w.grad is not None
            grad = w.grad.chunk(world, dim=0)[rank].contiguous()
            p.sharded_param.grad = grad
        opt.step()
        losses.append(loss.item())
    full = [f.sum().item() for f in group.unshard()]
    return losses, [repr(v) for v in full], group, originals


def hp_bug_case() -> None:
    """The hook fixes exactly the stale-storage case of the bug report."""
    ref_losses, ref_full, _, _ = _run("none")

    losses, full, group, originals = _run("naive")
    assert len(originals.stale()) == 2, "the pre-fix rebase should leave both old shards alive"
    assert losses != ref_losses, "the pre-fix rebase should diverge"

    losses, full, group, originals = _run("flatpool")
    assert originals.stale() == [], f"stale: {originals.stale()}"
    assert losses == ref_losses and full == ref_full, "training differs with the hook"
    assert group._buffers is not None and group._is_flat_buffer_valid()
    pool = group._buffers.buckets[0].pool
    for p in group.hsdp_params:
        with torch._C.DisableTorchFunctionSubclass():
            wrapper_storage = p.sharded_param.untyped_storage()
        assert int(wrapper_storage._cdata) == int(pool.storage._cdata), "wrapper not rebased"
        assert pool.owns(p._sharded_param_data) and pool.owns(local_tensor(p.sharded_param))
        assert same_storage(p._sharded_param_data, local_tensor(p.sharded_param))
    live = live_storages(group.hsdp_params, group._buffers.flats())
    assert [r.kind for r in live] == ["flat"], live
