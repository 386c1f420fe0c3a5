"""Progress is for display: a count DynamoDB throttles is dropped, never a failed object."""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError

from shardvault.tables import Catalog


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
