"""``Holder``: a named place that references a tensor (an attribute or an item)."""

from __future__ import annotations

from typing import Any

from attrs import define


@define(frozen=True)
class Holder:
    """A place that references a tensor: ``getattr(owner, key)`` or ``owner[key]`` (``item``).

    Adoption *replaces* the tensor held there: for a view whose autograd ``_base`` would keep
    the original alive after ``set_``.
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

    def unassignable(self) -> str | None:
        """Why nothing can be written to this place, or ``None``: from the owner's type alone,
        as a trial write would run the setter (parametrize's ``right_inverse`` replaces values)."""
        owner, cls = self.owner, type(self.owner)
        if self.item:
            if isinstance(owner, (tuple, str, bytes, frozenset)) or not hasattr(cls, "__setitem__"):
                return f"{cls.__name__} items cannot be assigned"
            return None
        if not isinstance(self.key, str):
            return f"attribute names are strings, got {self.key!r}"
        for klass in cls.__mro__:
            slot = klass.__dict__.get(self.key)
            if slot is None:
                continue
            if isinstance(slot, property):
                return None if slot.fset is not None else f"{self.key!r} is a read-only property"
            if hasattr(type(slot), "__set__"):
                return None  # a data descriptor with a setter (__slots__ member, getset)
            break
        if getattr(getattr(cls, "__dataclass_params__", None), "frozen", False) or getattr(
                cls.__setattr__, "__name__", "") == "_frozen_setattrs":
            return f"{cls.__name__} is frozen"
        if not hasattr(owner, "__dict__"):
            return f"{cls.__name__} has no attribute slot {self.key!r}"
        return None

    def describe(self) -> str:
        owner = type(self.owner).__name__
        return f"{owner}[{self.key!r}]" if self.item else f"{owner}.{self.key}"
