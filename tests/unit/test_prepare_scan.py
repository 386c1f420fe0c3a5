"""PrepareScan: an incremental's scan arguments (its parent's block maps, its pack arguments)
from as few catalog reads as its chain allows (``shardvault.backup.scanning``)."""

from __future__ import annotations

from typing import Any

import pytest

from shardvault.backup.scanning import prepare_scan
from shardvault.contracts.models import BackupContext, BackupKind, ChainLink, Manifest
from shardvault.data.planning import choose_part_size
from tests.unit.support import catalog_item

from .support import lone_node_context, moto_services, requests_made, with_buckets

TiB = 2**40


def manifest(backup_id: str) -> Manifest:
    return Manifest(
        backup_id=backup_id,
        cluster="c",
        engine="sqlite",
        started_at=0.0,
        completed_at=1.0,
        checkpoint_skew_seconds=0.0,
        part_size=8 * 2**20,
        shards=[],
        bytes=0,
        objects=0,
        parts=0,
        verification="",
    )


def incremental(depth: int, parent_id: str) -> BackupContext:
    chain = ChainLink(parent_id=parent_id, root_id="full", depth=depth, ancestors=["full"])
    return lone_node_context("incr", kind=BackupKind.INCREMENTAL, chain=chain)


def prepared(monkeypatch: pytest.MonkeyPatch, context: BackupContext) -> tuple[Any, list, dict]:
    """Runs PrepareScan against a chain of a full (3 TiB) and an incremental (1 TiB recorded,
    so that a size chosen from it would differ); returns the catalog record's part size, the
    catalog requests made, and the node's scan arguments."""
    with moto_services(monkeypatch, work_bucket="work") as svc:
        with_buckets(svc, "work", "store")
        for backup_id, total in (("full", 3 * TiB), ("mid", 1 * TiB)):
            key = f"backups/c/{backup_id}/manifest.json"
            body = manifest(backup_id).model_dump_json().encode()
            svc.store_s3.put_object(Bucket="store", Key=key, Body=body)
            record = {"backup_id": backup_id, "manifest_key": key, "bytes_total": total}
            svc.catalog.put(catalog_item({"cluster": "c", "status": "COMPLETE", **record}))
        svc.catalog.put(catalog_item({"cluster": "c", "backup_id": "incr", "status": "RUNNING"}))
        calls = requests_made(svc.catalog.table.meta.client)

        prepare_scan(context, svc)

        made = [call for call in calls if call != "UpdateItem"]  # but the part size's record
        args = svc.get_work(svc.scan_args_key("incr", "n1"))
        record = svc.catalog.get("c", "incr")
        return record.part_size if record else None, made, args


def test_a_first_incrementals_part_size_comes_from_its_parent_the_full_read_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    part_size, calls, args = prepared(monkeypatch, incremental(1, "full"))

    assert calls == ["GetItem"]  # the full's record: the parent's and the root's
    assert part_size == args["pack"]["part_size"] == choose_part_size(3 * TiB)
    assert args["stop"]["cut"]["name"] == "incr"  # a lone node stops in its checkpoint


def test_a_deeper_incrementals_part_size_still_comes_from_its_chains_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    part_size, calls, args = prepared(monkeypatch, incremental(2, "mid"))

    assert calls == ["GetItem", "GetItem"]  # its parent's record, then the full's
    assert choose_part_size(3 * TiB) != choose_part_size(1 * TiB)
    assert part_size == args["pack"]["part_size"] == choose_part_size(3 * TiB)
