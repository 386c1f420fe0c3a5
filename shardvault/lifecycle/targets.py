"""What every vault target shares: the store's layout under the target's own prefix, a
manifest that names the target's copies, and the retain-until its copies are held to."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from shardvault.aws.services import Services
from shardvault.contracts.models import Manifest, ObjectResult


def days_after(now: float, days: int) -> datetime:
    return datetime.fromtimestamp(math.ceil(now), UTC) + timedelta(days=days)


def moved_key(svc: Services, store_key: str, prefix: str) -> str:
    """A store key under another place's ``prefix``: every vault target keeps the store's
    layout."""
    relative = store_key.removeprefix(svc.store.prefix.strip("/") + "/")
    prefix = prefix.strip("/")
    return f"{prefix}/{relative}" if prefix else relative


def moved_manifest(
    manifest: Manifest, key_of: Callable[[str], str], versions: dict[str, str | None]
) -> Manifest:
    """The store's manifest as a vault target keeps it: each object at ``key_of(its store
    key)``, with the version (or generation) of its copy (``versions``, by store key)."""

    def moved_object(o: ObjectResult) -> ObjectResult:
        return o.model_copy(update={"key": key_of(o.key), "version_id": versions.get(o.key)})

    return manifest.model_copy(
        update={
            "shards": [
                shard.model_copy(
                    update={
                        "streams": [
                            stream.model_copy(
                                update={"objects": [moved_object(o) for o in stream.objects]}
                            )
                            for stream in shard.streams
                        ],
                        "blockmap": moved_object(shard.blockmap) if shard.blockmap else None,
                    }
                )
                for shard in manifest.shards
            ]
        }
    )
