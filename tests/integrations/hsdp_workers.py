"""Scenarios run on every rank of a real 2-rank gloo job (real FSDP2, real collectives).

Each scenario returns nothing and raises ``AssertionError`` on failure; :func:`run_all` runs
them all in one job (a spawn costs seconds) and reports ``{name: None | traceback}`` per rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from flatpool import local_tensor, same_storage
from flatpool.integrations.hsdp import fused_all_gather, per_param_all_gather
from examples.census import OriginalStorages, live_storages
from flatpool.integrations.hsdp.fsdp2 import FusedModule, fsdp_param_groups, fuse_fully_sharded, lazy_init
from scenario_runs import run_scenarios

STEPS = 3


# -- models ------------------------------------------------------------------------------------
class MLP(nn.Module):
    """7 rows over 2 ranks: rank 1's shards are padded."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7, bias=bias)
        self.b = nn.Linear(7, 3, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(x))))


class EmptyShard(nn.Module):
    """``Linear(3, 1)`` last: over 2 ranks, rank 1's weight shard is ``(0, 3)``, its bias ``(0,)``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 3)
        self.b = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class TwoDtypes(nn.Module):
    """A trainable fp32 layer next to a frozen bf16 one, in one FSDP2 group."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(5, 9).to(torch.bfloat16).requires_grad_(False)
        self.train_ = nn.Linear(9, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.train_(self.frozen(x.to(torch.bfloat16)).float())


def _input(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    if name == "tied":
        return torch.randint(0, 11, (4, 3), generator=g), torch.randn(4, 3, 11, generator=g)
    width, out = 5, (1 if name == "empty_shard" else 3)
    return torch.randn(4, width, generator=g), torch.randn(4, out, generator=g)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "mlp_bias": lambda: MLP(True),
    "mlp_nobias": lambda: MLP(False),
    "tied": Tied,
    "two_dtypes": TwoDtypes,
    "empty_shard": EmptyShard,
}
OPTS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-1, momentum=0.9),
}


def _init_state(name: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in MODELS[name]().state_dict().items()}


def _shard(model: nn.Module, mesh: DeviceMesh, name: str) -> None:
    if name == "mlp_bias":  # two groups: nested fully_shard
        fully_shard(model.a, mesh=mesh)  # type: ignore[arg-type]
    fully_shard(model, mesh=mesh)


def _params_of(model: nn.Module) -> list:  # type: ignore[type-arg]
    return [p for g in fsdp_param_groups(model) for p in g.fsdp_params]


def build(name: str, mesh: DeviceMesh, how: str):  # type: ignore[no-untyped-def]
    """``how``: ref | adopt | meta (materialize into pool) | to_empty (adopt at first forward)."""
    init = _init_state(name)
    fused: FusedModule | None = None
    originals = None
    if how in ("meta", "to_empty"):
        with torch.device("meta"):
            model = MODELS[name]()
        _shard(model, mesh, name)
        fused = fuse_fully_sharded(model, materialize=(how == "meta"))
        if how == "to_empty":
            assert not any(b.adopted for b in fused.buffers), "meta groups must be skipped"
            model.to_empty(device="cpu")
        model.load_state_dict({k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in init.items()})
    else:
        model = MODELS[name]()
        model.load_state_dict(init)
        _shard(model, mesh, name)
        if how == "adopt":
            lazy_init(model)
            originals = OriginalStorages(_params_of(model))
            fused = fuse_fully_sharded(model)
    return model, fused, originals


def train(name: str, model: nn.Module, opt_name: str, steps: int = STEPS):  # type: ignore[no-untyped-def]
    opt = OPTS[opt_name]([p for p in model.parameters() if p.requires_grad])
    losses = []
    for step in range(steps):
        x, y = _input(name, step)
        loss = nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    full = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    return losses, full, opt


# -- checks ------------------------------------------------------------------------------------
def check_aliasing(model: nn.Module, fused: FusedModule, opt: torch.optim.Optimizer | None) -> None:
    assert fused.is_valid(), "a member left its slice"
    pools = [pl for b in fused.buffers for pl in b.pools()]
    for g in fused.groups:
        for p in g.fsdp_params:
            data, local = p._sharded_param_data, local_tensor(p.sharded_param)
            assert any(pl.owns(data) for pl in pools), f"{p._param_fqn}: data not in pool"
            assert any(pl.owns(local) for pl in pools), f"{p._param_fqn}: local not in pool"
            assert same_storage(data, local)
            assert data._base is None or any(pl.owns(data._base) for pl in pools)
            assert local._base is None or any(pl.owns(local._base) for pl in pools)
    for n, prm in model.named_parameters():
        assert any(pl.owns(local_tensor(prm)) for pl in pools), f"module param {n} not in pool"
    if opt is not None:
        in_opt = {id(p) for grp in opt.param_groups for p in grp["params"]}
        assert in_opt == {id(p) for p in model.parameters() if p.requires_grad}
    live = live_storages(_params_of(model), [f for b in fused.buffers for f in b.flats()])
    assert all(r.kind == "flat" for r in live), f"shard storage outside the pools: {live}"


def check_all_gather(fused: FusedModule) -> None:
    for g, buf in zip(fused.groups, fused.buffers):
        for bucket in buf.buckets:
            got = fused_all_gather(bucket)
            ref = per_param_all_gather(g.fsdp_params, bucket.members)
            for m, a, b in zip(bucket.members, got, ref):
                full = g.fsdp_params[m.index].sharded_param.full_tensor()
                assert torch.equal(a, b) and torch.equal(a, full), f"member {m.index} differs"


class TorchRefuses(Exception):
    """This torch's FSDP2 itself rejects the scenario's model (no flatpool code involved)."""


def refuse_if_torch_does(name: str, mesh: DeviceMesh) -> None:
    """Raise :class:`TorchRefuses` when this torch's FSDP2 rejects model ``name`` unfused, at
    its lazy init (torch 2.7 wants one dtype per group, frozen parameters included)."""
    model, _, _ = build(name, mesh, "ref")
    try:
        lazy_init(model)
    except AssertionError as e:
        if "uniform original parameter dtype" in str(e):
            raise TorchRefuses(f"torch {torch.__version__} FSDP2: {e}") from e
        raise


def compare(name: str, opt_name: str, how: str, mesh: DeviceMesh) -> None:
    refuse_if_torch_does(name, mesh)
    ref_model, _, _ = build(name, mesh, "ref")
    ref = train(name, ref_model, opt_name)
    model, fused, originals = build(name, mesh, how)
    assert fused is not None
    if how == "meta":
        check_aliasing(model, fused, None)
    if originals is not None:
        assert not originals.stale(), f"stale originals: {originals.stale()}"
        check_aliasing(model, fused, None)
    check_all_gather(fused)
    got = train(name, model, opt_name)
    assert got[0] == ref[0], f"losses differ: {got[0]} vs {ref[0]}"
    for a, b in zip(got[1], ref[1]):
        assert torch.equal(a, b), "parameters differ"
    check_aliasing(model, fused, got[2])  # after lazy init and training
    check_all_gather(fused)


def load_state_dict_case(mesh: DeviceMesh, assign: bool) -> None:
    """Load trained weights into an adopted model: pool stays valid, loaded values are used."""
    name = "mlp_bias"
    src, _, _ = build(name, mesh, "ref")
    train(name, src, "adam")
    sd = {k: v.detach().clone() for k, v in src.state_dict().items()}
    model, fused, _ = build(name, mesh, "adopt")
    assert fused is not None
    if assign:  # fresh tensors the caller drops: FSDP2 installs them, the layer re-adopts
        model.load_state_dict({k: v.clone() for k, v in sd.items()}, assign=True)
        # Where FSDP2 kept the caller's tensor as the local shard (unpadded ranks), the
        # caller's dict pins it until the call returns and re-adoption is deferred; where it
        # re-padded into a fresh tensor, the post-load hook re-adopts at once.
        if not fused.is_valid():
            assert fused.deferred == 1, "invalid pool without a deferred re-adoption"
            fused.revalidate()  # what the pre-forward hook does
    else:
        model.load_state_dict(sd)
    assert fused.is_valid(), "pool not valid after load_state_dict"
    for k, v in model.state_dict().items():
        assert torch.equal(v.full_tensor(), sd[k].full_tensor()), f"{k} not loaded"
    ref, _, _ = build(name, mesh, "ref")
    ref.load_state_dict(sd)
    a, b = train(name, model, "sgd_momentum"), train(name, ref, "sgd_momentum")
    assert a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    check_aliasing(model, fused, a[2])


def torch_repads_padded_shards(mesh: DeviceMesh) -> bool:
    """Does this torch's ``FSDPParam.reset_sharded_param`` (FSDP2's lazy init runs it) copy this
    rank's uneven shards into fresh padded memory even when they already are their padded
    data? torch 2.7 does, on every call; later releases keep them. Measured on an unfused
    model (the old data stays referenced, so new memory cannot reuse its address)."""
    model, _, _ = build("empty_shard", mesh, "ref")
    params = _params_of(model)
    old = [p._sharded_param_data for p in params]
    for p in params:
        p.reset_sharded_param()
    return any(not same_storage(p._sharded_param_data, o) for p, o in zip(params, old))


def empty_shard_case(mesh: DeviceMesh, how: str) -> None:
    """A rank whose shard of a parameter is empty reads as valid every step: no re-adoption and
    no diagnosis runs (``revalidate()`` stays ``is_valid``: pointer reads per member), so both
    ranks take the fused path every step; training equals FSDP2 without fusion.

    Where torch's lazy init itself moves this rank's uneven shards into fresh memory at the
    first forward (:func:`torch_repads_padded_shards`), the layer re-adopts them there, once:
    the first step is diagnosed, no later one is."""
    from flatpool.integrations.hsdp import validity

    name = "empty_shard"
    repads = torch_repads_padded_shards(mesh)
    ref_model, _, _ = build(name, mesh, "ref")
    ref = train(name, ref_model, "adam", steps=4)
    model, fused, _ = build(name, mesh, how)
    assert fused is not None and fused.is_valid(), "not valid before training"
    if dist.get_rank() == 1:
        assert tuple(local_tensor(model.b.weight).shape) == (0, 3)  # type: ignore[arg-type]
        assert tuple(local_tensor(model.b.bias).shape) == (0,)  # type: ignore[arg-type]
    step = [0]
    readoptions_before = []  # fused.readoptions as each step starts

    def next_step(*_: object) -> None:
        step[0] += 1
        readoptions_before.append(fused.readoptions)

    hook = model.register_forward_pre_hook(next_step, prepend=True)  # runs before FSDP's
    diagnosed = []
    real = validity.member_problems

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        diagnosed.append((step[0], args[1].index))
        return real(*args, **kwargs)

    validity.member_problems = counting  # type: ignore[assignment]
    try:
        got = train(name, model, "adam", steps=4)
    finally:
        validity.member_problems = real  # type: ignore[assignment]
        hook.remove()
    assert fused.is_valid(), "not valid after 4 steps"
    if repads:
        assert all(s == 1 for s, _ in diagnosed), diagnosed
        assert readoptions_before[1] == fused.readoptions, (readoptions_before, fused.readoptions)
    else:
        assert fused.readoptions == 0 and not diagnosed, (fused.readoptions, diagnosed)
    assert got[0] == ref[0] and all(torch.equal(a, b) for a, b in zip(got[1], ref[1]))
    check_aliasing(model, fused, got[2])


def scenarios(mesh: DeviceMesh) -> dict[str, Callable[[], None]]:
    out: dict[str, Callable[[], None]] = {}
    for name, opt in [("mlp_bias", "adam"), ("mlp_nobias", "sgd_momentum"), ("tied", "adam"),
                      ("two_dtypes", "sgd_momentum"), ("mlp_nobias", "adam")]:
        out[f"adopt-{name}-{opt}"] = lambda n=name, o=opt: compare(n, o, "adopt", mesh)
    out["meta-mlp_bias-adam"] = lambda: compare("mlp_bias", "adam", "meta", mesh)
    out["meta-tied-sgd_momentum"] = lambda: compare("tied", "sgd_momentum", "meta", mesh)
    out["to_empty-mlp_nobias-adam"] = lambda: compare("mlp_nobias", "adam", "to_empty", mesh)
    out["load_state_dict-inplace"] = lambda: load_state_dict_case(mesh, assign=False)
    out["load_state_dict-assign"] = lambda: load_state_dict_case(mesh, assign=True)
    for how in ("adopt", "meta", "to_empty"):
        out[f"empty_shard-{how}"] = lambda h=how: empty_shard_case(mesh, h)
    from hp_double import hp_bug_case  # noqa: PLC0415

    out["hyperparallel-double"] = hp_bug_case
    from checkpoint_workers import scenarios as checkpoint_scenarios  # noqa: PLC0415

    out.update(checkpoint_scenarios(mesh))
    return out


def run_all() -> dict[str, str | None]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return run_scenarios(scenarios(mesh), skips=(TorchRefuses,))
