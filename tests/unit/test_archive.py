"""The WAL archive function (shardvault.wal.archive): what it signs and records is what the node
wrote into its own inbox items, for a shard it leads in a cluster the policy gives it, and
nothing malformed; a batch is recorded only once the store holds it."""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import parse_qs, urlparse

import pytest
from shardvault_agent.wal import walspool

from shardvault.aws.services import Services
from shardvault.contracts import wal_archive
from shardvault.contracts.models import ShardInfo
from shardvault.data.frames import FrameInfo, pack_frames
from shardvault.errors import ChecksumMismatch, InvalidRequest, NotAMember, ShardNotReady
from shardvault.wal import archive

from .support import leader_node, moto_services

BATCH_ID = "0123456789abcdef0123456789abcdef"
SEGMENT = 16 * 1024 * 1024
CLUSTER = """
  {cluster}:
    engine: postgres
    schedule: {{full: '0 2 * * *'}}
    vault: {{storage_class: GLACIER_IR, object_lock: {{mode: GOVERNANCE, days: 1}}}}
    retention: {{keep_daily: 1}}
    nodes: [{nodes}]
"""


@pytest.fixture
def svc(monkeypatch: pytest.MonkeyPatch) -> Iterator[Services]:
    policy = "version: 1\nclusters:" + "".join(
        CLUSTER.format(cluster=c, nodes=f"{c}-n1") for c in ("orders", "other")
    )
    with moto_services(monkeypatch, store_url="s3://store/backups", policy=policy) as services:
        services.store_s3.create_bucket(Bucket="store")
        services.nodes.put(leader_node("orders", 1.0))
        yield services


def batch(**changes) -> wal_archive.Batch:
    names = ["000000010000000000000003", "000000010000000000000004"]
    fields = {
        "batch_id": BATCH_ID,
        "shard_id": "s1",
        "files": [{"name": n, "size": SEGMENT} for n in names],
        "frame_size": SEGMENT,
        "frames": pack_frames([FrameInfo(100, 1), FrameInfo(50, 2)]),
        "stored_length": 150,
        "crc64nvme": "AAAAAAAAAAA=",
        **changes,
    }
    return wal_archive.Batch.model_validate(fields)


def request(svc: Services, node_id: str, described: wal_archive.Batch | str) -> None:
    body = described if isinstance(described, str) else described.model_dump_json()
    svc.inbox.table.put_item(
        Item={"node_id": node_id, "command_id": f"#archive:{BATCH_ID}", "batch": body}
    )


def test_a_leader_that_described_its_batch_gets_a_url_bound_to_its_checksum(svc) -> None:
    request(svc, "orders-n1", batch())
    signed = archive.sign(svc, "orders-n1", BATCH_ID)
    assert signed["key"] == (
        f"backups/orders/_wal/s1/000000010000000000000003--000000010000000000000004--{BATCH_ID}.wal"
    )
    query = parse_qs(urlparse(signed["url"]).query)
    assert query["X-Amz-Expires"] == [str(archive.URL_TTL_SECONDS)]
    assert "x-amz-checksum-crc64nvme" in query["X-Amz-SignedHeaders"][0]


def test_only_what_the_node_wrote_into_its_own_items_is_signed(svc) -> None:
    request(svc, "orders-n2", batch())  # another node's item: not this node's request
    with pytest.raises(InvalidRequest, match="has no archive request"):
        archive.sign(svc, "orders-n1", BATCH_ID)
    with pytest.raises(InvalidRequest, match="32 hex digits"):
        archive.sign(svc, "orders-n1", "../../x")


def test_a_node_outside_its_clusters_policy_or_unregistered_is_refused(svc) -> None:
    svc.nodes.put(leader_node("orders", 1.0).model_copy(update={"node_id": "other-n1"}))
    request(svc, "other-n1", batch())  # listed under 'other', claims 'orders'
    with pytest.raises(NotAMember, match="lists it under 'other'"):
        archive.sign(svc, "other-n1", BATCH_ID)
    with pytest.raises(NotAMember, match="is not registered"):
        archive.settings(svc, "ghost-n9")


def test_only_a_shards_leader_archives_its_wal(svc) -> None:
    follower = leader_node("orders", 1.0).model_copy(
        update={"shards": [ShardInfo(shard_id="s1", role="follower")]}
    )
    svc.nodes.put(follower)
    request(svc, "orders-n1", batch())
    with pytest.raises(ShardNotReady, match="which it does not lead"):
        archive.sign(svc, "orders-n1", BATCH_ID)


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        (
            {
                "files": [
                    {"name": "000000010000000000000004", "size": SEGMENT},
                    {"name": "000000010000000000000003", "size": SEGMENT},
                ]
            },
            "not in log order",
        ),
        ({"stored_length": 151}, "do not add up"),
        ({"frames": pack_frames([FrameInfo(150, 1)])}, "1 frames where its files make 2"),
        (
            {
                "files": [
                    {"name": f"0000000100000000000000{i:02X}", "size": SEGMENT} for i in range(17)
                ]
            },
            "over 268,435,456",
        ),
    ],
)
def test_a_malformed_batch_is_refused_naming_its_problem(svc, changes, problem) -> None:
    request(svc, "orders-n1", batch(**changes))
    with pytest.raises(InvalidRequest, match=problem):
        archive.sign(svc, "orders-n1", BATCH_ID)


def test_a_name_that_is_no_wal_files_is_refused(svc) -> None:
    described = batch().model_dump(mode="json")
    described["files"][0]["name"] = "../postgresql.conf"
    request(svc, "orders-n1", archive.json.dumps(described))
    with pytest.raises(InvalidRequest, match=r"is not a WAL or binary log file.s name"):
        archive.sign(svc, "orders-n1", BATCH_ID)


def test_a_batch_not_in_the_store_is_not_recorded(svc) -> None:
    request(svc, "orders-n1", batch())
    with pytest.raises(ChecksumMismatch, match="not stored as described"):
        archive.record(svc, "orders-n1", BATCH_ID, now=1.0)
    assert archive.archived_batches(svc, "orders", "s1") == []


def test_settings_follow_the_clusters_policy(svc) -> None:
    answer = archive.settings(svc, "orders-n1")
    assert answer["cluster"] == "orders"
    assert answer["max_delay_seconds"] == 60.0
    assert answer["batch_max_bytes"] == wal_archive.BATCH_MAX_BYTES
    assert answer["encryption"] is None  # the policy says encryption: none
    assert answer["encrypt"] is False


def test_the_agents_push_and_the_archive_take_the_same_wal_names() -> None:
    assert wal_archive.WAL_FILE.pattern == walspool.WAL_FILE.pattern
