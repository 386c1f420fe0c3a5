"""Thawing archived objects before a restore, against moto's S3 (StorageClass, RestoreObject):
archived objects are asked to thaw once, at the requested tier; readable ones are left
alone; the count of frozen objects drops to zero once S3 has thawed them."""

from __future__ import annotations

import pytest

from shardvault.aws.services import Services
from shardvault.contracts.catalog import RestoreItem
from shardvault.contracts.models import (
    Engine,
    FileEntry,
    Manifest,
    ManifestShard,
    ManifestStream,
    NodeAssignment,
    ObjectResult,
    Phase,
    RestoreContext,
    RetrievalTier,
    ShardPlacement,
)
from shardvault.data.checksums import crc64nvme_of_bytes
from shardvault.restore import thaw

from .support import backup_item, moto_services

BUCKET = "store"
MANIFEST = "backups/c/b1/manifest.json"


def obj(key: str, data: bytes) -> ObjectResult:
    return ObjectResult(
        key=key, node_id="n1", shard_id="s1", phase=Phase.DATA, index=0, stream_offset=0,
        length=len(data), part_size=8 << 20, part_count=1, crc64nvme=crc64nvme_of_bytes(data),
        verified_by="attributes",
    )  # fmt: skip


@pytest.fixture
def svc(monkeypatch):
    with moto_services(
        monkeypatch, store_url=f"s3://{BUCKET}/backups", thaw_first_wait_seconds=60
    ) as services:
        services.store_s3.create_bucket(Bucket=BUCKET)
        yield services


def archived_backup(svc: Services) -> RestoreContext:
    s3 = svc.store_s3
    classes = {"a": "DEEP_ARCHIVE", "b": "GLACIER", "c": "GLACIER_IR", "d": "STANDARD"}
    objects = []
    for name, storage_class in classes.items():
        key = f"backups/c/b1/s1/data-{name}"
        s3.put_object(Bucket=BUCKET, Key=key, Body=name.encode(), StorageClass=storage_class)
        objects.append(obj(key, name.encode()))
    manifest = Manifest(
        backup_id="b1", cluster="c", engine=Engine.SQLITE, started_at=0, completed_at=1,
        checkpoint_skew_seconds=0, part_size=8 << 20, bytes=4, objects=4, parts=4,
        verification="ok",
        shards=[
            ManifestShard(
                shard_id="s1", node_id="n1", marker={}, checkpoint_at=0,
                streams=[
                    ManifestStream(
                        phase=Phase.DATA,
                        files=[FileEntry(path="x.db", size=4)],
                        objects=objects,
                    )
                ],
            )
        ],
    )  # fmt: skip
    s3.put_object(Bucket=BUCKET, Key=MANIFEST, Body=manifest.model_dump_json().encode())
    svc.catalog.put(
        RestoreItem(
            cluster="t", backup_id="restore#r1", restore_id="r1", status="RUNNING",
            source_cluster="c", source_backup_id="b1",
        )
    )  # fmt: skip
    return RestoreContext(
        restore_id="r1", cluster="c", backup_id="b1", manifest_key=MANIFEST,
        target_cluster="t",
        placements=[ShardPlacement(shard_id="s1", node_id="t1", bytes=4)],
        assignments=[NodeAssignment(node_id="t1", shard_ids=["s1"], bytes=4)],
        bytes=4, objects=4, tier=RetrievalTier.BULK, replace=False, plan_only=False,
        started_at=0,
    )  # fmt: skip


def test_archived_objects_are_thawed_at_the_tier_and_counted_until_readable(svc, monkeypatch):
    context = archived_backup(svc)
    asked: list[dict] = []
    real = svc.store_s3.restore_object

    def spy(**kwargs):
        asked.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(svc.store_s3, "restore_object", spy)

    first = thaw.thaw(context, 0, svc)

    # Only DEEP_ARCHIVE and GLACIER need a thaw; GLACIER_IR and STANDARD read at once.
    assert first["frozen"] == 2
    assert first["requested"] == 2
    assert sorted(a["Key"][-1] for a in asked) == ["a", "b"]
    assert {a["RestoreRequest"]["GlacierJobParameters"]["Tier"] for a in asked} == {"Bulk"}
    assert svc.catalog.restore("t", "r1").frozen == 2  # what the CLI shows
    # moto thaws at once: the next poll finds nothing frozen and asks for nothing.
    second = thaw.thaw(context, first["attempt"], svc)
    assert second["frozen"] == 0
    assert svc.catalog.restore("t", "r1").frozen == 0
    assert len(asked) == 2


def test_waits_between_polls_double_up_to_an_hour(svc):
    context = archived_backup(svc)
    waits = [thaw.thaw(context, attempt, svc)["wait_seconds"] for attempt in (0, 1, 2, 12)]
    assert waits == [60, 120, 240, thaw.THAW_MAX_WAIT]


def test_a_tier_the_vaults_class_lacks_is_refused_before_anything_with_those_it_has():
    from shardvault.contracts.models import RetrievalTier
    from shardvault.errors import InvalidRequest
    from shardvault.restore.admission import check_tier

    deep = backup_item(backup_id="b1", location="vault", storage_class="DEEP_ARCHIVE")
    with pytest.raises(InvalidRequest, match="no Expedited thaw tier; it has Standard and Bulk"):
        check_tier(deep, RetrievalTier.EXPEDITED)
    check_tier(deep, RetrievalTier.BULK)
    check_tier(deep.model_copy(update={"storage_class": "GLACIER"}), RetrievalTier.EXPEDITED)
    glacier_ir = deep.model_copy(update={"storage_class": "GLACIER_IR"})
    check_tier(glacier_ir, RetrievalTier.EXPEDITED)  # no thaw


def test_a_restore_outlives_the_slowest_thaw_it_may_wait_for():
    import json

    from shardvault.local.stack import STATE_MACHINES
    from shardvault.pricing.prices import SLOWEST_THAW_HOURS

    timeout = json.loads((STATE_MACHINES / "restore.asl.json").read_text())["TimeoutSeconds"]
    assert timeout >= (SLOWEST_THAW_HOURS + 12) * 3600  # the thaw, then its downloads


def test_a_backup_verify_found_damaged_is_refused_unless_accepted():
    from shardvault.errors import BackupDamaged
    from shardvault.restore.admission import check_not_damaged

    verdict = {"verified_at": 0, "objects": 1, "read": 1, "skipped": 0}
    damaged = backup_item(
        backup_id="b1", verify=verdict | {"result": "damaged", "problems": ["k is missing"]}
    )
    with pytest.raises(BackupDamaged, match="k is missing") as refused:
        check_not_damaged(damaged, accepted=False)
    assert "--accept-damaged" in refused.value.fix
    check_not_damaged(damaged, accepted=True)
    check_not_damaged(backup_item(backup_id="b2", verify=verdict | {"result": "ok"}), False)
    check_not_damaged(backup_item(backup_id="b3"), accepted=False)  # never verified
