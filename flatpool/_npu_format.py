"""Refuse NPU tensors whose storage is in one of torch_npu's private formats.

torch_npu can keep a tensor's bytes in a blocked layout made for its matrix units
(FRACTAL_NZ, NC1HWC0, ...: after ``torch_npu.npu_format_cast_`` or
``torch_npu.empty_with_format``). Such a storage holds more bytes than numel x itemsize, in an
order torch's sizes and strides do not describe, so moving its bytes into a slice, or viewing a
pool's bytes with its geometry, would scramble it. A pool on ``"npu"`` therefore keeps its
storage in the plain ND format and adopts only tensors in a plain format; any other is refused
with :class:`~flatpool.errors.NpuFormatError`, which says how to convert it.

The format is read with ``torch_npu.get_npu_format`` (public torch_npu API), looked up only for a
tensor on an ``npu`` device: torch_npu is loaded then (no npu tensor exists without it), and
nothing is imported for CPU or CUDA tensors. Not yet verified on an NPU (docs/pool.md).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import SupportsInt, cast

import torch

from . import _torch_compat as tc
from .errors import DeviceError, NpuFormatError

ACL_FORMAT_ND = 2
"""``torch_npu.Format.ND``: the elements in row-major order, numel x itemsize bytes."""
PLAIN_FORMATS = frozenset({0, ACL_FORMAT_ND, 30})
"""ND, and the base formats torch_npu gives every 4-D (NCHW, 0) and 5-D (NCDHW, 30) tensor by
default (``InferFormat::GuessBaseFormat``): their storage is the elements in torch's row-major
order, like ND. NHWC and NDHWC are base formats too, but keep the elements in another order."""
FORMAT_NAMES = {
    -1: "UNDEFINED", 0: "NCHW", 1: "NHWC", 2: "ND", 3: "NC1HWC0", 4: "FRACTAL_Z",
    12: "NC1HWC0_C04", 16: "HWCN", 27: "NDHWC", 29: "FRACTAL_NZ", 30: "NCDHW", 32: "NDC1HWC0",
    33: "FRACTAL_Z_3D", 35: "NC", 47: "NCL",
}
"""``torch_npu.Format``'s names (the ACL_FORMAT_* values), for messages."""

FormatQuery = Callable[[torch.Tensor], SupportsInt]
"""``torch_npu.get_npu_format``: a tensor's format as an int (an IntEnum in newer releases)."""


def _format_query(device: torch.device) -> FormatQuery | None:
    """``torch_npu.get_npu_format`` for an npu device; ``None`` (nothing imported) otherwise."""
    if device.type != "npu":
        return None
    module = sys.modules.get("torch_npu") or importlib.import_module("torch_npu")
    query = getattr(module, "get_npu_format", None)
    if not callable(query):
        raise DeviceError(
            "this torch_npu has no get_npu_format(), so flatpool cannot tell whether an NPU "
            "tensor's storage is in the plain ND format; install a torch_npu that has it "
            "(pip install 'flatpool[npu]')")
    return cast(FormatQuery, query)


def format_name(code: int) -> str:
    """``"FRACTAL_NZ (29)"``: torch_npu's name and the number."""
    return f"{FORMAT_NAMES.get(code, 'unknown format')} ({code})"


def _code(query: FormatQuery, t: torch.Tensor) -> int:
    return int(query(t))


def private_format(t: torch.Tensor, device: torch.device | None = None) -> str | None:
    """The name of ``t``'s storage format when it is a private one; ``None`` for a plain format
    (ND, NCHW, NCDHW) and for every tensor not on an NPU. ``device``: ``t``'s, if already read."""
    if device is None:
        with tc.no_torch_function():
            device = tc.impl_device(t)
    query = _format_query(device)
    if query is None:
        return None
    code = _code(query, t)
    return None if code in PLAIN_FORMATS else format_name(code)


def formats_apply(device: torch.device) -> bool:
    """Tensors on ``device`` may have a private format, so :func:`check_plain_format` has
    something to ask: on an npu device only (where torch_npu answers). A batch asks this once,
    not once a tensor."""
    return _format_query(device) is not None


def check_plain_format(t: torch.Tensor, what: object, device: torch.device | None = None) -> None:
    """Raise :class:`NpuFormatError` if ``t`` (named ``what``: its ``str()``, made only for the
    message) is in a private NPU format."""
    name = private_format(t, device)
    if name is not None:
        raise NpuFormatError(
            f"{what} is stored in torch_npu's private format {name}: its storage is not its "
            "elements in torch's order (numel x itemsize bytes), so its bytes cannot move into a "
            "pool, which keeps the plain ND format. Convert it first with "
            "torch_npu.npu_format_cast(t, 2) (ND; or npu_format_cast_(t, 2) in place), then "
            "adopt it (torch.npu.config.allow_internal_format = False stops torch_npu from "
            "choosing such formats itself)", npu_format=name)


def check_pool_storage(buffer: torch.Tensor, pool: str) -> torch.Tensor:
    """``buffer``, a pool's new storage; :class:`NpuFormatError` if it is an NPU storage in
    another format than ND. Raised outside the allocation's ``except RuntimeError``: a missing
    ``get_npu_format`` (a :class:`DeviceError`) is not reported as an exhausted device."""
    with tc.no_torch_function():
        device = tc.impl_device(buffer)
    query = _format_query(device)
    if query is None:
        return buffer
    code = _code(query, buffer)
    if code != ACL_FORMAT_ND:
        raise NpuFormatError(
            f"torch_npu made the storage of pool {pool!r} in format {format_name(code)}, not ND: "
            "its slices' views would not read the bytes they name, and nothing was changed. "
            "Set torch.npu.config.allow_internal_format = False and try again; if it persists, "
            "report it with the torch_npu version", npu_format=format_name(code))
    return buffer


__all__ = ["ACL_FORMAT_ND", "FORMAT_NAMES", "PLAIN_FORMATS",
           "check_plain_format", "check_pool_storage", "format_name", "formats_apply",
           "private_format"]
