"""Refuse NPU tensors whose storage is in one of torch_npu's private formats.

torch_npu can keep a tensor's bytes in a blocked layout (FRACTAL_NZ, NC1HWC0, ...) that torch's
sizes and strides do not describe, so moving or viewing such bytes would scramble them. A pool on
``"npu"`` keeps its storage in ND and adopts only plain formats. ``torch_npu.get_npu_format`` is
looked up only for tensors on an npu device. Not yet verified on an NPU (docs/pool.md).
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
"""ND and the default 4-D/5-D base formats (NCHW, NCDHW): elements in torch's row-major order.
NHWC and NDHWC are base formats too, but keep another order."""
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


def _format_code(t: torch.Tensor, device: torch.device | None = None) -> int | None:
    """torch_npu's storage format of ``t``, or ``None`` off npu (nothing to ask)."""
    if device is None:
        with tc.no_torch_function():
            device = tc.impl_device(t)
    query = _format_query(device)
    return None if query is None else int(query(t))


def private_format(t: torch.Tensor, device: torch.device | None = None) -> str | None:
    """The name of ``t``'s storage format when it is a private one, else ``None``."""
    code = _format_code(t, device)
    return None if code is None or code in PLAIN_FORMATS else format_name(code)


def formats_apply(device: torch.device) -> bool:
    """Tensors on ``device`` may have a private format (npu only); a batch asks this once."""
    return _format_query(device) is not None


def check_plain_format(t: torch.Tensor, what: object, device: torch.device | None = None) -> None:
    """Raise :class:`NpuFormatError` if ``t`` (named ``what``) is in a private NPU format."""
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
    """``buffer``, a pool's new storage; :class:`NpuFormatError` unless ND (checked outside the
    allocation's ``except RuntimeError``: a missing torch_npu is no exhausted device)."""
    code = _format_code(buffer)
    if code is not None and code != ACL_FORMAT_ND:
        raise NpuFormatError(
            f"torch_npu made the storage of pool {pool!r} in format {format_name(code)}, not ND: "
            "its slices' views would not read the bytes they name, and nothing was changed. "
            "Set torch.npu.config.allow_internal_format = False and try again; if it persists, "
            "report it with the torch_npu version", npu_format=format_name(code))
    return buffer
