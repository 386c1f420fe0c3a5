"""Nothing untyped crosses the control plane <-> agent boundary.

Every agent command's arguments and result is a model whose fields are typed all the way
down: no ``Any``, no ``dict[str, Any]``, no bare ``dict``.
"""

from __future__ import annotations

import inspect
import types
import typing
from typing import Any, Union, get_args, get_origin

import pytest
from pydantic import BaseModel

from shardvault.contracts.commands import ARGUMENTS, RESULTS


def untyped_fields(model: type[BaseModel], seen: set[type] | None = None) -> list[str]:
    """The paths of fields typed ``Any`` (bare, or inside a container) in ``model`` and the
    models it holds."""
    seen = set() if seen is None else seen
    if model in seen:
        return []
    seen.add(model)
    found: list[str] = []
    for name, field in model.model_fields.items():
        found += [f"{model.__name__}.{name}{p}" for p in untyped(field.annotation, seen)]
    return found


def untyped(annotation: Any, seen: set[type]) -> list[str]:
    if annotation is Any or annotation is object:
        return [": Any"]
    if annotation in (dict, list, tuple, set):
        return [f": bare {annotation.__name__}"]
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return [" -> " + p for p in untyped_fields(annotation, seen)]
    origin = get_origin(annotation)
    if origin is typing.Annotated:
        return untyped(get_args(annotation)[0], seen)
    if origin in (Union, types.UnionType) or origin is not None:
        return [p for arg in get_args(annotation) if arg is not ... for p in untyped(arg, seen)]
    return []


@pytest.mark.parametrize(
    "model",
    [*ARGUMENTS.values(), *RESULTS.values()],
    ids=lambda m: m.__name__,
)
def test_every_field_that_crosses_a_boundary_is_typed(model: type[BaseModel]) -> None:
    assert untyped_fields(model) == []


def test_the_walk_finds_an_untyped_field() -> None:
    class Loose(BaseModel):
        fine: dict[str, int]
        nested: list[dict[str, Any]] | None = None

    class Outer(BaseModel):
        inner: Loose

    assert untyped_fields(Outer) == ["Outer.inner -> Loose.nested: Any"]
