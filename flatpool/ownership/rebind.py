"""Low-level moves of one tensor object between storages, keeping its identity.

``set_`` under ``no_grad`` swaps the storage of a tensor object in place: same ``id``, still a
leaf ``nn.Parameter``, the optimizer keeps stepping it. It bumps the version counter, which
would make a pending graph that saved the tensor fail with "modified by an inplace operation";
the values do not change, so the counter is restored afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..aliasing import own_storage
from ..errors import AdoptionError

__all__ = ["autograd_base", "fresh_tensor_like", "own_storage", "set_storage", "version_of"]


def version_of(t: torch.Tensor) -> int:
    with torch._C.DisableTorchFunctionSubclass():
        try:
            return int(t._version)
        except RuntimeError:  # inference tensors have no version counter
            return -1


def restore_version(t: torch.Tensor, version: int) -> None:
    if version >= 0:
        torch._C._autograd._unsafe_set_version_counter((t,), (version,))


def set_storage(
    t: torch.Tensor,
    storage: torch.UntypedStorage,
    byte_offset: int,
    shape: Sequence[int],
    stride: Sequence[int],
) -> None:
    """Point tensor object ``t`` at ``storage`` (same geometry), keeping its version counter."""
    with torch._C.DisableTorchFunctionSubclass():
        item = t.element_size()
        if byte_offset % item:
            raise AdoptionError(
                f"cannot place a {t.dtype} tensor at byte {byte_offset}: not a multiple of its "
                f"element size {item}"
            )
        version = version_of(t)
        with torch.no_grad():
            t.set_(storage, byte_offset // item, tuple(shape), tuple(stride))
        restore_version(t, version)


def fresh_tensor_like(
    t: torch.Tensor,
    storage: torch.UntypedStorage,
    byte_offset: int,
    shape: Sequence[int],
    stride: Sequence[int],
) -> torch.Tensor:
    """A new base-less tensor on ``storage`` standing in for ``t`` (same dtype, requires_grad)."""
    with torch._C.DisableTorchFunctionSubclass():
        out = torch.empty(0, dtype=t.dtype, device=storage.device)
        with torch.no_grad():
            out.set_(storage, byte_offset // t.element_size(), tuple(shape), tuple(stride))
        if isinstance(t, torch.nn.Parameter):
            return torch.nn.Parameter(out, requires_grad=t.requires_grad)
        if t.requires_grad and t.is_leaf:
            out.requires_grad_(True)
        return out


def autograd_base(t: torch.Tensor) -> torch.Tensor | None:
    with torch._C.DisableTorchFunctionSubclass():
        base = t._base
    return base
