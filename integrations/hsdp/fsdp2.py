"""Apply the fusion layer to every param group of a ``fully_shard``-ed module and keep it valid.

FSDP2 rebinds a member's storage in two places, both through ``FSDPParam.reset_sharded_param``:
``nn.Module._apply`` (``to_empty``, ``.to``) and a ``load_state_dict`` post-hook. An in-place
``load_state_dict`` leaves the member on its slice (``reset_sharded_param`` sees the same storage
and does nothing); ``to_empty`` and ``load_state_dict(assign=True)`` install new storages. So the
layer re-validates (and re-adopts what moved) at the two points that matter:

* after ``load_state_dict`` (a post-hook on the root, which runs after FSDP2's own; with
  ``assign=True`` the caller's state dict pins the new storages until the call returns, so
  that case is left to the next point), and
* before the first all-gather of every forward (a forward pre-hook on the root, prepended so it
  runs before FSDP2's own pre-forward; it runs FSDP2's lazy init first, which on torch 2.7
  re-pads uneven shards into fresh memory), which also catches ``to_empty`` and groups that
  were still on meta when :func:`fuse_fully_sharded` was called.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule
from torch.utils.hooks import RemovableHandle

from flatpool import torch_compat as tc
from flatpool import InvalidTypeError, PinnedStorageError

from .group import GroupBuffers, adopt_group
from .members import data_of, is_meta
from .meta import materialize_group
from .validity import is_valid, readopt_group


def fsdp_param_groups(module: nn.Module) -> Iterator[FSDPParamGroup]:
    """Every FSDP2 param group under ``module`` (each ``fully_shard`` call makes at most one)."""
    seen: set[int] = set()
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            for g in tc.fsdp_state_param_groups(sub._get_fsdp_state()):
                if id(g) not in seen:
                    seen.add(id(g))
                    yield g


def lazy_init(module: nn.Module) -> None:
    """Run FSDP2's lazy initialization now (it otherwise runs at the first forward).

    FSDP2 pads and re-saves every member there (``reset_sharded_param``); HyperParallel builds
    its flat buffer at that point too. Uses FSDP2's private ``FSDPState._lazy_init``.
    """
    if not isinstance(module, FSDPModule):
        raise InvalidTypeError(
            f"{type(module).__name__} is not a fully_shard-ed module: call "
            "torch.distributed.fsdp.fully_shard(module) first"
        )
    module._get_fsdp_state()._lazy_init()


def _world_size(group: FSDPParamGroup) -> int:
    return int(getattr(group.mesh_info, "shard_mesh_size", 1))


class FusedModule:
    """The layer applied to one ``fully_shard``-ed module: one :class:`GroupBuffers` per group.

    Build it with :func:`fuse_fully_sharded`. ``buffers[i]`` belongs to ``groups[i]``.
    """

    def __init__(self, module: nn.Module, alignment: int = 1) -> None:
        self.module = module
        self.alignment = alignment
        self.groups: list[FSDPParamGroup] = list(fsdp_param_groups(module))
        self.buffers: list[GroupBuffers] = [GroupBuffers(skipped="not adopted yet")] * len(
            self.groups
        )
        self.readoptions: int = 0
        """How many times a moved member was brought back (for tests and logs)."""
        self._handles: list[RemovableHandle] = []
        self.deferred = 0
        """Re-adoptions put off from ``load_state_dict`` to the next forward (pinned then)."""

    def _adopt(self, i: int, materialize: bool = False) -> None:
        g = self.groups[i]
        if materialize and g.fsdp_params and all(
            is_meta(data_of(p, j)) for j, p in enumerate(g.fsdp_params)
        ):
            self.buffers[i] = materialize_group(
                g.fsdp_params, device=g.device, alignment=self.alignment, name=f"fsdp{i}"
            )
            return
        self.buffers[i] = adopt_group(
            g.fsdp_params,
            device=g.device,
            world_size=_world_size(g),
            alignment=self.alignment,
            name=f"fsdp{i}",
        )

    def revalidate(self) -> None:
        """Bring every group back into its pools: adopt late groups, re-adopt moved members.

        On a healthy rank this is :func:`is_valid` per group: a few TensorImpl reads a member
        (storage keys and offsets, so an empty shard on a trailing rank reads as in place); the
        diagnosis and re-adoption run only when a member did move."""
        for i, g in enumerate(self.groups):
            buf = self.buffers[i]
            if not buf.adopted:
                self._adopt(i)
            elif not is_valid(buf, g.fsdp_params):
                self.readoptions += readopt_group(buf, g.fsdp_params)

    def is_valid(self) -> bool:
        """Every adoptable group adopted, and every member on its slice."""
        return all(
            b.adopted and is_valid(b, g.fsdp_params) for g, b in zip(self.groups, self.buffers)
        )

    def install_hooks(self) -> None:
        def pre_forward(*_: Any) -> None:
            # FSDP2's lazy init (first thing in this forward otherwise; idempotent) can move
            # shards: torch 2.7's reset_sharded_param re-pads every uneven shard into fresh
            # memory. Run it first, so the check sees where the all-gather will read.
            lazy_init(self.module)
            with torch.no_grad():
                self.revalidate()

        def post_load(*_: Any) -> None:
            # With ``assign=True`` the caller's state dict still holds the tensors FSDP2 just
            # installed until ``load_state_dict`` returns: re-adoption would find them pinned.
            # flatpool rolls back cleanly, and the pre-forward hook re-adopts once they are gone.
            with torch.no_grad():
                try:
                    self.revalidate()
                except PinnedStorageError:
                    self.deferred += 1

        self._handles.append(self.module.register_forward_pre_hook(pre_forward, prepend=True))
        self._handles.append(self.module.register_load_state_dict_post_hook(post_load))  # type: ignore[no-untyped-call]

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def fuse_fully_sharded(
    module: nn.Module, *, alignment: int = 1, keep_valid: bool = True, materialize: bool = True
) -> FusedModule:
    """Adopt the shards of every param group of ``module`` (after ``fully_shard``).

    Groups whose shards are all on meta are materialized zero-copy into their pools
    (:func:`flatpool.integrations.hsdp.meta.materialize_group`; initialize the module afterwards with
    ``reset_parameters()`` or ``load_state_dict``, *not* ``to_empty``) unless ``materialize`` is
    false, in which case they are adopted at the first forward after ``to_empty``. With
    ``keep_valid`` the hooks described in this module's docstring are installed.
    """
    fused = FusedModule(module, alignment)
    with torch.no_grad():
        for i in range(len(fused.groups)):
            fused._adopt(i, materialize=materialize)
    if keep_valid:
        fused.install_hooks()
    return fused


__all__ = ["FusedModule", "fsdp_param_groups", "fuse_fully_sharded", "lazy_init"]
