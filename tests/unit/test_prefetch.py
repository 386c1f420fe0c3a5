"""A chain's newer objects are prefetched by each node as it prepares (issue 10): the check
after Prepare refuses an agent that did not say it prefetched, and counts what the nodes
fetched; a spool read back is held to the bytes asked for."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from shardvault_agent.transfer import SpoolReader

from shardvault.checksums import crc64nvme_of_bytes
from shardvault.errors import DownloadIncomplete, PartDownloadFailed, UnknownCommand
from shardvault.fanout import NodeStepFailed
from shardvault.models import RestoreContext
from shardvault.restore import check_prepared


def context() -> RestoreContext:
    return RestoreContext.model_validate(
        {
            "restore_id": "r1",
            "cluster": "c",
            "backup_id": "b",
            "manifest_key": "m",
            "engine": "sqlite",
            "target_cluster": "t",
            "placements": [],
            "assignments": [],
            "bytes": 0,
            "objects": 0,
            "tier": "Standard",
            "replace": False,
            "plan_only": False,
            "started_at": 0.0,
        }
    )


class Catalog:
    def __init__(self) -> None:
        self.progress: list[tuple[str, str, int, int]] = []

    def add_progress(self, cluster: str, key: str, bytes_done: int, objects_done: int) -> None:
        self.progress.append((cluster, key, bytes_done, objects_done))


NODES = [
    {"node_id": "n1", "prefetch_key": "work/r1/prefetch/n1.json"},
    {"node_id": "n2", "prefetch_key": None},
]


def test_the_prefetched_objects_count_in_the_restores_progress() -> None:
    svc = SimpleNamespace(catalog=Catalog())
    results = [
        {"node_id": "n1", "prefetched": {"objects": 3, "bytes": 300}},
        {"node_id": "n2", "prefetched": {"objects": 0, "bytes": 0}},
    ]

    assert check_prepared(context(), results, NODES, svc) == {"nodes": 2}  # type: ignore[arg-type]

    assert svc.catalog.progress == [("t", "restore#r1", 300, 3)]


def test_an_agent_that_did_not_prefetch_is_refused_by_name() -> None:
    """An agent from before prefetching ignores the list and would finish the chain without
    its newer blocks (or refuse the full's objects later): refused here, with the fix."""
    svc = SimpleNamespace(catalog=Catalog())
    results = [{"node_id": "n1", "prepared": ["s1"]}, {"node_id": "n2", "prepared": ["s2"]}]

    with pytest.raises(UnknownCommand, match="node n1 did not prefetch") as raised:
        check_prepared(context(), results, NODES, svc)  # type: ignore[arg-type]

    assert "upgrade shardvault-agent" in str(raised.value.fix)
    assert svc.catalog.progress == []


def test_a_nodes_own_failure_comes_first() -> None:
    svc = SimpleNamespace(catalog=Catalog())
    results = [
        {"node_id": "n1", "error": {"Error": "PartDownloadFailed", "Cause": "cut"}},
        {"node_id": "n2", "prepared": ["s2"]},
    ]

    with pytest.raises(NodeStepFailed, match="cut") as raised:
        check_prepared(context(), results, NODES, svc)  # type: ignore[arg-type]

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
