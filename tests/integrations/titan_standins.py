"""Stand-ins for torchtitan's spec, optimizer container and trainer build order (torchtitan 0.3.0
does not train on CPU), with the call signatures and the hostile parts of the real ones:

* the spec is a dataclass whose ``parallelize_fn(model, parallel_dims, job_config)`` applies
  activation checkpointing (``checkpoint_wrapper``, non-reentrant) per block, ``fully_shard``
  per block and on the root, and returns the model;
* the container is an ``Optimizer`` subclass over *every* parameter (``Optimizer.__init__`` with
  all of them, for its hooks) holding one optimizer per model part, ``step()`` looping over them;
  ``optimizer.implementation`` picks ``fused`` (torchtitan's default) or ``foreach``;
* the trainer builds each part on meta, parallelizes, ``to_empty`` + ``init_weights`` under
  ``no_grad``, builds the container, then calls ``post_optimizer_build_fn(optimizers,
  model_parts, parallel_dims)`` and makes one LR scheduler per inner optimizer (torchtitan's
  ``LRSchedulersContainer``); each step ``zero_grad``, forward through the parts, backward,
  ``clip_grad_norm_`` over every parameter (foreach), ``step``, the schedulers' ``step``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from flatpool import local_tensor


class Stage(nn.Module):
    """A model part (a pipeline stage): blocks of odd widths (rank 1's shards are padded)."""

    def __init__(self, widths: tuple[int, ...], first: int = 0) -> None:
        super().__init__()  # (layer names go on across stages, as pipelining keeps them)
        self.layers = nn.ModuleDict({str(first + i): nn.Linear(a, b)
                                     for i, (a, b) in enumerate(zip(widths, widths[1:]))})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return x

    def init_weights(self, full: dict[str, torch.Tensor], mesh: DeviceMesh) -> None:
        """In place, as torchtitan's ``init_weights`` (no ``load_state_dict``)."""
        for name, p in self.named_parameters():
            key = name.replace("_checkpoint_wrapped_module.", "")
            local_tensor(p).copy_(distribute_tensor(full[key], mesh, [Shard(0)]).to_local())


WIDTHS = ((6, 9, 7), (7, 5, 3))


@dataclasses.dataclass
class ParallelDims:
    mesh: DeviceMesh
    dp_shard_enabled: bool = True


@dataclasses.dataclass
class JobConfig:
    ac_mode: str = "full"
    implementation: str = "foreach"  # torchtitan's optimizer.implementation


def parallelize(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    """torchtitan's parallelize_fn shape: AC per block, fully_shard per block, then the root."""
    assert isinstance(model, Stage)
    for name, block in list(model.layers.items()):
        if job_config.ac_mode == "full":
            block = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            model.layers[name] = block
        fully_shard(block, mesh=parallel_dims.mesh)
    fully_shard(model, mesh=parallel_dims.mesh)
    return model


@dataclasses.dataclass
class ModelSpec:
    name: str
    parallelize_fn: Callable[..., nn.Module]
    pipelining_fn: Callable[..., Any] | None
    post_optimizer_build_fn: Callable[..., None] | None


class OptimizersContainer(torch.optim.Optimizer):
    """torchtitan's container: one optimizer per model part, itself an Optimizer over all."""

    def __init__(self, model_parts: list[nn.Module], optimizer_cls: type[torch.optim.Optimizer],
                 optimizer_kwargs: dict[str, Any]) -> None:
        all_params = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.model_parts = model_parts
        for model in model_parts:
            params = [p for p in model.parameters() if p.requires_grad]
            self.optimizers.append(optimizer_cls(params, **optimizer_kwargs))
            all_params.extend(params)
        torch.optim.Optimizer.__init__(self, all_params, optimizer_kwargs)

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)

    def step(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        for optimizer in self.optimizers:
            optimizer.step(*args, **kwargs)

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        return {k: v for part, opt in zip(self.model_parts, self.optimizers)
                for k, v in get_optimizer_state_dict(part, opt, options=options).items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        for part, opt in zip(self.model_parts, self.optimizers):
            set_optimizer_state_dict(part, opt, state_dict, options=options)


def build_optimizers(model_parts: list[nn.Module], job_config: JobConfig) -> OptimizersContainer:
    impl = job_config.implementation
    kwargs = {"lr": 3e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
              "fused": impl == "fused", "foreach": impl == "foreach"}
    return OptimizersContainer(model_parts, torch.optim.AdamW, kwargs)


def build(spec: ModelSpec, mesh: DeviceMesh, job_config: JobConfig,
          ) -> tuple[list[nn.Module], OptimizersContainer]:
    """The trainer's build order, for two model parts (as pipelining makes them)."""
    parallel_dims = ParallelDims(mesh)
    parts = []
    for i, widths in enumerate(WIDTHS):
        torch.manual_seed(i)
        full = Stage(widths, 2 * i).state_dict()
        with torch.device("meta"):
            model = Stage(widths, 2 * i)
        model = spec.parallelize_fn(model, parallel_dims, job_config)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(full, mesh)  # type: ignore[operator]
        model.train()
        parts.append(model)
    optimizers = build_optimizers(parts, job_config)
    if spec.post_optimizer_build_fn is not None:
        spec.post_optimizer_build_fn(optimizers, parts, parallel_dims)
    return parts, optimizers


def schedulers(optimizers: OptimizersContainer) -> list[torch.optim.lr_scheduler.LRScheduler]:
    return [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s))
            for o in optimizers.optimizers]


def model_state_dict(parts: list[nn.Module]) -> dict[str, Any]:
    """torchtitan's ``ModelWrapper``: the parts' state dicts merged."""
    return {k: v for part in parts for k, v in get_model_state_dict(part).items()}


def train(parts: list[nn.Module], optimizers: OptimizersContainer,
          lr: list[torch.optim.lr_scheduler.LRScheduler], steps: range, rank: int,
          ) -> tuple[list[float], list[torch.Tensor]]:
    params = [p for part in parts for p in part.parameters()]
    losses = []
    for step in steps:
        optimizers.zero_grad()
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        for part in parts:
            x = part(x)
        loss = nn.functional.mse_loss(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5, foreach=True)
        optimizers.step()
        for scheduler in lr:
            scheduler.step()
        losses.append(loss.item())
    full = [p.full_tensor() if isinstance(p, DTensor) else p.detach()
            for part in parts for p in part.parameters()]
    return losses, full
