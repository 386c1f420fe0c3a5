"""Continuous WAL archiving (shardvault.archive, shardvault_agent.archiver): every WAL file a
real PostgreSQL archives through shardvault-wal-push reaches the store, compressed (sealed
when the policy says so), in batches whose indexes describe it; the spool empties; an agent
killed while archiving loses nothing.

Checked from outside the agent's report: the store's objects and indexes, the WAL files' own
page addresses, the spool and state directories, the node's inbox partition."""

from __future__ import annotations

import os
import shutil
import struct
import time
from pathlib import Path
from typing import Any

import boto3
import pytest
from shardvault_agent import walspool
from shardvault_agent.keys import DataKeys

from shardvault import archive
from shardvault.errors import FrameUnreadable
from shardvault.local import demo
from shardvault.local.postgres import PostgresInstance, _give_to_postgres, ensure_traversable
from shardvault.local.postgres import init_instance as init_postgres
from shardvault.materialize import read_batch
from shardvault.models import Encryption
from shardvault.pgwal import DEFAULT_SEGMENT_SIZE, SEGMENT_NAME, gaps, segment_number
from shardvault.pipeline import Sealer
from shardvault.tables import table

from .conftest import FAST_AGENT, names

SYSTEM_PYTHON = Path("/usr/bin/python3")  # the push runs as the server's user, as on a host
MARKER = "archive-marker-7f3a"


class ArchivingNode:
    def __init__(self, stack: Any, tmp_path: Path, delay: float, **policy: str) -> None:
        self.stack, self.cluster = stack, f"wal{next(names)}"
        self.node_id, self.shard_id = f"{self.cluster}-n1", "shard-1"
        self.spool = tmp_path / "spool"
        self.spool.mkdir()
        _give_to_postgres(self.spool)
        client = tmp_path / "push" / "walspool.py"
        client.parent.mkdir()
        shutil.copyfile(walspool.__file__, client)
        ensure_traversable(client.parent)
        command = f"{SYSTEM_PYTHON} {client} --spool {self.spool} --max-bytes {1 << 34} %p"
        self.server: PostgresInstance = init_postgres(
            tmp_path / "pg", settings={"archive_mode": "on", "archive_command": command}
        )
        self.config = demo.agent_config(
            tmp_path,
            self.cluster,
            self.node_id,
            "postgres",
            [
                {
                    "shard_id": self.shard_id,
                    "role": "leader",
                    "data_dir": str(self.server.data_dir),
                    "conninfo": self.server.conninfo,
                    "wal_spool_dir": str(self.spool),
                }
            ],
        )
        self.config.update(FAST_AGENT | {"archive_poll_seconds": 0.2})
        self.policy = {"engine": "postgres", "archive": f"{{max_delay_seconds: {delay}}}", **policy}

    def start_agent(self) -> None:
        self.stack.start_agent(self.config)
        self.stack.wait_for_nodes([self.node_id])

    def stop(self) -> None:
        self.stack.stop_agent(self.node_id)
        self.server.stop()

    def write_segments(self, count: int) -> str:
        """Fills ``count`` segments with rows that carry the marker; the last one's name."""
        self.server.psql(f"CREATE TABLE IF NOT EXISTS marks (n int, note text DEFAULT '{MARKER}')")
        last = ""
        for _ in range(count):
            self.server.psql("INSERT INTO marks (n) SELECT generate_series(1, 2000)")
            last = self.server.psql("SELECT pg_walfile_name(pg_switch_wal())")
        return last

    def batches(self) -> list[dict[str, Any]]:
        return archive.archived_batches(self.stack.services(), self.cluster, self.shard_id)

    def archived(self) -> list[str]:
        return sorted(f["name"] for b in self.batches() for f in b["files"])

    def wait_archived(self, last: str, timeout: float = 60) -> list[str]:
        """Waits until ``last`` is in the store and the spool is empty."""
        deadline = time.monotonic() + timeout
        while True:
            names_ = self.archived()
            spooled = [p.name for p in self.spool.iterdir()]
            if last in names_ and not spooled:
                return names_
            assert time.monotonic() < deadline, (last, names_[-3:], spooled)
            time.sleep(0.2)

    def leftovers(self) -> dict[str, list[str]]:
        """What archiving may leave behind once it is done: nothing."""
        state = Path(self.config["state_dir"]) / "archive"
        inbox = table(self.stack.settings.inbox_table)
        items = inbox.query(
            KeyConditionExpression=boto3.dynamodb.conditions.Key("node_id").eq(self.node_id)
        )["Items"]
        return {
            "state": sorted(p.name for p in state.iterdir()) if state.exists() else [],
            "requests": [
                i["command_id"] for i in items if i["command_id"].startswith(archive.REQUEST_PREFIX)
            ],
        }


@pytest.fixture
def archiving(stack, tmp_path, policy_for):
    made: list[ArchivingNode] = []

    def make(delay: float = 0.5, **policy: str) -> ArchivingNode:
        node = ArchivingNode(stack, tmp_path, delay, **policy)
        policy_for(node.cluster, **node.policy)
        made.append(node)
        return node

    yield make
    for node in made:
        node.stop()


def segments_in_sequence(files: dict[str, bytes]) -> list[str]:
    """The segments run without a gap, each the segment its name says (page address)."""
    segments = sorted(n for n in files if SEGMENT_NAME.fullmatch(n))
    assert segments
    assert not gaps(segments)
    for name in segments:
        data = files[name]
        assert len(data) == DEFAULT_SEGMENT_SIZE, name
        (page_address,) = struct.unpack_from("<Q", data, 8)
        assert page_address == segment_number(name) * DEFAULT_SEGMENT_SIZE, name
    return segments


def read_all(stack: Any, batches: list[dict[str, Any]], keys: DataKeys | None = None):
    svc = stack.services()
    files: dict[str, bytes] = {}
    for index in batches:
        encryption = index.get("encryption")
        sealer = keys.sealer(Encryption.model_validate(encryption)) if encryption else None
        files.update(read_batch(svc.store_s3, svc.store.bucket, index, sealer))
    return files


def raw_objects(stack: Any, batches: list[dict[str, Any]]) -> bytes:
    svc = stack.services()
    return b"".join(
        svc.store_s3.get_object(Bucket=svc.store.bucket, Key=b["key"])["Body"].read()
        for b in batches
    )


def test_every_archived_wal_file_reaches_the_store_compressed_and_in_sequence(archiving) -> None:
    node = archiving(delay=0.5)
    node.start_agent()
    last = node.write_segments(6)
    node.wait_archived(last)
    batches = node.batches()
    files = read_all(node.stack, batches)
    segments = segments_in_sequence(files)
    assert segments[-1] == last
    assert len(segments) >= 6
    # Compressed: the mostly empty tails of switched segments shrink to almost nothing.
    stored = sum(b["stored_length"] for b in batches)
    plain = sum(f["size"] for b in batches for f in b["files"])
    assert stored < plain / 5, (stored, plain)
    assert MARKER.encode() in b"".join(files.values())  # the rows are in the archive
    assert node.leftovers() == {"state": [], "requests": []}


def test_segments_that_arrive_together_share_one_object(archiving) -> None:
    node = archiving(delay=3.0)
    last = node.write_segments(5)  # spooled before the agent starts: one batch takes them
    node.start_agent()
    node.wait_archived(last)
    batches = node.batches()
    assert len(batches) == 1, [b["key"] for b in batches]
    assert len(batches[0]["files"]) >= 5


def test_a_sealed_archive_shows_a_bucket_reader_no_plaintext(archiving) -> None:
    node = archiving(delay=0.5, encryption="kms")
    node.start_agent()
    last = node.write_segments(3)
    node.wait_archived(last)
    batches = node.batches()
    assert all(b["encryption"] and b["encryption"]["key_check"] for b in batches)
    assert MARKER.encode() not in raw_objects(node.stack, batches)
    svc = node.stack.services()
    for wrong in (None, Sealer(os.urandom(32))):  # without the key, or with another: no frame
        with pytest.raises(FrameUnreadable):
            read_batch(svc.store_s3, svc.store.bucket, batches[0], wrong)
    files = read_all(node.stack, batches, DataKeys(lambda: boto3.client("kms")))
    assert segments_in_sequence(files)[-1] == last
    assert MARKER.encode() in b"".join(files.values())


def test_an_agent_killed_while_archiving_loses_no_wal_file(archiving) -> None:
    node = archiving(delay=0.2)
    node.start_agent()
    first = node.write_segments(2)
    node.wait_archived(first)
    for _ in range(3):  # killed at whatever it was doing, with WAL still coming
        node.write_segments(3)
        time.sleep(0.3)
        node.stack.stop_agent(node.node_id, kill=True)
        node.write_segments(2)
        node.start_agent()
    last = node.write_segments(1)
    names_ = node.wait_archived(last)
    segments = [n for n in names_ if SEGMENT_NAME.fullmatch(n)]
    first_number = segment_number(segments[0])
    numbers = sorted({segment_number(n) for n in segments})
    assert numbers == list(range(first_number, segment_number(last) + 1))  # no gap
    segments_in_sequence(read_all(node.stack, node.batches()))
    assert node.server.psql("SELECT failed_count FROM pg_stat_archiver") == "0"
    assert node.leftovers() == {"state": [], "requests": []}
