"""``verify --read-data`` on an object the store reports damaged as it serves it (MinIO's
bitrot protection breaks the body off, or answers an error): a named problem, recorded as
damaged, never a raw SDK error (issue 44, 2)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from botocore.exceptions import ClientError, ResponseStreamingError

from shardvault.assurance.verify import read_sample
from shardvault.aws.store import Bucket


class BrokenBody:
    def iter_chunks(self, size: int):
        yield b"x" * 10
        raise ResponseStreamingError(error="IncompleteRead(10 bytes read, 90 more expected)")


class DamagingStore:
    def __init__(self, how: str) -> None:
        self.how = how

    def head_object(self, **_: object) -> dict:
        return {"StorageClass": "STANDARD"}

    def get_object(self, **_: object) -> dict:
        if self.how == "error":
            raise ClientError({"Error": {"Code": "SlowDownRead"}}, "GetObject")
        return {"Body": BrokenBody()}


@pytest.mark.parametrize(
    ("how", "named"), [("cut", "ResponseStreamingError"), ("error", "SlowDownRead")]
)
def test_an_object_the_store_will_not_serve_whole_is_a_named_problem(how, named):
    obj = SimpleNamespace(
        key="backups/c/b/shard-1/data-00000", crc64nvme="x", stored_bytes=100, version_id=None
    )
    problems: list[str] = []
    damaging = Bucket(DamagingStore(how), "store")  # the client under the storage interface
    read, skipped = read_sample(damaging, [obj], 100, problems)
    assert (read, skipped) == (1, 0)
    (problem,) = problems
    assert problem.startswith(f"{obj.key} cannot be read back")
    assert named in problem
