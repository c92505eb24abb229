"""Turn what a user calls a device into a checked ``torch.device``.

``torch_npu`` is imported only when a caller asks for ``"npu"``: importing it eagerly breaks
``import torch`` on machines without Huawei's CANN libraries.
"""

from __future__ import annotations

import importlib
import numbers
from typing import Union

import torch

from .errors import DeviceError, InvalidTypeError

DeviceLike = Union[str, torch.device, int]
"""What ``torch.device`` accepts (an int is an index of the current accelerator)."""

_SUPPORTED = ("cpu", "cuda", "npu")


def _load_npu_backend() -> object:
    """Import ``torch_npu`` on demand and return ``torch.npu``."""
    try:
        importlib.import_module("torch_npu")
    except Exception as exc:  # ImportError, OSError (libhccl.so), RuntimeError from its init
        raise DeviceError(
            "device 'npu' needs the torch_npu package and Huawei's CANN libraries, but "
            f"'import torch_npu' failed: {type(exc).__name__}: {exc}. Install the 'npu' extra "
            "(pip install 'flatpool[npu]') on a machine with CANN, or use device='cpu'/'cuda'."
        ) from exc
    backend = getattr(torch, "npu", None)
    if backend is None:
        raise DeviceError("torch_npu was imported but torch.npu is missing; check the install")
    return backend


def _accelerator_count(kind: str) -> int:
    if kind == "cuda":
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = _load_npu_backend()
    is_available = getattr(backend, "is_available")
    device_count = getattr(backend, "device_count")
    return int(device_count()) if is_available() else 0


def _current_index(kind: str) -> int:
    if kind == "cuda":
        return torch.cuda.current_device()
    return int(getattr(_load_npu_backend(), "current_device")())


def _accelerator_type() -> str | None:
    """The accelerator torch would put an int device on, without importing any backend."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None:
        # check_available: a CUDA build on a machine without a GPU names CUDA otherwise.
        current = accelerator.current_accelerator(check_available=True)
        return None if current is None else str(current.type)
    return "cuda" if torch.cuda.is_available() else None


def _from_index(index: int) -> torch.device:
    if index < 0:
        raise DeviceError(f"device index {index} is negative: give an index from 0, or 'cpu'")
    kind = _accelerator_type()
    if kind is None:
        raise DeviceError(
            f"device {index} names an accelerator index, but torch sees no accelerator on this "
            "machine (no CUDA device; NPU only once torch_npu is imported). Use device='cpu', or "
            f"'npu:{index}' on Ascend (flatpool then imports torch_npu).")
    return torch.device(kind, index)


def resolve_device(device: DeviceLike) -> torch.device:
    """Return ``device`` as a concrete, available ``torch.device`` or raise :class:`DeviceError`.

    ``"cuda"``/``"npu"`` without an index resolve to the current device, so two pools made the
    same way compare equal.
    """
    if type(device) is torch.device:  # (the most common, first: no abstract-class check)
        dev = device
    elif isinstance(device, bool):  # an int to Python, never meant as a device index
        raise InvalidTypeError(f"device must be a str, torch.device or int index, got {device!r}")
    elif isinstance(device, numbers.Integral):  # int, numpy integers
        dev = _from_index(int(device))
    elif isinstance(device, str):
        if device.split(":", 1)[0].strip() == "npu":
            # torch knows the 'npu' type only once torch_npu registered it: load it first so a
            # missing backend is reported with its import error, not as an unknown device.
            _load_npu_backend()
        try:
            dev = torch.device(device)
        except RuntimeError as exc:
            raise DeviceError(
                f"unknown device {device!r}: expected one of {', '.join(_SUPPORTED)} "
                "(optionally with an index, e.g. 'cuda:1') or a torch.device"
            ) from exc
    elif isinstance(device, torch.device):
        dev = device
    else:
        raise InvalidTypeError(
            f"device must be a str, torch.device or int (an accelerator index), got "
            f"{type(device).__name__}: {device!r}")

    if dev.type == "cpu":
        return dev if dev.index is None else torch.device("cpu")
    if dev.type == "meta":
        raise DeviceError(
            "a pool cannot live on the meta device: give the device its storage will live on "
            "and plan slices from meta tensors with pool.allocate_like()/pool.allocate()")
    if dev.type not in ("cuda", "npu"):
        raise DeviceError(
            f"device type {dev.type!r} is not supported: expected one of {', '.join(_SUPPORTED)}")
    count = _accelerator_count(dev.type)
    if count == 0:
        raise DeviceError(f"device {str(dev)!r} was asked for but no {dev.type} device is available")
    index = _current_index(dev.type) if dev.index is None else dev.index
    if not 0 <= index < count:
        raise DeviceError(
            f"device {str(dev)!r} does not exist: this machine has {count} {dev.type} device(s)")
    return torch.device(dev.type, index)


def allocator_counters(device: torch.device) -> dict[str, int] | None:
    """The caching allocator's allocated/reserved bytes on an accelerator, ``None`` on CPU."""
    if device.type == "cuda":
        return {
            "allocated": int(torch.cuda.memory_allocated(device)),
            "reserved": int(torch.cuda.memory_reserved(device)),
        }
    if device.type == "npu":
        backend = _load_npu_backend()
        return {
            "allocated": int(getattr(backend, "memory_allocated")(device)),
            "reserved": int(getattr(backend, "memory_reserved")(device)),
        }
    return None
