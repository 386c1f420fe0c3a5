"""Which backups are incrementals, of which parent, and when a full is due instead."""

from __future__ import annotations

import pytest

from shardvault.backup.admission import INCREMENTAL_FORMAT, Synthesis, chain_for, synthesis_for
from shardvault.config.policy import ClusterPolicy
from shardvault.contracts.catalog import BackupItem
from shardvault.contracts.models import BackupKind, BackupRequest, VaultTarget
from shardvault.errors import ParentUnavailable


class Catalog:
    def __init__(self, records: list[BackupItem]) -> None:
        self.records = records

    def newest_backup(self, cluster: str, status: str) -> BackupItem | None:
        """The newest in ``status``; the real catalog's ids sort by time (test_tables)."""
        found = [r for r in self.records if r.status == status]
        return max(found, key=lambda r: r.completed_at or 0) if found else None


class Svc:
    def __init__(self, records: list[BackupItem]) -> None:
        self.catalog = Catalog(records)


def policy(**incremental) -> ClusterPolicy:
    return ClusterPolicy.model_validate(
        {
            "engine": "sqlite",
            "schedule": {"full": "0 2 * * 0", "incremental": "0 2 * * 1-6"},
            "vault": {
                "storage_class": "GLACIER_IR",
                "object_lock": {"mode": "GOVERNANCE", "days": 1},
            },
            "retention": {"keep_daily": 7},
            "incremental": incremental,
        }
    )


def record(backup_id: str, at: float, status: str = "COMPLETE", **more) -> BackupItem:
    fields = {"format": INCREMENTAL_FORMAT, **more}
    return BackupItem.model_validate(
        {"cluster": "orders", "backup_id": backup_id, "status": status, "completed_at": at} | fields
    )


INCREMENTAL = BackupRequest(cluster="orders", incremental=True)


def test_an_incremental_continues_the_newest_complete_backup() -> None:
    records = [
        record("full", 1),
        record("i1", 2, depth=1, chain_root="full", ancestors=["full"]),
        record("failed", 3, status="FAILED"),
    ]
    kind, link, parent = chain_for(INCREMENTAL, Svc(records), policy())
    assert kind == BackupKind.INCREMENTAL
    assert (link.parent_id, link.root_id, link.depth, link.ancestors) == (
        "i1",
        "full",
        2,
        ["full", "i1"],
    )
    assert parent.backup_id == "i1"


def test_a_full_is_due_when_the_chain_is_as_long_as_the_policy_allows() -> None:
    records = [record("full", 1), record("i1", 2, depth=1, chain_root="full", ancestors=["full"])]
    assert chain_for(INCREMENTAL, Svc(records), policy(max_chain=1))[0] == BackupKind.FULL


@pytest.mark.parametrize(
    "records",
    [
        [],
        [record("x", 1, status="FAILED")],
        [record("old", 1, format=2)],
        [record("gone", 1, status="EXPIRED")],
    ],
    ids=["none", "failed", "before-block-maps", "expired"],
)
def test_without_a_usable_parent_it_is_refused_or_a_full_per_the_policy(records) -> None:
    with pytest.raises(ParentUnavailable, match="has no parent"):
        chain_for(INCREMENTAL, Svc(records), policy(when_parent_unavailable="refuse"))
    assert chain_for(INCREMENTAL, Svc(records), policy())[0] == BackupKind.FULL


def test_a_full_request_is_a_full() -> None:
    assert (
        chain_for(BackupRequest(cluster="orders"), Svc([record("a", 1)]), policy())[0]
        == BackupKind.FULL
    )


VAULT = VaultTarget(storage_class="GLACIER_IR", lock_mode="GOVERNANCE", lock_days=1)


@pytest.mark.parametrize(
    ("parent", "why"),
    [
        ({}, "has not finished"),  # still being promoted
        ({"promotion": "FAILED"}, "failed"),
    ],
)
def test_a_vaulted_incremental_continues_only_a_parent_in_the_vault(parent, why) -> None:
    records = [record("full", 1, **parent)]
    with pytest.raises(ParentUnavailable, match=f"not in the vault \\(its promotion {why}"):
        chain_for(INCREMENTAL, Svc(records), policy(when_parent_unavailable="refuse"), VAULT)
    assert chain_for(INCREMENTAL, Svc(records), policy(), VAULT)[0] == BackupKind.FULL
    promoted = [record("full", 1, location="vault")]
    assert chain_for(INCREMENTAL, Svc(promoted), policy(), VAULT)[0] == BackupKind.INCREMENTAL
    # A backup that stays in the store may continue a parent the store still holds.
    assert chain_for(INCREMENTAL, Svc(records), policy())[0] == BackupKind.INCREMENTAL


class ChainCatalog(Catalog):
    def get(self, cluster: str, backup_id: str) -> BackupItem | None:
        return next((r for r in self.records if r.backup_id == backup_id), None)


def chain_svc(records: list[BackupItem]) -> Svc:
    svc = Svc(records)
    svc.catalog = ChainCatalog(records)
    return svc


FULL = BackupRequest(cluster="orders")
IN_VAULT = VaultTarget()


def kept_chain(**root: object) -> list[BackupItem]:
    """A full and an incremental, both in the vault with their staging copies kept."""
    kept = {"location": "vault", "staging_kept": True}
    return [
        record("full", 1, chain_root="full", **kept, **root),
        record("i1", 2, parent_id="full", depth=1, chain_root="full", ancestors=["full"], **kept),
    ]


def test_a_full_is_synthesized_from_the_newest_chain_when_the_policy_says_so() -> None:
    synthesis = synthesis_for(FULL, chain_svc(kept_chain()), policy(synthesized_fulls=2), IN_VAULT)

    assert isinstance(synthesis, Synthesis)
    assert synthesis.link.parent_id == "i1"
    assert synthesis.link.ancestors == ["full", "i1"]  # what it copies, root first
    assert synthesis.in_row == 1
    assert synthesis.fields("s1") == {
        "depth": 0,
        "chain_root": "s1",
        "ancestors": [],
        "synthesized_from": "i1",
        "synthesized_in_row": 1,
    }


def test_fulls_are_read_unless_the_policy_synthesizes_or_when_asked() -> None:
    svc = chain_svc(kept_chain())
    assert synthesis_for(FULL, svc, policy(), IN_VAULT) is None
    read = BackupRequest(cluster="orders", read_full=True)
    assert synthesis_for(read, svc, policy(synthesized_fulls=2), IN_VAULT) is None


@pytest.mark.parametrize(
    ("records", "why"),
    [
        ([], "no chain to synthesize from"),
        (kept_chain(synthesized_in_row=2), "2 full(s) in a row were synthesized"),
        (
            [
                record("full", 1, chain_root="full", location="vault"),
                record("i1", 2, depth=1, chain_root="full", ancestors=["full"], location="vault"),
            ],
            "backup full of the chain has no staging copy",
        ),
    ],
)
def test_a_full_the_chain_cannot_give_is_read_and_says_why(records, why) -> None:
    synthesis = synthesis_for(FULL, chain_svc(records), policy(synthesized_fulls=2), IN_VAULT)

    assert isinstance(synthesis, str)
    assert synthesis.startswith(why)


def test_a_request_for_an_incremental_read_full_is_refused() -> None:
    with pytest.raises(ValueError, match="not both"):
        BackupRequest(cluster="orders", incremental=True, read_full=True)
