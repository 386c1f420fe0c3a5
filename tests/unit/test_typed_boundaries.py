"""Nothing untyped crosses the control plane <-> agent boundary or the catalog's.

Every agent command's arguments and result, and every kind of catalog item, is a model whose
fields are typed all the way down: no ``Any``, no ``dict[str, Any]``. The catalog's methods
take and return those models, and a writer's fields are checked before they are written.
"""

from __future__ import annotations

import inspect
import types
import typing
from typing import Any, Union, get_args, get_origin, get_type_hints

import pytest
from pydantic import BaseModel

from shardvault.aws.tables import Catalog
from shardvault.contracts import catalog
from shardvault.contracts.commands import ARGUMENTS, RESULTS

CATALOG_KINDS = [
    catalog.BackupItem,
    catalog.RestoreItem,
    catalog.DrillItem,
    catalog.LockItem,
    catalog.ArchiveTotals,
]


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
    [*ARGUMENTS.values(), *RESULTS.values(), *CATALOG_KINDS],
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


def test_the_catalog_takes_and_returns_models_only() -> None:
    for name, method in inspect.getmembers(Catalog, inspect.isfunction):
        if name.startswith("_"):
            continue
        hints = get_type_hints(method)
        loose = {k: v for k, v in hints.items() if "Any" in str(v) or "dict" in str(v)}
        assert loose == {}, f"Catalog.{name} takes or returns untyped data: {loose}"


def test_a_writer_s_fields_are_checked_before_anything_is_written() -> None:
    with pytest.raises(ValueError, match="no field 'complted_at'"):
        catalog.BackupItem.changes(complted_at=1.0)
    with pytest.raises(ValueError, match="bytes"):
        catalog.BackupItem.changes(bytes="a lot")
    with pytest.raises(ValueError, match="no field 'cluster'"):
        catalog.BackupItem.changes(cluster="elsewhere")  # an item's keys never change
    changes = catalog.RestoreItem.changes(status="FAILED", failed_at=3)
    assert changes.values == {"status": "FAILED", "failed_at": 3.0}


def test_an_item_written_by_an_older_release_still_reads() -> None:
    item = catalog.BackupItem.from_item(
        {"cluster": "c", "backup_id": "b", "status": "COMPLETE", "a_field_long_gone": 1}
    )
    assert item.status == "COMPLETE"


def test_an_answer_this_release_cannot_read_is_refused_naming_the_node_and_field() -> None:
    from shardvault.contracts.commands import Finished, parse_result
    from shardvault.errors import AnswerMismatch

    answer = {"node_id": "n1", "shards": [{"shard_id": "s1", "checks": {}, "checks_passed": 1}]}
    with pytest.raises(AnswerMismatch, match=r"node n1 .* shards\.0\.node_id: Field required"):
        parse_result(Finished, "n1", answer)
    newer = {
        "node_id": "n1",
        "shards": [
            {"shard_id": "s1", "node_id": "n1", "path": "/r/s1", "checks": {"x": "ok"},
             "checks_passed": True, "a_newer_agents_field": 1}
        ],
    }  # fmt: skip
    (shard,) = parse_result(Finished, "n1", newer).shards
    assert shard.checks_passed  # what a newer agent adds is ignored
    assert shard.path == "/r/s1"
