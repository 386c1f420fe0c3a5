"""A chain's newer objects are prefetched by each node as it prepares (issue 10): the check
after Prepare refuses an agent that did not say it prefetches; a node without room for the
spools is refused before it fetches; a spool read back is held to the bytes asked for."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from shardvault_agent.transfer import SpoolReader

from shardvault.data.checksums import crc64nvme_of_bytes
from shardvault.errors import DownloadIncomplete, PartDownloadFailed, UnknownCommand
from shardvault.restore.planner import check_prepared
from shardvault.workflow.fanout import NodeStepFailed

NODES = [
    {"node_id": "n1", "prefetch_key": "work/r1/prefetch/n1.json"},
    {"node_id": "n2", "prefetch_key": None},
]


def test_nodes_that_said_they_prefetch_pass() -> None:
    results = [
        {"node_id": "n1", "prepared": ["s1"], "bytes": 10, "prefetched": {"objects": 3}},
        {"node_id": "n2", "prepared": ["s2"], "bytes": 10, "prefetched": {"objects": 0}},
    ]

    assert check_prepared(results, NODES) == {"nodes": 2}


def test_an_agent_that_did_not_prefetch_is_refused_by_name() -> None:
    """An agent from before prefetching ignores the list and would finish the chain without
    its newer blocks (or refuse the full's objects later): refused here, with the fix."""
    results = [
        {"node_id": "n1", "prepared": ["s1"], "bytes": 10},
        {"node_id": "n2", "prepared": ["s2"], "bytes": 10},
    ]

    with pytest.raises(UnknownCommand, match="node n1 did not prefetch") as raised:
        check_prepared(results, NODES)

    assert "upgrade shardvault-agent" in str(raised.value.fix)


def test_a_nodes_own_failure_comes_first() -> None:
    results = [
        {"node_id": "n1", "error": {"Error": "PartDownloadFailed", "Cause": "cut"}},
        {"node_id": "n2", "prepared": ["s2"]},
    ]

    with pytest.raises(NodeStepFailed, match="cut") as raised:
        check_prepared(results, NODES)

    assert type(raised.value).__name__ == PartDownloadFailed.__name__


def test_a_spool_shorter_than_the_bytes_asked_for_fails_by_name(tmp_path) -> None:
    spool = tmp_path / "o.spool"
    spool.write_bytes(b"x" * 100)
    got: list[tuple[int, bytes]] = []

    crc = SpoolReader(spool).fetch("", "key", 10, 50, lambda at, data: got.append((at, data)))

    assert b"".join(d for _, d in got) == b"x" * 50
    assert got[0][0] == 0
    assert crc == crc64nvme_of_bytes(b"x" * 50)
    with pytest.raises(DownloadIncomplete, match="the spool of key ends at byte 100"):
        SpoolReader(spool).fetch("", "key", 90, 50, lambda at, data: None)


def test_no_room_for_the_spools_in_state_dir_fails_before_any_fetch(tmp_path, monkeypatch):
    """The prefetched objects wait, stored, in state_dir: a node without room for them (and,
    on a shared disk, for the shards too) is refused by name at prepare, before it fetches."""
    import shutil

    from shardvault_agent.commands import Commands
    from shardvault_agent.engines.sqlite.adapter import SqliteAdapter
    from shardvault_agent.ratelimit import RateLimiter

    from shardvault.contracts.commands import PrepareRestoreArgs
    from shardvault.contracts.models import DownloadItem
    from shardvault.errors import TargetTooSmall

    from .support import restore_target

    config = restore_target(tmp_path)
    fetched: list[str] = []
    downloader = SimpleNamespace(fetch=lambda *args: fetched.append(args[1]))
    commands = Commands(
        config,
        SqliteAdapter(config),
        RateLimiter(None),
        SimpleNamespace(http=None),
    )
    restorer = commands.restorer
    restorer.downloads.downloader = downloader  # type: ignore[assignment]
    item = DownloadItem(
        restore_id="r1",
        target_cluster="t",
        node_id="n1",
        shard_id="s1",
        phase="data",
        key="backups/c/b2/s1/data-00000",
        stream_offset=0,
        length=4 << 20,
        part_size=8 << 20,
        part_count=1,
        crc64nvme="AAAAAAAAAAA=",
        from_chain=True,
    )
    args = {
        "backup_id": "r1",
        "shards": [{"shard_id": "s1", "streams": []}],
        "prefetch": {"downloads": [{"object": item.model_dump(mode="json"), "url": "u"}]},
    }
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=1 << 20))

    with pytest.raises(TargetTooSmall, match=r"needs 4194304 bytes in state_dir") as raised:
        restorer.prepare(PrepareRestoreArgs.model_validate(args))

    assert "free space in state_dir" in str(raised.value.fix)
    assert fetched == []
    assert not list((tmp_path / "state").rglob("*.spool"))
