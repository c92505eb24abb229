"""The hsdp layer reports bad input with flatpool's typed errors, not bare builtins."""

from __future__ import annotations

import pytest
from torch import nn

from flatpool import FlatPoolError, InvalidTypeError
from flatpool.integrations.hsdp import lazy_init


def test_lazy_init_of_an_unsharded_module() -> None:
    match = "Linear is not a fully_shard-ed module.*fully_shard"
    with pytest.raises(InvalidTypeError, match=match) as info:
        lazy_init(nn.Linear(2, 2))
    assert isinstance(info.value, FlatPoolError) and isinstance(info.value, TypeError)
