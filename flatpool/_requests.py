"""What a pool accepts as a shape and a dtype: one rule for every entry point."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, Union

import torch

from .errors import InvalidRequestError, InvalidTypeError

ShapeLike = Union[int, Sequence[int], torch.Size]

_QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
_SHELL = {getattr(torch, f"{sign}int{bits}") for sign in ("", "u") for bits in range(1, 8)
          if isinstance(getattr(torch, f"{sign}int{bits}", None), torch.dtype)}
"""Sub-byte dtypes torch declares but implements no operator for (torch >= 2.3)."""


def check_shape(shape: ShapeLike) -> tuple[int, ...]:
    """Validate ``shape`` (an int, a sequence of ints, a ``torch.Size``) into a tuple."""
    if isinstance(shape, bool):
        raise InvalidTypeError(f"shape must be ints, got a bool: {shape!r}")
    if isinstance(shape, int):
        dims: tuple[Any, ...] = (shape,)
    elif isinstance(shape, (Sequence, torch.Size)) and not isinstance(shape, (str, bytes)):
        dims = tuple(shape)
    else:
        raise InvalidTypeError(f"shape must be an int or a sequence of ints, got {shape!r}")
    out: list[int] = []
    for d in dims:
        if isinstance(d, bool) or (isinstance(d, torch.Tensor) and d.dtype == torch.bool):
            raise InvalidTypeError(f"shape {shape!r} has a bool dimension {d!r}")
        if not isinstance(d, int):
            try:
                d = operator.index(d)
            except TypeError:
                raise InvalidTypeError(
                    f"shape {shape!r} has a non-integer dimension {d!r} ({type(d).__name__})"
                ) from None
        if d < 0:
            raise InvalidRequestError(f"shape {shape!r} has a negative dimension {d}")
        out.append(int(d))
    return tuple(out)


def check_dtype(dtype: object, what: object = None) -> torch.dtype:
    """A dtype a plain byte storage can hold and torch can copy: the one dtype rule of every
    entry point (quantized dtypes need quantizer parameters; sub-byte shells have no kernels)."""
    if not isinstance(dtype, torch.dtype):
        raise InvalidTypeError(
            f"dtype must be a torch.dtype such as torch.float32, got {type(dtype).__name__}: "
            f"{dtype!r}")
    if dtype in _QUANTIZED:
        raise InvalidTypeError(
            f"{f'{what}: ' if what else ''}quantized dtype {dtype} needs quantizer parameters a "
            "plain storage cannot carry; store its integer representation (int_repr()) instead")
    if dtype in _SHELL:
        raise InvalidTypeError(
            f"{f'{what}: ' if what else ''}{dtype} is a sub-byte shell dtype torch has no kernels "
            "for (not even copy_); store the packed values as torch.uint8 instead")
    return dtype


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (what a fresh ``torch.empty(shape)`` has)."""
    strides: list[int] = []
    acc = 1
    for d in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))
