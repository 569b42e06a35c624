"""Typed, documented fields of the config dataclasses, and reflection over them.

A config field is a dataclass field with a default and a one-line doc in its metadata
(:func:`doc`); the CLI's help and the comments of a dumped config are read from there.
Values are checked against the fields' type hints by :func:`matches` (only the few
forms a config uses: literals, unions with None, ``dict[K, V]``, scalars), over every
leaf that :func:`walk` finds, and :func:`describe` says a hint in words for the one-line
error. Nothing here knows the sections of :class:`hetjax.config.TrainConfig`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal


class InvalidConfigError(ValueError):
    """A configuration value or file is invalid; the one-line message names the field."""


def doc(default: Any, text: str) -> Any:
    """A dataclass field with a default and its one-line doc (``metadata["doc"]``)."""
    if isinstance(default, dict):  # a fresh dict per instance
        return dataclasses.field(default_factory=lambda: dict(default), metadata={"doc": text})
    return dataclasses.field(default=default, metadata={"doc": text})


class Leaf(typing.NamedTuple):
    """One setting of the tree: its type hint, default and one-line doc."""

    hint: Any
    default: Any
    doc: str


def walk(obj: Any, prefix: str = "") -> typing.Iterator[tuple[str, Any, Any]]:
    """``(dotted path, value, type hint)`` of every leaf setting of a config tree."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            if not isinstance(value, hints[f.name]):
                raise InvalidConfigError(
                    f"{prefix}{f.name} must be a {hints[f.name].__name__}, got {value!r}"
                )
            yield from walk(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, value, hints[f.name]


def matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` has type ``hint`` (the few forms a config field uses)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return value is None
    if origin is Literal:
        return value in args and all(type(value) is type(a) for a in args if a == value)
    if origin in (types.UnionType, typing.Union):
        return any(matches(value, a) for a in args)
    if origin in (dict, Mapping):
        return isinstance(value, Mapping) and all(
            matches(k, args[0]) and matches(v, args[1]) for k, v in value.items()
        )
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, hint)


def describe(hint: Any) -> str:
    """A type hint in words, for error messages."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(map(repr, args))
    if origin in (types.UnionType, typing.Union):
        return " or ".join(describe(a) for a in args)
    if origin in (dict, Mapping):
        return f"a mapping of {describe(args[0])} to {describe(args[1])}"
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))
