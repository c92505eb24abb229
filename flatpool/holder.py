"""``Holder``: a named place that references a tensor (an attribute or an item)."""

from __future__ import annotations

from typing import Any

from attrs import define


@define(frozen=True)
class Holder:
    """A place that references a tensor: ``getattr(owner, key)`` or ``owner[key]`` (``item``).

    Adoption *replaces* the tensor held there by a fresh pool-backed tensor of the same
    geometry. Use it for views with an autograd ``_base``: ``set_`` moves a view's storage but
    its base keeps the original alive, so such a view must be swapped where it is held.
    """

    owner: Any
    key: Any
    item: bool = False

    def get(self) -> Any:
        return self.owner[self.key] if self.item else getattr(self.owner, self.key)

    def set(self, value: Any) -> None:
        if self.item:
            self.owner[self.key] = value
        else:
            setattr(self.owner, self.key, value)

    def describe(self) -> str:
        owner = type(self.owner).__name__
        return f"{owner}[{self.key!r}]" if self.item else f"{owner}.{self.key}"


__all__ = ["Holder"]
