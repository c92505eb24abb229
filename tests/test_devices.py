"""Devices accept what torch accepts: a string, a ``torch.device``, or an int accelerator index.

An int names an index of torch's current accelerator (``torch.device(1)`` is ``cuda:1`` on a
CUDA machine). Without an accelerator it is a :class:`DeviceError` saying what to pass instead,
and no pool is made.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from flatpool import DeviceError, FlatPool, InvalidTypeError, live_pools, resolve_device

HAS_ACCELERATOR = hasattr(torch, "accelerator") and torch.accelerator.is_available()


def _pools() -> set[int]:
    return {id(p) for p in live_pools()}


@pytest.mark.skipif(HAS_ACCELERATOR, reason="needs a machine without an accelerator")
@pytest.mark.parametrize("index", [0, 1, np.int64(0)], ids=repr)
def test_int_without_accelerator_is_a_clear_device_error(index: Any) -> None:
    before = _pools()
    match = r"accelerator index.*no accelerator.*'cpu'.*'npu:"
    with pytest.raises(DeviceError, match=match) as info:
        FlatPool(index)
    assert f"device {int(index)} " in str(info.value)
    assert _pools() <= before


@pytest.mark.device
@pytest.mark.skipif(not HAS_ACCELERATOR, reason="needs an accelerator")
def test_int_is_an_index_of_the_current_accelerator() -> None:
    kind = torch.accelerator.current_accelerator()
    assert kind is not None
    assert resolve_device(0) == torch.device(kind.type, 0)
    assert FlatPool(0).device == torch.device(kind.type, 0)
    count = torch.accelerator.device_count()
    with pytest.raises(DeviceError, match="does not exist"):
        resolve_device(count)


def test_negative_index_is_refused() -> None:
    with pytest.raises(DeviceError, match="negative"):
        resolve_device(-1)


@pytest.mark.parametrize("value", [True, False], ids=repr)
def test_bool_is_not_an_index(value: bool) -> None:
    with pytest.raises(InvalidTypeError, match="str, torch.device or int"):
        resolve_device(value)


@pytest.mark.parametrize("value", [None, 1.0, b"cpu", ["cpu"]], ids=repr)
def test_other_types_name_what_is_accepted(value: Any) -> None:
    with pytest.raises(InvalidTypeError, match="str, torch.device or int"):
        resolve_device(value)


@pytest.mark.parametrize("value", ["cpu", "cpu:0", torch.device("cpu")], ids=repr)
def test_cpu_forms_still_resolve(value: Any) -> None:
    assert resolve_device(value) == torch.device("cpu")
