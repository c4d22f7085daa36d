"""Attributes the framework callbacks share: retention fields read through, renamed ones that warn.

Each callback keeps its option groups in ``self.options`` (``options["retention"]`` a
:class:`asymcheck.options.RetentionOptions`). The descriptors here read those once for every callback
instead of each spelling the same properties.
"""

from __future__ import annotations

import warnings
from typing import Any, Generic, TypeVar, overload

__all__ = ["RenamedAttribute", "RetentionField"]

T = TypeVar("T")


class RetentionField(Generic[T]):
    """A read-only attribute that reads one field of the owner's ``options["retention"]``."""

    def __init__(self, field: str) -> None:
        """Read ``options["retention"].<field>``."""
        self.field = field

    @overload
    def __get__(self, obj: None, objtype: type[Any]) -> RetentionField[T]: ...

    @overload
    def __get__(self, obj: object, objtype: type[Any] | None = None) -> T: ...

    def __get__(self, obj: object | None, objtype: type[Any] | None = None) -> RetentionField[T] | T:
        """The field's value (the descriptor itself on the class)."""
        if obj is None:
            return self
        value: T = getattr(obj.options["retention"], self.field)  # type: ignore[attr-defined]
        return value


class RenamedAttribute(Generic[T]):
    """A deprecated attribute name: reads the new one with a ``DeprecationWarning`` that names both."""

    def __init__(self, new: str) -> None:
        """The attribute's new name is ``new``."""
        self.new = new
        self.old = ""
        self.owner = ""

    def __set_name__(self, owner: type[Any], name: str) -> None:
        """Remember the old name and the owner's class name for the warning."""
        self.old = name
        self.owner = owner.__name__

    @overload
    def __get__(self, obj: None, objtype: type[Any]) -> RenamedAttribute[T]: ...

    @overload
    def __get__(self, obj: object, objtype: type[Any] | None = None) -> T: ...

    def __get__(self, obj: object | None, objtype: type[Any] | None = None) -> RenamedAttribute[T] | T:
        """The new attribute's value, with the warning (the descriptor itself on the class)."""
        if obj is None:
            return self
        warnings.warn(f"{self.owner}.{self.old} is now {self.owner}.{self.new}", DeprecationWarning, stacklevel=2)
        value: T = getattr(obj, self.new)
        return value
