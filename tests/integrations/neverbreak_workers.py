"""2-rank scenarios: a training loop that runs on plain FSDP2 runs unchanged with the fusion layer.

* ``nn.Module._apply`` on a fused model (eagerly fused and meta-fused): ``.cpu()``,
  ``.float()``, ``.double()``, ``.half()``, ``.to(torch.float64)``, ``to_empty`` +
  ``reset_parameters()``, ``requires_grad_(False)``; then training equals plain FSDP2 with the
  same call, the layer is valid, no original outlives the next step and every pool has its
  members' dtype.
* A reference the user holds to an original shard (a ``to_local()`` handle, a ``state_dict()``
  taken before the loop, a ``detach()`` alias, a shard loaded as a view of a full checkpoint),
  on every rank or on rank 0 only: every step trains bit-identically to plain FSDP2, one warning
  names the holder, and after the reference is dropped the next step frees the original.
* Fusion failing on rank 0 only (or on every rank) until the first step ends, fused before and
  after FSDP2's lazy init: the failing rank trains that step unfused, training equals plain
  FSDP2, and the next step fuses every group.

Every scenario returns ``None`` or a traceback per rank; one spawned job runs them all (a
rank stuck in a collective would make the whole job time out, which the test reports).
"""

from __future__ import annotations

import gc
import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from flatpool import OriginalKeptAliveWarning
from flatpool.errors import UnfusedGroupWarning
from examples.census import OriginalStorages, live_storages
from flatpool.integrations.hsdp.fsdp2 import FusedModule, fsdp_param_groups, fuse_fully_sharded
from flatpool.integrations.hsdp.fsdp2 import lazy_init
from flatpool.integrations.hsdp.members import data_of, impl_dtype
from scenario_runs import FailingOps, run_scenarios

STEPS = 3


class MLP(nn.Module):
    """7 rows over 2 ranks: rank 1's shards are padded (FSDP2 re-pads them into fresh memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 7)
        self.b = nn.Linear(7, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))

    def reset_parameters(self) -> None:
        torch.manual_seed(1)  # the same on both ranks: DTensor init on a CPU mesh is not rank-aware
        self.a.reset_parameters()
        self.b.reset_parameters()


def full_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in MLP().state_dict().items()}


def _params_of(model: nn.Module) -> list[Any]:
    return [p for g in fsdp_param_groups(model) for p in g.fsdp_params]


def shard(model: nn.Module, mesh: DeviceMesh) -> None:
    fully_shard(model.a, mesh=mesh)  # type: ignore[arg-type]
    fully_shard(model, mesh=mesh)


def build(mesh: DeviceMesh, how: str) -> tuple[nn.Module, FusedModule | None]:
    """``ref``: plain FSDP2; ``eager``: fused after lazy init; ``meta``: materialized into the
    pools from meta (zero-copy), then loaded."""
    if how == "meta":
        with torch.device("meta"):
            model = MLP()
        shard(model, mesh)
        fused = fuse_fully_sharded(model)
        model.load_state_dict({k: distribute_tensor(v, mesh, [Shard(0)])
                               for k, v in full_state().items()})
        return model, fused
    model = MLP()
    model.load_state_dict(full_state())
    shard(model, mesh)
    if how == "ref":
        return model, None
    if how == "eager_lazy":  # FSDP2's lazy init first (the pools see its padded shards)
        lazy_init(model)
    return model, fuse_fully_sharded(model)


def _batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(4, 8, generator=g).to(dtype), torch.randn(4, 4, generator=g)


def train(model: nn.Module, steps: int = STEPS,
          between: Callable[[int], None] | None = None) -> tuple[list[float], list[torch.Tensor]]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9)  # (Adam's eps underflows in fp16)
    losses = []
    for step in range(steps):
        if between is not None:
            between(step)
        dtype = next(model.parameters()).dtype
        x, y = _batch(step, dtype)
        loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    full = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    return losses, full


@contextmanager
def flatpool_log() -> Iterator[list[str]]:
    """The messages the ``flatpool`` logger records (INFO and up) inside the block."""
    got: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record.getMessage())

    log = logging.getLogger("flatpool")
    handler, level = _Keep(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield got
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def check_fused(model: nn.Module, fused: FusedModule) -> None:
    """Valid, every member's storage one of the pools', and each pool of its members' dtype."""
    assert fused.is_valid(), f"not valid: {fused!r}"
    flats = [f for b in fused.buffers for f in b.flats()]
    live = live_storages(_params_of(model), flats)
    assert all(r.kind == "flat" for r in live), f"shard storage outside the pools: {live}"
    for g, buf in zip(fused.groups, fused.buffers):
        for b in buf.buckets:
            assert b.flat().dtype == b.dtype
            for m in b.members:
                p = g.fsdp_params[m.index]
                assert impl_dtype(data_of(p, m.index)) == b.dtype, (m.index, b.dtype)
                assert p.sharded_param.dtype == b.dtype, (m.index, p.sharded_param.dtype)


def same(a: tuple[list[float], list[torch.Tensor]], b: tuple[list[float], list[torch.Tensor]]) -> None:
    assert a[0] == b[0], f"losses differ: {a[0]} vs {b[0]}"
    for x, y in zip(a[1], b[1]):
        assert x.dtype == y.dtype and torch.equal(x, y), "parameters differ"


# -- nn.Module._apply ----------------------------------------------------------------------------
def _reset(model: nn.Module) -> None:
    model.to_empty(device="cpu")
    model.reset_parameters()  # type: ignore[operator]


APPLY: dict[str, Callable[[nn.Module], Any]] = {
    "cpu": lambda m: m.cpu(),
    "float": lambda m: m.float(),
    "double": lambda m: m.double(),
    "half": lambda m: m.half(),
    "bfloat16": lambda m: m.bfloat16(),
    "to_float64": lambda m: m.to(torch.float64),
    "to_empty": _reset,
    "requires_grad": lambda m: m.a.requires_grad_(False),
}


def apply_case(mesh: DeviceMesh, how: str, op: str) -> None:
    ref, _ = build(mesh, "ref")
    APPLY[op](ref)
    expected = train(ref)
    model, fused = build(mesh, how)
    assert fused is not None and fused.is_valid()
    old_pools = [pl.storage for b in fused.buffers for pl in b.pools()]
    APPLY[op](model)
    # Whatever _apply gave the members is what the next forward must adopt and free.
    moved = OriginalStorages([p for p in _params_of(model)])
    pool_keys = {pl.storage_key for b in fused.buffers for pl in b.pools()}
    with flatpool_log() as log:
        got = train(model)
    same(got, expected)
    if op in ("double", "half", "bfloat16", "to_float64"):
        assert any("planned anew (member 0 is torch." in m for m in log), log
        assert any(": adopted 2 member(s) into 1 pool(s)" in m for m in log), log
    elif op == "to_empty":
        assert any("re-adopted" in m or "adopted" in m for m in log), log
    check_fused(model, fused)
    pools = {pl.storage.data_ptr() for b in fused.buffers for pl in b.pools()}
    pools |= {s.data_ptr() for s in old_pools}
    alive = [a for a in moved.alive_storages() if a[1] not in pools]
    assert not alive, f"originals alive: {alive}"
    del moved
    if op in ("double", "half", "bfloat16", "to_float64"):  # planned anew: the old pools are gone
        new_keys = {pl.storage_key for b in fused.buffers for pl in b.pools()}
        assert not new_keys & pool_keys
    del old_pools
    if op == "requires_grad":
        assert not any(p.requires_grad for p in model.a.parameters())
        assert all(p.requires_grad for p in model.b.parameters())


def pytorch_to_float64_after_init(mesh: DeviceMesh) -> None:
    """The scenario of PyTorch's ``test_to_float64_after_init`` (test_fully_shard_training.py),
    fused: ``fully_shard`` each block and the root, ``.to(torch.float64)``, then every
    parameter, gradient and optimizer state is float64 and training matches plain FSDP2."""
    ref, _ = build(mesh, "ref")
    ref.to(torch.float64)
    expected = train(ref)
    model, fused = build(mesh, "eager")
    assert fused is not None
    model.to(torch.float64)
    for p in model.parameters():
        assert p.dtype == torch.float64 and p.to_local().dtype == torch.float64  # type: ignore[operator]
    got = train(model)
    same(got, expected)
    check_fused(model, fused)
    assert all(b.dtype == torch.float64 for buf in fused.buffers for b in buf.buckets)


# -- held references ----------------------------------------------------------------------------
HELD = ("to_local", "state_dict", "detach", "view_of_full")


def _build_held(mesh: DeviceMesh, kind: str, fused_model: bool, holds: bool) -> tuple[
        nn.Module, FusedModule | None, list[Any], dict[str, torch.Tensor]]:
    """A meta model initialized the way training scripts do, with a reference kept by the
    caller (``box``) where ``holds``; returns the model, the layer, the box, and the full
    state dict of the ``view_of_full`` case (which the caller holds as well)."""
    with torch.device("meta"):
        model = MLP()
    shard(model, mesh)
    fused = fuse_fully_sharded(model, materialize=False) if fused_model else None
    box: list[Any] = []
    full: dict[str, torch.Tensor] = {}
    if kind == "view_of_full":  # shards loaded as views of a full checkpoint held by the caller
        full = full_state()
        rank, world = dist.get_rank(), dist.get_world_size()
        # No collective here (distribute_tensor scatters): ranks differ in what they hold.
        local = {k: DTensor.from_local(v.chunk(world)[rank] if holds
                                       else v.chunk(world)[rank].clone(),
                                       mesh, [Shard(0)], run_check=False, shape=v.shape,
                                       stride=v.stride())
                 for k, v in full.items()}
        model.load_state_dict(local, assign=True)
        del local
        if not holds:
            full = {}
        return model, fused, box, full
    model.to_empty(device="cpu")
    model.reset_parameters()  # in place: the first forward adopts (no load_state_dict hook)
    if holds:
        if kind == "to_local":  # PyTorch's meta-init test leaves such a loop variable alive
            for p in model.parameters():
                keep = p.to_local()  # type: ignore[operator]
            box.append(keep)
        elif kind == "state_dict":
            box.append(model.state_dict())
        elif kind == "detach":
            box.append(model.b.weight.detach())
    return model, fused, box, full


def held_case(mesh: DeviceMesh, kind: str, ranks: str) -> None:
    holds = ranks == "all" or dist.get_rank() == 0
    ref, _, ref_box, ref_full = _build_held(mesh, kind, False, holds)
    expected = train(ref)
    del ref_box, ref_full
    model, fused, box, full = _build_held(mesh, kind, True, holds)
    assert fused is not None
    counts: list[int] = []
    originals: list[OriginalStorages] = []

    def between(step: int) -> None:
        if step == 0:
            originals.append(OriginalStorages(_params_of(model)))
        if step == 1:
            assert fused is not None
            counts.append(fused.kept_alive_count)
            box.clear()  # the user drops the reference: the next step frees the original
            full.clear()
            gc.collect()

    with warnings.catch_warnings(record=True) as caught, flatpool_log() as log:
        warnings.simplefilter("always")
        got = train(model, between=between)
    kept_logs = [m for m in log if m.startswith("kept alive: ")]
    released_logs = [m for m in log if m.startswith("released: ")]
    assert len(kept_logs) == len(released_logs) == counts[0], log
    same(got, expected)
    kept_warnings = [w for w in caught if issubclass(w.category, OriginalKeptAliveWarning)]
    if holds:
        assert counts[0] >= 1, f"nothing kept alive: {fused!r}"
        assert len(kept_warnings) == counts[0], [str(w.message) for w in kept_warnings]
        for w in kept_warnings:
            text = str(w.message)
            assert "bytes of the original shard storage kept alive, held by:" in text, text
            assert "(member " in text and "fsdp" in text, text
            assert w.filename.endswith("neverbreak_workers.py"), w.filename  # the user's line
        holders = " ".join(str(w.message) for w in kept_warnings)
        want = {"to_local": "list[0]", "state_dict": "dict['", "detach": "list[0]",
                "view_of_full": "dict['"}
        assert want[kind] in holders, holders
    else:
        assert counts[0] == 0 and not kept_warnings, [str(w.message) for w in kept_warnings]
    assert fused.kept_alive_count == 0 and fused.kept_alive == []
    assert originals[0].stale() == [], f"originals alive after the drop: {originals[0].stale()}"
    check_fused(model, fused)


def strict_still_raises(mesh: DeviceMesh) -> None:
    """``on_pinned="raise"`` keeps the old behaviour for strict users: a typed error."""
    from flatpool import PinnedStorageError

    model = MLP()
    model.load_state_dict(full_state())
    shard(model, mesh)
    lazy_init(model)
    keep = model.b.bias.to_local()  # type: ignore[operator]
    try:
        fuse_fully_sharded(model, on_pinned="raise")
    except PinnedStorageError as e:
        assert "keep" in str(e), str(e)
    else:
        raise AssertionError("on_pinned='raise' fused past a held reference")
    del keep


def reprs(mesh: DeviceMesh) -> None:
    model, fused = build(mesh, "eager")
    assert fused is not None
    text = repr(fused)
    # the user's class, not the one fully_shard made (FSDPMLP) (issue 32.8)
    assert text.startswith("FusedModule(MLP:") and "2/2 groups fused in 2 pool(s)" in text, text
    assert "valid=True" in text and "0 original(s) kept alive" in text, text
    for b in fused.buffers:
        r = repr(b)
        assert len(r) < 200 and "members" in r and "bytes" in r, r


def rank_local_failure(mesh: DeviceMesh, how: str, ranks: str) -> None:
    """Every flatpool operation of rank 0 (or of every rank) fails until the first step ends: the
    failing rank's groups train unfused that step, one warning says so, training equals plain
    FSDP2 (FSDP2 copies shards into its own all-gather input either way: the same collectives),
    and the next step's check fuses every group."""
    fails_here = ranks == "all" or dist.get_rank() == 0
    ref, _ = build(mesh, "ref")
    expected = train(ref)
    with FailingOps(fails_here) as fault, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, fused = build(mesh, how)
        assert fused is not None
        fused_groups: list[int] = []

        def between(step: int) -> None:
            if step == 1:
                fused_groups.append(sum(b.adopted for b in fused.buffers))
                fault.on = False  # the rank-local problem goes away

        got = train(model, between=between)
    same(got, expected)
    unfused = [w for w in caught if issubclass(w.category, UnfusedGroupWarning)]
    if fails_here:
        assert fault.raised and unfused, (fault.raised, [str(w.message) for w in caught])
        assert fused_groups == [0], f"a group fused although every operation failed: {fused!r}"
    else:
        assert not fault.raised and not unfused, [str(w.message) for w in unfused]
        assert fused_groups == [len(fused.buffers)], repr(fused)
    check_fused(model, fused)


def scenarios(mesh: DeviceMesh) -> dict[str, Callable[[], None]]:
    out: dict[str, Callable[[], None]] = {}
    for how in ("eager", "meta"):
        for op in APPLY:
            out[f"apply-{how}-{op}"] = lambda h=how, o=op: apply_case(mesh, h, o)
    out["pytorch-to_float64_after_init"] = lambda: pytorch_to_float64_after_init(mesh)
    for kind in HELD:
        for ranks in ("all", "rank0"):
            out[f"held-{kind}-{ranks}"] = lambda k=kind, r=ranks: held_case(mesh, k, r)
    for how in ("eager", "eager_lazy"):
        for ranks in ("all", "rank0"):
            out[f"rankfail-{how}-{ranks}"] = lambda h=how, r=ranks: rank_local_failure(mesh, h, r)
    out["strict-raises"] = lambda: strict_still_raises(mesh)
    out["reprs"] = lambda: reprs(mesh)
    return out


def run_all(only: str = "") -> dict[str, str | None]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return run_scenarios({name: fn for name, fn in scenarios(mesh).items() if only in name})


__all__ = ["run_all", "scenarios"]
