"""Progress is for display: a count DynamoDB throttles is dropped, never a failed object."""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError

from shardvault.tables import Catalog

from .support import moto_services


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
        svc.catalog.put({"cluster": "c", "backup_id": "b"})
        for held, throttle in ((50, {"cuts": 1}), (80, {"cuts": 2}), (60, None)):
            svc.catalog.add_progress(
                "c", "b", bytes_done=1, objects_done=1, throttle=throttle, held_log_bytes=held
            )
        record = svc.catalog.get("c", "b")
    assert record["held_log_bytes"] == 80  # a smaller report from another node does not win
    assert record["throttle"] == {"cuts": 2}
    assert (record["bytes_done"], record["objects_done"]) == (3, 3)
