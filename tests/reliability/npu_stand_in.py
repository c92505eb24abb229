"""A stand-in for ``torch_npu.get_npu_format``, so the NPU storage-format guard runs on CPU.

torch_npu keeps a tensor's format on its *storage* (``NPUStorageDesc.npu_format_``): every view
of a storage reports the same format. The stand-in does the same (a format per storage, ND for
every other one) and, like newer torch_npu releases, answers with a ``Format`` IntEnum rather
than a plain int. It replaces :func:`flatpool._npu_format._format_query` for every device while
the context is open, and counts the tensors it was asked about.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from enum import IntEnum

import torch

from flatpool import _npu_format
from flatpool import _torch_compat as tc


class Format(IntEnum):
    """``torch_npu.Format``'s values (torch_npu/npu/_format.py)."""

    NCHW = 0
    NHWC = 1
    ND = 2
    NC1HWC0 = 3
    FRACTAL_Z = 4
    FRACTAL_NZ = 29
    NCDHW = 30


class StandIn:
    def __init__(self, formats: Mapping[torch.Tensor, int], default: int) -> None:
        self.by_storage = {tc.storage_key(t.untyped_storage()): int(f) for t, f in formats.items()}
        self.default = default
        self.asked = 0

    def get_npu_format(self, t: torch.Tensor) -> Format | int:
        self.asked += 1
        code = self.by_storage.get(tc.storage_key(t.untyped_storage()), self.default)
        return Format(code) if code in Format._value2member_map_ else code


@contextmanager
def npu_formats(formats: Mapping[torch.Tensor, int] | None = None,
                default: int = Format.ND) -> Iterator[StandIn]:
    """Within the block, ``formats``' tensors (and every view of their storages) report their
    format and every other tensor ``default``, whatever its device."""
    stand_in = StandIn(formats or {}, default)
    original = _npu_format._format_query
    _npu_format._format_query = lambda device: stand_in.get_npu_format
    try:
        yield stand_in
    finally:
        _npu_format._format_query = original
