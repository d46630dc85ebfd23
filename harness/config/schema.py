"""The config schema Hydra merges conf/ into, so that unknown keys and wrong types fail at compose.

It is made from the point's own types (config/point.py): the same fields and defaults, mutable
for Hydra to merge into, choices as plain strings (the point checks them, naming the key), tuples
as lists, and without the fields a point only gets where it runs. One declaration, two views.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore

from harness.config import point as p

_MADE: dict[type, type] = {}


def _schema_type(hint):
    """The type Hydra sees for a field of the point's."""
    if isinstance(hint, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) > 1:  # a count or a word (parallel.nodes=auto): the point checks which
            return Any
        return typing.Optional[_schema_type(args[0])]  # noqa: UP045 - OmegaConf reads typing.Optional
    if isinstance(hint, type) and issubclass(hint, Enum):
        return str
    if typing.get_origin(hint) is tuple:
        return list[typing.get_args(hint)[0]]
    if dataclasses.is_dataclass(hint):
        return schema_of(hint)  # type: ignore[arg-type]
    return hint


def _default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        factory = f.default_factory
        if isinstance(factory, type) and dataclasses.is_dataclass(factory):
            twin = schema_of(factory)
            return dataclasses.field(default_factory=twin)
        if factory is tuple:
            return dataclasses.field(default_factory=list)
        return dataclasses.field(default_factory=factory)
    value = f.default
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, tuple):
        items = list(value)
        return dataclasses.field(default_factory=items.copy)
    return dataclasses.field(default=value)


def schema_of(cls: type) -> type:
    """The mutable, Hydra-typed twin of one of the point's dataclasses."""
    if cls not in _MADE:
        hints = typing.get_type_hints(cls)
        fields = [(f.name, _schema_type(hints[f.name]), _default(f))
                  for f in dataclasses.fields(cls) if not f.metadata.get("runtime")]
        _MADE[cls] = dataclasses.make_dataclass(f"{cls.__name__}Conf", fields)
    return _MADE[cls]


HarnessConf: Any = schema_of(p.Point)


def register() -> None:
    """The schema behind conf/config.yaml (the Slurm launcher's registers with Hydra's plugins)."""
    ConfigStore.instance().store(name="base_config", node=HarnessConf)
