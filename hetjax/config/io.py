"""A :class:`~hetjax.config.TrainConfig` to and from plain data and files.

:func:`from_dict` is the one way in from outside Python (files, a CLI's merged flags): it
refuses unknown keys naming the valid ones, converts only what data formats cannot
express (a list of ``"MODULE:VALUE"`` items for a mapping, an int for a float) and leaves
every other check to the tree itself. A partial dict is fine: missing keys keep their
defaults, so a config file names only what it changes.

:func:`dump` writes YAML, not JSON, although JSON with an indent would also be valid YAML:
YAML lets every line carry its field's doc as a comment, so a ``--print-config`` file
explains itself, and PyYAML writes floats so that they read back as floats (``1.0e-05``),
where JSON's ``1e-05`` is a string to a YAML 1.1 reader.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import yaml

from hetjax.config.fields import InvalidConfigError, Leaf
from hetjax.config.tree import TrainConfig, leaves, sections
from hetjax.meshes import Layout


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """The config as nested plain data (dicts, lists, str, numbers, bools, None)."""

    def plain(obj: Any) -> Any:
        if dataclasses.is_dataclass(obj):
            return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        if isinstance(obj, Mapping):
            return {k: plain(v) for k, v in obj.items()}
        return obj

    return plain(cfg)


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"parallel": {"schedule": "1f1b"}}`` -> ``{"parallel.schedule": "1f1b"}`` (one
    level per section: a mapping-valued setting such as ``parallel.layouts`` stays whole)."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        if key in sections() and not prefix and isinstance(value, Mapping):
            out.update(flatten(value, f"{key}."))
        else:
            out[prefix + key] = value
    return out


def from_dict(d: Mapping[str, Any]) -> TrainConfig:
    """A checked config from nested plain data; missing keys keep their defaults.

    Args:
        d: e.g. ``{"steps": 10, "parallel": {"placement": "non-colocated", "islands":
            {"vision": 4, "llm": 4}}}``; a mapping-valued setting may also be a list of
            ``"MODULE:VALUE"`` items (``layouts: ["llm:dp=2,tp=2"]``).

    Returns:
        The config.

    Raises:
        InvalidConfigError: an unknown key (naming the valid ones), a section that is not
            a mapping, or any value the tree refuses (wrong type, out of range).
    """
    _require_mapping(d, "config")
    fields = leaves()
    top = [k for k in fields if "." not in k] + list(sections())
    kwargs: dict[str, Any] = {}
    for key, value in d.items():
        if key not in top:
            valid = ", ".join(map(repr, top))
            raise InvalidConfigError(f"unknown config key {key!r}; valid keys: {valid}")
        if key not in sections():
            kwargs[key] = _convert(key, value, fields[key])
            continue
        _require_mapping(value, key)
        names = [p.split(".", 1)[1] for p in fields if p.startswith(key + ".")]
        inner = {}
        for name, v in value.items():
            if name not in names:
                raise InvalidConfigError(
                    f"unknown config key '{key}.{name}'; valid keys of {key}: "
                    f"{', '.join(map(repr, names))}"
                )
            inner[name] = _convert(f"{key}.{name}", v, fields[f"{key}.{name}"])
        kwargs[key] = sections()[key](**inner)
    return TrainConfig(**kwargs)


def read(path: str | os.PathLike) -> dict[str, Any]:
    """The raw mapping of a YAML or JSON config file (``.json``: strict JSON; else YAML).

    Raises:
        InvalidConfigError: a missing file, a parse error (one line, with its position) or
            a file whose top level is not a mapping.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise InvalidConfigError(f"config file {os.fspath(path)!r}: {e.strerror}") from None
    try:
        if os.fspath(path).endswith(".json"):
            data = json.loads(text)
        else:
            data = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except json.JSONDecodeError as e:
        raise InvalidConfigError(f"config file {os.fspath(path)!r}: invalid JSON: {e}") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise InvalidConfigError(
            f"config file {os.fspath(path)!r}: invalid YAML{at}: {problem}"
        ) from None
    if data is None:
        return {}
    _require_mapping(data, f"config file {os.fspath(path)!r}")
    return data


def load(path: str | os.PathLike) -> TrainConfig:
    """The checked config of a YAML or JSON file (see :func:`read` and :func:`from_dict`)."""
    return from_dict(read(path))


def dump(cfg: TrainConfig) -> str:
    """The config as YAML that :func:`load` reads back equal, each field's doc a comment.

    Example::

        steps: 200  # optimiser steps
        parallel:
          layouts: {vision: dp=4, llm: 'dp=2,tp=2'}  # module -> layout, ...
    """
    fields = leaves()
    lines = ["# hetjax TrainConfig (YAML): python -m experiments.llava_train --config FILE"]
    sec = sections()
    for key, value in to_dict(cfg).items():
        if key not in sec:
            lines.append(_line(key, value, fields[key].doc))
            continue
        lines.append(f"{key}:  # {sec[key].__doc__.splitlines()[0].replace('``', '')}")
        for name, v in value.items():
            lines.append("  " + _line(name, v, fields[f"{key}.{name}"].doc))
    return "\n".join(lines) + "\n"


_ITEM_SEPARATOR = {"model.init": "="}  # MODULE=DIR (a path may hold ':'); others MODULE:VALUE
_ITEM_VALUE = {":": "LAYOUT", "=": "DIR"}


def parse_module_items(items: Iterable[str], *, path: str, counts: bool = False) -> dict:
    """``["vision:dp=4", "llm:dp=2,tp=2"]`` -> ``{"vision": "dp=4", "llm": "dp=2,tp=2"}``.

    Args:
        items: ``MODULE:VALUE`` texts, in order.
        path: the setting they fill, for errors (``parallel.layouts``).
        counts: values are positive ints (islands: ``"vision:4"`` -> ``{"vision": 4}``).

    Raises:
        InvalidConfigError: an item without ``:``, an empty part, a count that is not a
            positive int, or a module named twice.
    """
    out: dict[str, Any] = {}
    mark = _ITEM_SEPARATOR.get(path, ":")
    want = "MODULE:N with N a positive integer" if counts else f"MODULE{mark}{_ITEM_VALUE[mark]}"
    for item in items:
        name, sep, value = str(item).partition(mark)
        ok = sep and name and value and (not counts or (value.isdigit() and int(value) >= 1))
        if not ok:
            raise InvalidConfigError(f"{path} {item!r}: expected {want}")
        if name in out:
            raise InvalidConfigError(f"{path} names {name!r} twice; give each module one")
        out[name] = int(value) if counts else value
    return out


def parse_weighted(items: Iterable[str], *, path: str) -> dict[str, float]:
    """``["a.json:0.7", "b.jsonl"]`` -> ``{"a.json": 0.7, "b.jsonl": 1.0}`` (a mixture).

    Raises:
        InvalidConfigError: a weight that is not a positive number, or a file named twice.
    """
    out: dict[str, float] = {}
    for item in items:
        name, sep, weight = str(item).rpartition(":")
        if not sep or not _is_number(weight):
            name, weight = str(item), "1"
        if not name or float(weight) <= 0:
            raise InvalidConfigError(f"{path} {item!r}: expected FILE or FILE:WEIGHT, WEIGHT > 0")
        if name in out:
            raise InvalidConfigError(f"{path} names {name!r} twice; give each file once")
        out[name] = float(weight)
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def module_layouts(layouts: Mapping[str, str], modules: Sequence[str]) -> dict[str, Layout]:
    """Layout texts per module -> :class:`~hetjax.Layout` objects, modules checked.

    Raises:
        InvalidConfigError: a module that is not one of ``modules``.
        LayoutError: a layout text that does not parse (naming the module).
    """
    for name, text in layouts.items():
        if name not in modules:
            raise InvalidConfigError(
                f"parallel.layouts '{name}:{text}': expected MODULE:LAYOUT with MODULE one "
                f"of {list(modules)}"
            )
    return {name: Layout.parse(text, module=name) for name, text in layouts.items()}


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading ``1e-5`` as a float (YAML 1.2) instead of a string."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def _require_mapping(value: Any, what: str) -> None:
    if not isinstance(value, Mapping):
        raise InvalidConfigError(f"{what} must be a mapping of keys to values, got {value!r}")
    bad = [k for k in value if not isinstance(k, str)]
    if bad:
        raise InvalidConfigError(f"{what}: keys must be strings, got {bad[0]!r}")


def _convert(path: str, value: Any, leaf: Leaf) -> Any:
    """What data formats cannot say as the field's type; the tree checks the rest."""
    args = typing.get_args(leaf.hint)
    if typing.get_origin(leaf.hint) is dict and isinstance(value, list | tuple):
        return parse_module_items(value, path=path, counts=args[1] is int)
    if float in (leaf.hint, *args) and type(value) is int:
        return float(value)
    return value


def _line(name: str, value: Any, comment: str) -> str:
    """``name: value  # comment`` on one line; a mapping value in flow style."""
    if isinstance(value, Mapping):
        flow = yaml.safe_dump(
            value, default_flow_style=True, sort_keys=False, width=math.inf
        ).strip()
        text = f"{name}: {flow}"
    else:
        text = yaml.safe_dump(
            {name: value}, default_flow_style=False, sort_keys=False, width=math.inf
        ).rstrip()
    comment = comment.replace("``", "")
    return text if "\n" in text else f"{text}  # {comment}"
