"""Unrolled constructors for the frozen, slotted dataclasses rebuilt on every message.

A frozen dataclass's ``__init__`` stores each field with ``object.__setattr__`` (its
own ``__setattr__`` refuses), a global lookup, an attribute lookup and a call per
field: about 1.5 µs for an :class:`~wire.Attr`, paid once per stat reply and once per
readdir entry. The decoders' fast paths, which have already checked every value,
build through :func:`positional_builder` instead: the slot descriptors' setters,
bound once, one call per field, about twice as fast. The object is the same one
``cls(*values)`` makes (no ``__post_init__`` is skipped: classes with one, or with
fields outside ``__init__``, get ``cls`` itself back).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, TypeVar

__all__ = ["positional_builder"]

T = TypeVar("T")


def positional_builder(cls: type[T]) -> Callable[..., T]:
    """``build(*values)``: the same object as ``cls(*values)`` given every field, in field order.

    ``cls`` must be a dataclass; the values are stored as they are (no conversion,
    no check -- callers have checked them).
    """
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    slots = [cls.__dict__.get(f.name) for f in fields]
    if (hasattr(cls, "__post_init__") or not all(f.init for f in fields)
            or not all(isinstance(s, types.MemberDescriptorType) for s in slots)):
        return cls
    names = [f.name for f in fields]
    # Generated from the class's own field names (identifiers), never from input.
    source = "\n".join([
        f"def build({', '.join(names)}):",
        "    obj = new(cls)",
        *(f"    set_{i}(obj, {name})" for i, name in enumerate(names)),
        "    return obj",
    ])
    scope: dict[str, Any] = {"new": object.__new__, "cls": cls}
    scope.update({f"set_{i}": slot.__set__ for i, slot in enumerate(slots)})  # type: ignore[union-attr]
    exec(source, scope)  # noqa: S102
    build: Callable[..., T] = scope["build"]
    build.__qualname__ = f"{cls.__qualname__}.<positional build>"
    return build
