"""Placeholder, replaced by the ownership issue."""
from __future__ import annotations
from typing import Any

class AdoptionRegistry:
    def __init__(self, pool: Any) -> None:
        self.pool = pool
    def holds(self, slc: Any) -> bool:
        return False
