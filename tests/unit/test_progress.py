"""Progress is for display: a count DynamoDB throttles is dropped, never a failed object."""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError

from shardvault.aws.tables import Catalog
from shardvault.contracts.models import ThrottleReport

from .support import backup_item, moto_services


class RefusingTable:
    def __init__(self, code: str) -> None:
        self.code = code

    def update_item(self, **_: object) -> None:
        raise ClientError({"Error": {"Code": self.code, "Message": "no"}}, "UpdateItem")


def test_a_throttled_progress_count_is_dropped() -> None:
    catalog = Catalog(RefusingTable("ProvisionedThroughputExceededException"))
    assert catalog.add_progress("c", "b", bytes_done=1, objects_done=1) is False


def test_any_other_refusal_still_fails() -> None:
    catalog = Catalog(RefusingTable("ResourceNotFoundException"))
    with pytest.raises(ClientError):
        catalog.add_progress("c", "b", bytes_done=1, objects_done=1)


def test_the_catalog_keeps_the_most_wal_any_node_held_and_the_latest_throttle(monkeypatch):
    with moto_services(monkeypatch) as svc:
        svc.catalog.put(backup_item(backup_id="b", status="RUNNING"))
        reports = ((50, ThrottleReport(cuts=1)), (80, ThrottleReport(cuts=2)), (60, None))
        for held, throttle in reports:
            svc.catalog.add_progress(
                "c", "b", bytes_done=1, objects_done=1, throttle=throttle, held_log_bytes=held
            )
        record = svc.catalog.get("c", "b")
    assert record.held_log_bytes == 80  # a smaller report from another node does not win
    assert record.throttle == ThrottleReport(cuts=2)
    assert (record.bytes_done, record.objects_done) == (3, 3)


def test_objects_verified_together_count_as_one_update_of_the_same_totals(monkeypatch):
    """CheckUploads counts the objects it verified (signed at plan) in one update: the same
    bytes, count, latest throttle and most log held as one update per object would give."""
    from shardvault.backup.upload import count_progress
    from shardvault.contracts.models import ObjectChecksums, ObjectPlan, PartChecksum, Phase

    def done(index: int, length: int, throttle, held):
        obj = ObjectPlan(
            backup_id="b", cluster="c", node_id="n", shard_id="s", phase=Phase.DATA,
            index=index, key=f"k{index}", stream_offset=0, length=length, part_size=8 << 20,
            part_count=1,
        )  # fmt: skip
        part = PartChecksum(part_number=1, size=10, crc64nvme="AAAAAAAAAAA=")
        sums = ObjectChecksums(
            key=obj.key, parts=[part], crc64nvme=part.crc64nvme, stored_length=10, frames="",
            throttle=throttle, held_log_bytes=held,
        )  # fmt: skip
        return obj, sums

    with moto_services(monkeypatch) as svc:
        svc.catalog.put(backup_item(backup_id="b", status="RUNNING", held_log_bytes=70))
        count_progress([done(0, 5, {"cuts": 1}, 50), done(1, 7, {"cuts": 2}, 90)], svc)
        count_progress([done(2, 11, None, None)], svc)
        count_progress([], svc)  # nothing verified: nothing counted
        record = svc.catalog.get("c", "b")
    assert (record.bytes_done, record.objects_done) == (23, 3)
    assert record.throttle == ThrottleReport(cuts=2)
    assert record.held_log_bytes == 90


def test_a_count_for_an_item_that_does_not_exist_writes_nothing(monkeypatch):
    """A count for a backup the catalog does not hold is dropped: an item of counts alone has
    no status, and no reader could read it."""
    with moto_services(monkeypatch) as svc:
        counted = svc.catalog.add_progress(
            "c", "gone", bytes_done=1, objects_done=1, held_log_bytes=5
        )
        assert counted is False
        assert svc.catalog.table.scan()["Items"] == []
