"""The catalog's reads that stop early: an incremental's admission finds its parent among the
newest items, not by reading the cluster's whole history."""

from __future__ import annotations

from decimal import Decimal

import pytest

from shardvault.aws.tables import NEWEST_PAGE_ITEMS
from shardvault.contracts.models import BackupStatus

from .support import moto_services


def test_the_newest_backup_in_a_status_is_found_among_restores_drills_and_the_lock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with moto_services(monkeypatch) as svc:
        table = svc.catalog.table
        items = [
            ("20261101T020000Z-aaaaaa", "COMPLETE"),
            ("20261102T020000Z-bbbbbb", "COMPLETE"),  # the newest complete backup
            ("20261103T020000Z-cccccc", "FAILED"),
            ("20261104T020000Z-dddddd", "RUNNING"),
            ("restore#r20261105T000000Z-eeeeee", "COMPLETE"),  # a restore into the cluster
            ("drill#20261106T000000Z-ffffff", "COMPLETE"),
            ("#lock", "COMPLETE"),
        ]
        for backup_id, status in items:
            table.put_item(Item={"cluster": "c", "backup_id": backup_id, "status": status})
        other = {"cluster": "other", "backup_id": "20261107T0Z-0", "status": "COMPLETE"}
        table.put_item(Item=other)

        newest = svc.catalog.newest_backup("c", BackupStatus.COMPLETE)
        assert newest is not None
        assert newest.backup_id == "20261102T020000Z-bbbbbb"
        assert svc.catalog.newest_backup("c", BackupStatus.REFUSED) is None
        assert svc.catalog.newest_backup("nobody", BackupStatus.COMPLETE) is None


def test_the_newest_backup_is_found_past_pages_of_others(monkeypatch: pytest.MonkeyPatch):
    """A filtered query's page may hold no match and still have more after it."""
    with moto_services(monkeypatch) as svc:
        table = svc.catalog.table
        table.put_item(Item={"cluster": "c", "backup_id": "20250101T0Z-0", "status": "COMPLETE"})
        for day in range(1, 29):  # four weeks of failures since, each item made large
            backup_id = f"202602{day:02d}T0Z-0"
            item = {"cluster": "c", "backup_id": backup_id, "status": "FAILED", "pad": "x" * 60_000}
            table.put_item(Item=item)

        newest = svc.catalog.newest_backup("c", BackupStatus.COMPLETE)
        assert newest is not None
        assert newest.backup_id == "20250101T0Z-0"


def test_the_newest_backup_is_read_from_a_page_not_the_history(monkeypatch: pytest.MonkeyPatch):
    """Forty complete backups: the newest is found in the first page, and the pages read
    hold no more than a page's items (without a limit, DynamoDB returns up to 1 MB), each
    only its id and completion time; the newest's record is then read whole."""
    with moto_services(monkeypatch) as svc:
        table = svc.catalog.table
        for second in range(1, 41):
            backup_id = f"20260101T{second:06d}Z-0"
            item = {
                "cluster": "c",
                "backup_id": backup_id,
                "status": "COMPLETE",
                "cause": "x" * 999,
            }
            table.put_item(Item=item)
        returned: list[dict] = []
        query = table.query

        def counted(**kwargs):
            page = query(**kwargs)
            returned.extend(page.get("Items", []))
            return page

        monkeypatch.setattr(svc.catalog.table, "query", counted)
        newest = svc.catalog.newest_backup("c", BackupStatus.COMPLETE)
        assert newest is not None
        assert newest.backup_id == "20260101T000040Z-0"
        assert newest.cause == "x" * 999  # the record, whole
        assert len(returned) <= NEWEST_PAGE_ITEMS
        assert all(set(item) <= {"backup_id", "completed_at"} for item in returned)


def test_a_newest_backup_whose_status_changed_meanwhile_is_looked_for_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Expired between the search and the read of its record: the one before it is found."""
    with moto_services(monkeypatch) as svc:
        table = svc.catalog.table
        for backup_id in ("20261101T0Z-0", "20261102T0Z-0"):
            table.put_item(Item={"cluster": "c", "backup_id": backup_id, "status": "COMPLETE"})
        get = svc.catalog.get

        def expiring(cluster, backup_id):
            if backup_id == "20261102T0Z-0":
                table.update_item(
                    Key={"cluster": cluster, "backup_id": backup_id},
                    UpdateExpression="SET #s = :s",
                    ExpressionAttributeNames={"#s": "status"},
                    ExpressionAttributeValues={":s": "EXPIRED"},
                )
            return get(cluster, backup_id)

        monkeypatch.setattr(svc.catalog, "get", expiring)
        newest = svc.catalog.newest_backup("c", BackupStatus.COMPLETE)
        assert newest is not None
        assert newest.backup_id == "20261101T0Z-0"


def test_of_two_backups_started_in_one_second_the_one_that_completed_last_is_newest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A small cluster's full and its incremental can start in the same second: their ids
    then sort by their random suffix, and only their completion orders them."""
    with moto_services(monkeypatch) as svc:
        for backup_id, completed in (
            ("20261129T061234Z-999999", 1.0),
            ("20261129T061235Z-f0cb60", 2.0),  # the full, the greater id
            ("20261129T061235Z-60518e", 2.5),  # its incremental, completed after it
        ):
            item = {"cluster": "c", "backup_id": backup_id, "status": "COMPLETE"}
            svc.catalog.table.put_item(Item=item | {"completed_at": Decimal(str(completed))})

        newest = svc.catalog.newest_backup("c", BackupStatus.COMPLETE)
        assert newest is not None
        assert newest.backup_id == "20261129T061235Z-60518e"


def test_a_partial_item_is_left_out_of_a_listing_and_left_in_the_table(monkeypatch, caplog):
    """An item that does not read as a backup (written by hand, without a status) does not
    hide the cluster's other backups; it stays in the table, and the log names it."""
    with moto_services(monkeypatch) as svc:
        svc.catalog.table.put_item(Item={"cluster": "c", "backup_id": "20261101T0Z-bad"})
        svc.catalog.table.put_item(
            Item={"cluster": "c", "backup_id": "20261102T0Z-good", "status": "COMPLETE"}
        )
        assert [b.backup_id for b in svc.catalog.backups("c")] == ["20261102T0Z-good"]
        assert len(svc.catalog.table.scan()["Items"]) == 2
    assert "c/20261101T0Z-bad is not a readable BackupItem" in caplog.text


def test_changes_of_one_kind_are_refused_on_an_item_of_another(monkeypatch):
    """A restore's fields written under a backup's key would make an item no reader reads."""
    from shardvault.contracts.catalog import RestoreItem

    with moto_services(monkeypatch) as svc:
        with pytest.raises(ValueError, match="RestoreItem changes cannot go to item 'b1'"):
            svc.catalog.update("c", "b1", RestoreItem.changes(frozen=1))
        assert svc.catalog.table.scan()["Items"] == []
