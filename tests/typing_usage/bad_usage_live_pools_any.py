"""Type-checked misuse: ``live_pools()`` lists FlatPool objects, whose ``name`` is a str."""

from __future__ import annotations

from flatpool import live_pools

first: int = live_pools()[0].name  # expect: [assignment]
