"""Flat optimizer steps on a real 2-rank FSDP2 job: flat vs torch's per-parameter foreach step.

Each scenario raises AssertionError on failure; :func:`run_all` reports ``{name: None |
traceback}`` per rank (one spawn for all of them).
"""

from __future__ import annotations

import copy
import shutil
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from flatpool import census, local_tensor
from flatpool.integrations.hsdp.fsdp2 import fuse_fully_sharded
from flatpool.integrations.hsdp import flat_optimizer
from flatpool.optim import FlatOptimizer
from scenario_runs import run_scenarios

STEPS = 20
ACCUMULATE = 2
MAX_NORM = 0.5


class Stack(nn.Module):
    """Odd row counts (rank 1's shards are padded), three FSDP2 groups."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 9)
        self.b = nn.Linear(9, 7)
        self.c = nn.Linear(7, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _flat_groups(fo: Any) -> int:
    """(pool, group) pairs stepped flat: one segment each, or more where a rank's padded shard
    tail ends one (a flat kernel writes only its members' bytes)."""
    return len({(s.pool.name, s.group) for s in fo.segments})


def build(mesh: DeviceMesh, fuse: bool, shard_kw: dict[str, Any] | None = None,
          **flat_kw: Any) -> tuple[nn.Module, torch.optim.Optimizer, FlatOptimizer | None]:
    torch.manual_seed(0)
    model = Stack()
    for m in (model.a, model.b, model):
        fully_shard(m, mesh=mesh, **(shard_kw or {}))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.1, foreach=True)
    if not fuse:
        return model, opt, None
    fused = fuse_fully_sharded(model)
    with warnings.catch_warnings():
        if shard_kw is None:
            warnings.simplefilter("error")  # every group steps flat: no fallback warning
        fo = flat_optimizer(fused, opt, **flat_kw)
    assert _flat_groups(fo) == 3 and not fo.fallback, (fo.segments, fo.reasons)
    return model, opt, fo


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
    return torch.randn(4, 6, generator=g), torch.randn(4, 5, generator=g)


CLIPPED: list[bool] = []


def run_steps(model: nn.Module, opt: torch.optim.Optimizer, fo: FlatOptimizer | None,
              steps: range, no_sync: bool = False, storages: bool = True) -> list[float]:
    losses = []
    for step in steps:
        total = 0.0
        for micro in range(ACCUMULATE):
            if no_sync:  # FSDP2 accumulates unsharded, one reduce-scatter at the last micro-batch
                model.set_requires_gradient_sync(micro == ACCUMULATE - 1)  # type: ignore[operator]
            x, y = batch(step, micro)
            loss = nn.functional.mse_loss(model(x), y) / ACCUMULATE
            loss.backward()
            total += loss.item()
        if fo is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=True)
            opt.step()
        else:
            norm = fo.clip_grad_norm_(MAX_NORM)
            CLIPPED.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm) > MAX_NORM)
            fo.step()
            if storages:
                after_step_storages(model, opt, fo)
        opt.zero_grad(set_to_none=step % 2 == 0)
        losses.append(total)
    return losses


def after_step_storages(model: nn.Module, opt: torch.optim.Optimizer, fo: FlatOptimizer) -> None:
    """One parameter, one gradient, one per state kind per (group, dtype); nothing per
    parameter."""
    records = census(model, opt).records
    outside = [r for r in records if r.pool is None]
    assert not outside, [r.referrers for r in outside]
    names = sorted(r.pool or "" for r in records)
    groups = [p.name for p in fo.pools]
    expected = sorted(f"{g}{suffix}" for g in groups
                      for suffix in ("", "/grad", "/exp_avg", "/exp_avg_sq", "/step"))
    assert names == expected, (names, expected)


def local_state(opt: torch.optim.Optimizer) -> dict[tuple[int, str], torch.Tensor]:
    sd = opt.state_dict()["state"]
    return {(k, kind): local_tensor(v) for k, st in sd.items() for kind, v in st.items()}


def full_params(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in model.parameters()]


def assert_identical(a: tuple[nn.Module, torch.optim.Optimizer], b: tuple[nn.Module, torch.optim.Optimizer]) -> None:
    for x, y in zip(full_params(a[0]), full_params(b[0])):
        assert torch.equal(x, y)
    sa, sb = local_state(a[1]), local_state(b[1])
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def flat_vs_foreach(mesh: DeviceMesh) -> None:
    ref = build(mesh, fuse=False)
    flat = build(mesh, fuse=True)
    l_ref = run_steps(*ref, range(STEPS))
    l_flat = run_steps(*flat, range(STEPS))
    assert l_ref == l_flat, (l_ref, l_flat)
    assert_identical(ref[:2], flat[:2])
    # into the pool when no gradient is left: the first step and after each zero_grad(None)
    assert reduced_into_pools(flat[0]) == [STEPS // 2 + 1] * 3, reduced_into_pools(flat[0])
    assert any(CLIPPED) and not all(CLIPPED), CLIPPED  # clipping was active in some steps


def _shared_dir() -> str:
    made = tempfile.mkdtemp(prefix="flatpool-optim-dcp-") if dist.get_rank() == 0 else None
    box: list[str | None] = [made]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return box[0]


def dcp_resume(mesh: DeviceMesh) -> None:
    ref = build(mesh, fuse=False)
    run_steps(*ref, range(STEPS))
    first = build(mesh, fuse=True)
    half = STEPS // 2
    run_steps(*first, range(half))
    path = _shared_dir()
    try:
        model, opt, _ = first
        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=path)
        dist.barrier()
        model2, opt2, fo2 = build(mesh, fuse=True)
        sd = {"model": get_model_state_dict(model2), "optim": get_optimizer_state_dict(model2, opt2)}
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(model2, sd["model"])
        set_optimizer_state_dict(model2, opt2, sd["optim"])
        del sd
        run_steps(model2, opt2, fo2, range(half, STEPS))
        assert fo2 is not None and fo2.replans >= 1
        assert all(reduced_into_pools(model2)), reduced_into_pools(model2)
        assert_identical(ref[:2], (model2, opt2))
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)


def no_sync_and_forward_checks(mesh: DeviceMesh) -> None:
    ref = build(mesh, fuse=False)
    flat = build(mesh, fuse=True, verify="forward")
    assert run_steps(*ref, range(6), no_sync=True) == run_steps(*flat, range(6), no_sync=True)
    assert_identical(ref[:2], flat[:2])
    assert reduced_into_pools(flat[0]) == [4] * 3, reduced_into_pools(flat[0])  # as above


def clone(v: torch.Tensor) -> torch.Tensor:
    """A copy with storage of its own (DTensors too: ``deepcopy`` refuses FSDP2's state)."""
    if isinstance(v, DTensor):
        return DTensor.from_local(local_tensor(v).clone(), v.device_mesh, v.placements,
                                  shape=v.size(), stride=v.stride())
    return v.detach().clone()


def reload_in_place(mesh: DeviceMesh) -> None:
    """Model and optimizer state reloaded mid-training (in-place ``load_state_dict`` of the
    module, ``load_state_dict`` of a deep copy of the optimizer's): the flat step re-adopts the
    new state tensors into its pools once and goes on identically."""
    _reload(mesh, to_empty=False)


def to_empty_reload(mesh: DeviceMesh) -> None:
    """``model.to_empty(device="cpu")`` mid-training (FSDP2 swaps every DTensor parameter for
    new memory), then the module's and the optimizer's state loaded back: the fusion hooks
    re-adopt the new shards, the flat step re-plans once, and training goes on identically."""
    _reload(mesh, to_empty=True)


def _reload(mesh: DeviceMesh, *, to_empty: bool) -> None:
    ref = build(mesh, fuse=False)
    flat = build(mesh, fuse=True)
    for m, o, fo in (ref, flat):
        run_steps(m, o, fo, range(3))
        msd = {k: clone(v) for k, v in m.state_dict().items()}
        sd = o.state_dict()
        osd = {"state": {k: {kind: clone(v) for kind, v in st.items()} for k, st in sd["state"].items()},
               "param_groups": copy.deepcopy(sd["param_groups"])}
        del sd
        if to_empty:
            m.to_empty(device="cpu")
        m.load_state_dict(msd)
        o.load_state_dict(osd)
        del msd, osd
        run_steps(m, o, fo, range(3, 6))
    assert flat[2] is not None and flat[2].replans == 1
    assert_identical(ref[:2], flat[:2])


def torchtitan_order(mesh: DeviceMesh, materialize: bool) -> None:
    """torchtitan's build order (issue 30, case 8): fuse on meta, ``to_empty()`` and init, build
    the optimizer and the flat optimizer (the shards are outside their pools then: every group
    is torch's, with a warning), and the first forward puts the shards back: the flat step
    plans again and steps flat, with the fused plan's storages. Until issue 30 it never
    re-planned (117 state storages instead of 18 on a small llama)."""
    ref = build(mesh, fuse=False)
    torch.manual_seed(0)
    full = Stack().state_dict()
    with torch.device("meta"):
        model = Stack()
    fully_shard(model.a, mesh=mesh)
    fully_shard(model.b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    fused = fuse_fully_sharded(model, materialize=materialize)
    model.to_empty(device="cpu")
    with torch.no_grad():  # init in place, as torchtitan's init_weights (no load_state_dict hook)
        for name, p in model.named_parameters():
            local_tensor(p).copy_(distribute_tensor(full[name], mesh, [Shard(0)]).to_local())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.1, foreach=True)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        fo = flat_optimizer(fused, opt)
    assert fo.fallback == [0], (fo.reasons, [str(w.message) for w in said])
    l_ref = run_steps(*ref, range(STEPS))
    l_flat = run_steps(model, opt, fo, range(STEPS))
    assert l_ref == l_flat
    assert fo.replans >= 1 and _flat_groups(fo) == 3 and not fo.fallback, (fo.replans, fo.reasons)
    assert_identical(ref[:2], (model, opt))


class Branchy(nn.Module):
    """A submodule used every other step (``d``) and a layer frozen mid-training (``b``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 9)
        self.b = nn.Linear(9, 7)
        self.d = nn.Linear(7, 7)
        self.c = nn.Linear(7, 5)
        self.use_d = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        if self.use_d:
            h = torch.tanh(self.d(h))
        return self.c(h)


def unused_and_frozen(mesh: DeviceMesh) -> None:
    """An FSDP2 group the forward skips and a layer frozen mid-training get no gradient and are
    skipped by the step, as on plain FSDP2 (issue 30, case 7): the pre-installed views nothing
    wrote to are given back as ``None`` when the backward ends, before clipping reads them."""
    runs = []
    for fuse in (False, True):
        torch.manual_seed(0)
        model = Branchy()
        for sub in (model.a, model.b, model.d):
            fully_shard(sub, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.1, foreach=True)
        fo = None
        if fuse:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                fo = flat_optimizer(fuse_fully_sharded(model), opt)
        seen = []
        for step in range(6):
            model.use_d = step % 2 == 0
            if step == 3:
                model.b.requires_grad_(False)
            x, y = batch(step, 0)
            nn.functional.mse_loss(model(x), y).backward()
            seen.append([p.grad is None for p in model.parameters()])
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=True)
            (opt.step if fo is None else fo.step)()
            opt.zero_grad()
        runs.append((model, opt, seen))
    (m_ref, o_ref, seen_ref), (m_flat, o_flat, seen_flat) = runs
    assert seen_ref == seen_flat, (seen_ref, seen_flat)
    assert any(any(s) for s in seen_ref)  # some gradients were None
    assert_identical((m_ref, o_ref), (m_flat, o_flat))


def memory_like_torch(mesh: DeviceMesh) -> None:
    """``zero_grad(set_to_none=True)`` frees the gradient pools (no gradient storage is left,
    as on plain FSDP2); the next backward makes one gradient block per pool again;
    ``set_to_none=False`` keeps and zeroes them."""
    from torch.multiprocessing.reductions import StorageWeakRef

    model, opt, fo = build(mesh, fuse=True)
    assert fo is not None
    for step in range(3):
        x, y = batch(step, 0)
        nn.functional.mse_loss(model(x), y).backward()
        grads = [r for r in census(model).records if "grad" in r.roles]
        assert sorted(r.pool or "" for r in grads) == sorted(f"{p.name}/grad" for p in fo.pools)
        blocks = [StorageWeakRef(b.storage) for b in fo.buffers()["grad"]]
        fo.step()
        opt.zero_grad(set_to_none=False)
        assert all(not local_tensor(p.grad).any() for p in model.parameters())  # type: ignore[arg-type]
        assert not any(b.expired() for b in blocks)
        opt.zero_grad()
        assert all(b.expired() for b in blocks) and not fo.buffers()["grad"]
        assert not [r for r in census(model, opt).records if "grad" in r.roles]


def grad_pool_storages(fo: FlatOptimizer) -> set[int]:
    return {b.storage.data_ptr() for b in fo.buffers()["grad"]}


def reduce_scatter_into_pool(mesh: DeviceMesh) -> None:
    """Every group's reduce-scatter writes into its gradient pool: each ``.grad`` is FSDP2's own
    view of the pool, recognized by the step as pooled (no copy), and zero_grad() frees it."""
    from flatpool import _torch_compat as tc

    model, opt, fo = build(mesh, fuse=True)
    assert fo is not None
    comms = [tc.fsdp_group_reduce_scatter_comm(g) for g in fsdp_groups(model)]
    assert all(type(c).__name__ == "_IntoPool" for c in comms), comms
    for step in range(3):
        x, y = batch(step, 0)
        nn.functional.mse_loss(model(x), y).backward()
        grads = [local_tensor(p.grad) for p in model.parameters()]  # type: ignore[arg-type]
        assert {g.untyped_storage().data_ptr() for g in grads} == grad_pool_storages(fo)
        assert fo.grads.pooled(0, len(fo.grads.members)) == [True] * len(fo.grads.members)
        fo.step()
        opt.zero_grad()
        assert not fo.buffers()["grad"]
    assert [c.handed for c in comms] == [3, 3, 3], [c.handed for c in comms]


def reduced_into_pools(model: nn.Module) -> list[int]:
    """Per group, how many reduce-scatters wrote into its gradient pool."""
    from flatpool import _torch_compat as tc

    return [getattr(tc.fsdp_group_reduce_scatter_comm(g), "handed", -1) for g in fsdp_groups(model)]


def after_close(mesh: DeviceMesh) -> None:
    """A second ``flat_optimizer`` after the first was closed takes the reduce-scatter over again
    (no warning); the closed one's comm handed out torch's buffers meanwhile."""
    ref = build(mesh, fuse=False)
    torch.manual_seed(0)
    model = Stack()
    for m in (model.a, model.b, model):
        fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.1, foreach=True)
    fused = fuse_fully_sharded(model)
    first = flat_optimizer(fused, opt)
    steps = [run_steps(*ref, range(2))]
    flat = run_steps(model, opt, first, range(1))
    first.close()
    flat += run_steps(model, opt, None, range(1, 2))  # torch's own step: the comm hands out torch's
    assert reduced_into_pools(model) == [1, 1, 1], reduced_into_pools(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = flat_optimizer(fused, opt)
    steps += [run_steps(*ref, range(2, 6))]
    # step 1 zeroed torch's gradients in place (set_to_none=False): they are FSDP2's own tensors,
    # not flatpool's, so they stay the .grads (read at the step) until zero_grad() drops them
    flat += run_steps(model, opt, second, range(2, 3), storages=False)
    flat += run_steps(model, opt, second, range(3, 6))
    assert steps[0] + steps[1] == flat
    assert reduced_into_pools(model) == [2, 2, 2], reduced_into_pools(model)  # steps 3 and 5
    assert_identical(ref[:2], (model, opt))


def fsdp_groups(model: nn.Module) -> list[Any]:
    from flatpool.integrations.hsdp.fsdp2 import fsdp_param_groups

    return list(fsdp_param_groups(model))


EXTRA_OPS = ("aten::zero_", "aten::add_", "aten::copy_", "aten::fill_")


def gradient_path_ops(model: nn.Module, opt: torch.optim.Optimizer, fo: FlatOptimizer | None,
                      step: int) -> dict[str, dict[str, int]]:
    """The zero_/add_/copy_/fill_ calls of one steady step, counted by torch.profiler: in the
    forward + backward, and in the clip + step + zero_grad."""
    from torch.profiler import ProfilerActivity, profile

    run_steps(model, opt, fo, range(step))  # steady state: state made, pools freed
    with profile(activities=[ProfilerActivity.CPU]) as backward:
        x, y = batch(step, 0)
        nn.functional.mse_loss(model(x), y).backward()
    with profile(activities=[ProfilerActivity.CPU]) as stepped:
        if fo is None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=True)
            opt.step()
        else:
            fo.clip_grad_norm_(MAX_NORM)
            fo.step()
        opt.zero_grad()
    out = {}
    for phase, prof in (("backward", backward), ("step", stepped)):
        counts = dict.fromkeys(EXTRA_OPS, 0)
        for e in prof.events():
            if e.name in counts:
                counts[e.name] += 1
        out[phase] = counts
    return out


def extra_ops(plain: dict[str, int], flat: dict[str, int]) -> int:
    """Calls the flat run makes beyond plain FSDP2's, per op (fewer of one op offsets nothing)."""
    return sum(max(0, flat[k] - plain[k]) for k in plain)


def kernel_count(mesh: DeviceMesh) -> None:
    """One steady fused + flat step runs at most one zero_/add_/copy_/fill_ per group (3) more
    than plain FSDP2 + AdamW(foreach=True), in the backward and in the step (the backward ran
    one add_ per member and one zero_ per pool more: 9)."""
    plain = gradient_path_ops(*build(mesh, fuse=False), step=3)
    flat = gradient_path_ops(*build(mesh, fuse=True), step=3)
    assert extra_ops(plain["backward"], flat["backward"]) == 0, (plain, flat)
    assert extra_ops(plain["step"], flat["step"]) <= 3, (plain, flat)


def gradient_bytes_peak(model: nn.Module, opt: torch.optim.Optimizer, fo: FlatOptimizer | None,
                        step: int) -> tuple[int, int]:
    """The most bytes of gradient storage alive whenever FSDP2 finished a gradient in one steady
    backward (every ``.grad``'s storage, the gradient pools, and the reduce-scatter output FSDP2
    is viewing gradients out of: ``foreach_reduce``'s ``reduce_output``, read from its frame),
    and the bytes of gradients held after ``zero_grad()``."""
    import sys

    run_steps(model, opt, fo, range(step))
    params = list(model.parameters())

    def storages() -> dict[int, int]:
        seen = {b.storage.data_ptr(): b.capacity for b in (fo.buffers()["grad"] if fo else [])}
        for p in params:
            if p.grad is not None:
                st = local_tensor(p.grad).untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        return seen

    peak = [0]

    def seen(_: torch.Tensor) -> None:
        now = storages()
        frame = sys._getframe()
        while frame is not None and frame.f_code.co_name != "foreach_reduce":
            frame = frame.f_back  # type: ignore[assignment]
        assert frame is not None, "called from FSDP2's foreach_reduce"
        out = frame.f_locals["reduce_output"].untyped_storage()
        now[out.data_ptr()] = out.nbytes()
        peak[0] = max(peak[0], sum(now.values()))

    handles = [p.register_post_accumulate_grad_hook(seen) for p in params]
    try:
        x, y = batch(step, 0)
        nn.functional.mse_loss(model(x), y).backward()
    finally:
        for h in handles:
            h.remove()
    (opt.step if fo is None else fo.step)()
    opt.zero_grad()
    return peak[0], sum(storages().values())


def memory_peak(mesh: DeviceMesh) -> None:
    """Gradient bytes during the backward and between steps: no more than plain FSDP2 (the pools
    are made group by group as FSDP2 reduces, not all at the backward's start)."""
    plain = gradient_bytes_peak(*build(mesh, fuse=False), step=3)
    flat = gradient_bytes_peak(*build(mesh, fuse=True), step=3)
    assert flat[0] <= plain[0] and flat[1] <= plain[1] == 0, (plain, flat)


def fallback(mesh: DeviceMesh, reason: str, shard_kw: dict[str, Any] | None = None,
             mesh_flat: DeviceMesh | None = None, before: Callable[[nn.Module], None] | None = None,
             no_sync: bool = False, storages: bool = True) -> None:
    """A group FSDP2 cannot reduce-scatter into its pool: one warning naming ``reason``, and
    training identical to plain FSDP2 over steps with clipping and accumulation."""
    kw = dict(shard_kw or {})
    ref = build(mesh_flat or mesh, fuse=False, shard_kw=kw)
    torch.manual_seed(0)
    model = Stack()
    for m in (model.a, model.b, model):
        fully_shard(m, mesh=mesh_flat or mesh, **kw)
    if before is not None:
        before(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.1, foreach=True)
    fused = fuse_fully_sharded(model)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        fo = flat_optimizer(fused, opt)
    msgs = [str(w.message) for w in said if reason in str(w.message)]
    assert msgs, (reason, [str(w.message) for w in said])
    steps = range(6)
    assert run_steps(*ref, steps, no_sync) == run_steps(model, opt, fo, steps, no_sync, storages)
    assert_identical(ref[:2], (model, opt))


def _custom_comm(model: nn.Module) -> None:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class Mine(DefaultReduceScatter):  # type: ignore[misc]
        pass

    for m in (model.a, model.b, model):
        m.set_custom_reduce_scatter(Mine())  # type: ignore[operator]


def without_api(mesh: DeviceMesh) -> None:
    """A torch without ``FSDPModule.set_custom_reduce_scatter`` (before 2.9): today's path."""
    from torch.distributed.fsdp import FSDPModule

    api = FSDPModule.__dict__["set_custom_reduce_scatter"]
    delattr(FSDPModule, "set_custom_reduce_scatter")
    try:
        fallback(mesh, "has no FSDPModule.set_custom_reduce_scatter (added in torch 2.9)")
    finally:
        FSDPModule.set_custom_reduce_scatter = api  # type: ignore[method-assign]


def hand_out_fails(mesh: DeviceMesh) -> None:
    """The hand-out failing inside FSDP2's backward (a fault injected into it): the backward
    goes on with FSDP2's own buffer, one warning names the failure, training stays exact."""
    ref = build(mesh, fuse=False)
    model, opt, fo = build(mesh, fuse=True)
    assert fo is not None

    def failing(*_: Any) -> None:
        raise RuntimeError("injected")

    fo.grads.hand_out = failing  # type: ignore[method-assign]
    steps = range(4)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        flat = run_steps(model, opt, fo, steps, storages=False)
    assert run_steps(*ref, steps) == flat
    assert any("handing out the gradient pool failed (RuntimeError: injected)" in str(w.message)
               for w in said), [str(w.message) for w in said]
    assert reduced_into_pools(model) == [0, 0, 0]
    assert_identical(ref[:2], (model, opt))


def scenarios(mesh: DeviceMesh) -> dict[str, Callable[[], None]]:
    return {"fsdp2-flat-vs-foreach": lambda: flat_vs_foreach(mesh),
            "fsdp2-dcp-resume": lambda: dcp_resume(mesh),
            "fsdp2-no_sync-verify_forward": lambda: no_sync_and_forward_checks(mesh),
            "fsdp2-reload-in-place": lambda: reload_in_place(mesh),
            "fsdp2-to_empty-reload": lambda: to_empty_reload(mesh),
            "fsdp2-torchtitan-order": lambda: torchtitan_order(mesh, materialize=True),
            "fsdp2-torchtitan-order-adopt-at-forward": lambda: torchtitan_order(mesh, materialize=False),
            "fsdp2-unused-and-frozen": lambda: unused_and_frozen(mesh),
            "fsdp2-memory-like-torch": lambda: memory_like_torch(mesh),
            "fsdp2-reduce-scatter-into-pool": lambda: reduce_scatter_into_pool(mesh),
            "fsdp2-kernel-count": lambda: kernel_count(mesh),
            "fsdp2-reduce-scatter-after-close": lambda: after_close(mesh),
            "fsdp2-reduce-scatter-hand-out-fails": lambda: hand_out_fails(mesh),
            "fsdp2-gradient-bytes-peak": lambda: memory_peak(mesh),
            "fsdp2-fallback-reduce_dtype": lambda: fallback(
                mesh, "MixedPrecisionPolicy(reduce_dtype=torch.float64)",
                {"mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.float64)}),
            "fsdp2-fallback-cpu-offload": lambda: fallback(
                mesh, "CPU offload", {"offload_policy": CPUOffloadPolicy(pin_memory=False)},
                storages=False),  # (the fusion leaves CPU-offloaded groups unfused on CPU)
            "fsdp2-fallback-hsdp": lambda: fallback(
                mesh, "HSDP's replicate dimension",
                mesh_flat=init_device_mesh("cpu", (1, dist.get_world_size()),
                                           mesh_dim_names=("replicate", "shard"))),
            "fsdp2-fallback-custom-comm": lambda: fallback(
                mesh, "a custom reduce-scatter is set (Mine)", before=_custom_comm, no_sync=True),
            "fsdp2-fallback-no-api": lambda: without_api(mesh)}


def run_all() -> dict[str, str | None]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return run_scenarios(scenarios(mesh))


__all__ = ["run_all", "scenarios"]
