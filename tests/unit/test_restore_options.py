"""``restore --plan-only`` says, before anything moves, what the restore will cost and how
long the thaw takes at each retrieval tier, for the whole chain it reads."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from shardvault.client import cli
from shardvault.client import operations as ops
from shardvault.client.commands import restore as restore_command
from shardvault.lifecycle.costs import StoredPart, price_restore, restore_options
from shardvault.pricing.prices import RestoreTier, StorageClass
from shardvault.restore import admission
from tests.unit.support import backup_item

GIB = 2**30


def test_nothing_archived_is_read_directly_without_a_thaw() -> None:
    parts = [StoredPart(StorageClass.STANDARD, GIB, 4), StoredPart(StorageClass.STANDARD, GIB, 1)]
    (option,) = restore_options(parts)
    assert option.tier is None
    assert option.ready_within_hours == 0
    assert option.usd == pytest.approx(
        sum(price_restore(p.storage_class, p.bytes, p.objects).total_usd for p in parts)
    )


def test_a_chain_with_an_archived_full_is_priced_per_tier_both_classes_offer() -> None:
    glacier_full = StoredPart(StorageClass.GLACIER, 100 * GIB, 400)
    deep_full = StoredPart(StorageClass.DEEP_ARCHIVE, 100 * GIB, 400)
    incremental = StoredPart(StorageClass.STANDARD, GIB, 4)

    options = restore_options([glacier_full, incremental])
    assert [o.tier for o in options] == [
        RestoreTier.EXPEDITED,
        RestoreTier.STANDARD,
        RestoreTier.BULK,
    ]
    assert [o.ready_within_hours for o in options] == [5 / 60, 5.0, 12.0]
    assert options[0].usd > options[1].usd > options[2].usd  # faster costs more
    # Every member is counted: the incremental's reads are in every tier's total.
    alone = restore_options([glacier_full])
    assert all(o.usd > a.usd for o, a in zip(options, alone, strict=True))

    # Deep Archive has no Expedited tier: a chain holding both offers what both offer, and
    # waits for the slowest.
    mixed = restore_options([deep_full, glacier_full])
    assert [o.tier for o in mixed] == [RestoreTier.STANDARD, RestoreTier.BULK]
    assert [o.ready_within_hours for o in mixed] == [12.0, 48.0]


def test_plan_only_prints_the_tiers_of_the_chain_it_would_read(monkeypatch) -> None:
    monkeypatch.setenv("SHARDVAULT_STATE_MACHINE_ARN", "arn:backup")
    monkeypatch.setenv("SHARDVAULT_CATALOG_TABLE", "catalog")
    monkeypatch.setenv("SHARDVAULT_RESTORE_STATE_MACHINE_ARN", "arn:restore")
    records = {
        "full": backup_item(backup_id="full", kind="full", bytes=10 * GIB, objects=40,
                            stored_bytes=2 * GIB, location="vault", storage_class="GLACIER"),
        "incr": backup_item(backup_id="incr", kind="incremental", parent_id="full", depth=1,
                            bytes=GIB, objects=2, stored_bytes=GIB // 8),
    }  # fmt: skip
    plan = {"cluster": "orders", "backup_id": "incr", "target_cluster": "copy", "placements": []}
    monkeypatch.setattr(ops, "start_restore", lambda config, request: "arn:execution")
    monkeypatch.setattr(
        ops, "wait_restore", lambda config, arn: ops.Progress(status="SUCCEEDED", record=plan)
    )
    monkeypatch.setattr(ops, "show_backup", lambda config, cluster, backup_id: records[backup_id])
    monkeypatch.setattr(admission, "resolve_backup", lambda request, catalog: records["incr"])
    monkeypatch.setattr(restore_command, "table", lambda name: None)
    text = io.StringIO()
    monkeypatch.setattr(restore_command, "console", Console(file=text, width=200))

    assert cli.main(["restore", "orders", "--into", "copy", "--plan-only", "--tier", "Bulk"]) == 0

    said = text.getvalue()
    assert "Reading 2 backup(s)" in said
    for row in ("Expedited", "Standard", "Bulk (--tier)", "up to 5 min", "up to 12 h"):
        assert row in said


def test_a_copy_is_priced_where_it_is_held() -> None:
    """From a GCS copy: no thaw in any class, its retrieval fee and the bytes leaving Google;
    from account B: S3's tiers for the copy's class, no transfer within the region."""
    from shardvault.lifecycle.costs import copy_restore_options
    from shardvault.pricing.prices import GCS_EGRESS_INTERNET_GB, GCS_STORAGE

    (gcs,) = copy_restore_options([StoredPart("ARCHIVE", 10 * GIB, 40)], "gcs")  # type: ignore[arg-type]
    assert (gcs.tier, gcs.ready_within_hours) == (None, 0.0)
    per_gb = GCS_STORAGE["ARCHIVE"].retrieval_gb + GCS_EGRESS_INTERNET_GB
    assert gcs.usd == pytest.approx(10 * per_gb + 40 * GCS_STORAGE["ARCHIVE"].get)

    deep = StoredPart(StorageClass.DEEP_ARCHIVE, 10 * GIB, 40)
    assert copy_restore_options([deep], "aws") == restore_options([deep])


def test_plan_only_from_a_copy_prices_the_copy_not_the_stack_vault(monkeypatch) -> None:
    monkeypatch.setenv("SHARDVAULT_STATE_MACHINE_ARN", "arn:backup")
    monkeypatch.setenv("SHARDVAULT_CATALOG_TABLE", "catalog")
    monkeypatch.setenv("SHARDVAULT_RESTORE_STATE_MACHINE_ARN", "arn:restore")
    copy = {"state": "COPIED", "kind": "gcs", "storage_class": "NEARLINE", "bytes": GIB,
            "objects": 4, "manifest_key": "m"}  # fmt: skip
    record = backup_item(backup_id="full", kind="full", bytes=GIB, objects=4, stored_bytes=GIB,
                         location="vault", storage_class="DEEP_ARCHIVE",
                         vault_copies={"offsite": copy})  # fmt: skip
    plan = {"cluster": "orders", "backup_id": "full", "target_cluster": "copy", "placements": []}
    monkeypatch.setattr(ops, "start_restore", lambda config, request: "arn:execution")
    monkeypatch.setattr(
        ops, "wait_restore", lambda config, arn: ops.Progress(status="SUCCEEDED", record=plan)
    )
    monkeypatch.setattr(ops, "show_backup", lambda config, cluster, backup_id: record)
    monkeypatch.setattr(admission, "resolve_backup", lambda request, catalog: record)
    monkeypatch.setattr(restore_command, "table", lambda name: None)
    text = io.StringIO()
    monkeypatch.setattr(restore_command, "console", Console(file=text, width=200))

    argv = ["restore", "orders", "--into", "copy", "--plan-only", "--from-vault", "offsite"]
    assert cli.main(argv) == 0

    said = text.getvalue()
    assert "Reading 1 backup(s) from copy offsite (GCS)" in said
    assert "read directly (no thaw)" in said  # DEEP_ARCHIVE's tiers are the stack vault's
    assert "Bulk" not in said
