"""Lifetime classes (``shardvault.lifecycle.lifetimes``): how long retention keeps a backup, and the
class that costs least for that life with the class's minimum billed duration paid (retention holds
a backup until then): the policy's class unless a shorter-minimum class is cheaper still, or
the policy's class whatever it costs when the policy forces it. Then the Validate step, which
lands each backup in its lifetime class at the size the catalog measured."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest

from shardvault import backup
from shardvault.aws.lambda_support import parse
from shardvault.aws.services import Services
from shardvault.config.policy import parse_policy
from shardvault.contracts.models import BackupRequest
from shardvault.lifecycle import costs, lifetimes
from shardvault.pricing.prices import StorageClass
from tests.unit.support import catalog_item

from .support import leader_node, moto_services

MiB, GiB, TiB = 2**20, 2**30, 2**40
DAY = timedelta(days=1)
TARGET = costs.TARGET_CLUSTER  # DEEP_ARCHIVE, 30-day lock, 7 daily / 4 weekly / 12 monthly
TUESDAY = datetime(2026, 5, 5, 2, tzinfo=UTC)
LAST_SUNDAY_OF_MAY = datetime(2026, 5, 31, 2, tzinfo=UTC)  # the month's newest backup


def policy(vault: str = "", lock_days: int = 1):
    """The target's schedule and retention, with a lock of ``lock_days``; ``vault``: more
    fields of the vault."""
    return parse_policy(
        "version: 1\nclusters:\n  c:\n    engine: postgres\n"
        '    schedule: {full: "0 2 * * 0", incremental: "0 2 * * 1-6"}\n'
        f"    vault: {{storage_class: DEEP_ARCHIVE, object_lock: {{days: {lock_days}}}{vault}}}\n"
        "    retention: {keep_daily: 7, keep_weekly: 4, keep_monthly: 12}\n"
    ).cluster("c")


# --- Expected lifetimes ------------------------------------------------------------------------
def test_a_tuesday_backup_lives_as_long_as_the_newest_of_its_weeks_chain_is_kept() -> None:
    # Kept 7 days by keep_daily, then by the chain of Wednesday's to Saturday's incrementals,
    # until Saturday's own 7 days are over: 4 + 7 days.
    cluster = policy()
    assert lifetimes.expected_lifetime(cluster, TUESDAY) == 11 * DAY
    assert lifetimes.expected_lifetime(cluster, LAST_SUNDAY_OF_MAY) == lifetimes.LIFETIME_HORIZON
    assert lifetimes.LIFETIME_HORIZON == 180 * DAY  # DEEP_ARCHIVE's minimum, the longest


def test_the_lock_lengthens_the_lifetime() -> None:
    # The target's 30-day lock: Saturday's incremental, locked 30 days, keeps its chain.
    assert lifetimes.expected_lifetime(TARGET, TUESDAY) == (4 + 30) * DAY
    assert lifetimes.expected_lifetime(TARGET, TUESDAY, lock_days=100) == (4 + 100) * DAY


def test_one_backup_at_a_time_agrees_with_the_forecasts_simulation() -> None:
    lives, end = costs.simulate_lifetimes(TARGET, TiB, 0.05)
    year = [life for life in lives if end - costs.YEAR < life.completed_at <= end]
    for life in year[::17]:  # a spread of weekdays and month ends
        expected = lifetimes.expected_lifetime(TARGET, life.completed_at)
        assert expected == min(life.span(), lifetimes.LIFETIME_HORIZON)


# --- The class a lifetime suits ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("what", "days", "size"),
    [
        ("a daily incremental, kept 7 days", 7, 51 * GiB),
        ("a weekly full, kept about 35 days", 35, TiB),
        ("a monthly full, kept a year", 365, TiB),
    ],
)
def test_large_backups_stay_in_deep_archive_whatever_their_life(what, days, size) -> None:
    """DEEP_ARCHIVE's 180 days at $0.00099 cost less than STANDARD_IA's 30 at $0.0125 (or
    GLACIER's 90 at $0.0036): a backup kept a week is still cheapest there, minimum paid."""
    life = days * DAY
    chosen = lifetimes.lifetime_class(TARGET.vault, life, size)
    assert chosen == StorageClass.DEEP_ARCHIVE, what
    cost = {c: lifetimes.cost_for_lifetime(c, size, life) for c in StorageClass}
    assert (
        cost[StorageClass.DEEP_ARCHIVE]
        < cost[StorageClass.GLACIER]
        < cost[StorageClass.STANDARD_IA]
    )


def test_a_small_backup_kept_a_week_leaves_deep_archive_for_standard_ia() -> None:
    # 1 MiB in one object: DEEP_ARCHIVE's $0.05 per thousand PUTs outweighs its storage, even
    # billed 180 days; STANDARD_IA costs less, its 30 days paid.
    assert lifetimes.lifetime_class(TARGET.vault, 7 * DAY, MiB) == StorageClass.STANDARD_IA
    # Kept a year, the same backup is cheaper in DEEP_ARCHIVE: the lifetime decides.
    assert lifetimes.lifetime_class(TARGET.vault, 365 * DAY, MiB) == StorageClass.DEEP_ARCHIVE


def test_only_the_policys_class_and_classes_with_a_shorter_minimum_are_candidates() -> None:
    # A GLACIER_IR vault (90 days) may move to STANDARD_IA (30), never to GLACIER (also 90)
    # nor DEEP_ARCHIVE (180), which restore slower; large backups stay in GLACIER_IR.
    vault = TARGET.vault.model_copy(update={"storage_class": StorageClass.GLACIER_IR})
    for days in (1, 7, 60, 400):
        assert lifetimes.lifetime_class(vault, days * DAY, TiB) == StorageClass.GLACIER_IR
    assert lifetimes.lifetime_class(vault, 7 * DAY, MiB) == StorageClass.STANDARD_IA


def test_a_policy_that_forces_its_class_keeps_it() -> None:
    forced = policy(", class_by_lifetime: false")
    assert lifetimes.lifetime_class(forced.vault, 7 * DAY, MiB) == StorageClass.DEEP_ARCHIVE
    assert lifetimes.backup_class(forced, TUESDAY, MiB) == StorageClass.DEEP_ARCHIVE
    assert lifetimes.backup_class(policy(), TUESDAY, MiB) == StorageClass.STANDARD_IA


def test_class_by_lifetime_and_prompt_deletion_must_be_booleans() -> None:
    for field in ("class_by_lifetime", "delete_before_paid_minimum"):
        with pytest.raises(Exception, match=field):
            policy(f", {field}: sometimes")


# --- Validate lands each backup in its lifetime class ------------------------------------------
POLICY = """
version: 1
clusters:
  {name}:
    engine: sqlite
    schedule: {{full: "0 2 * * *"}}
    vault: {{storage_class: DEEP_ARCHIVE, object_lock: {{mode: GOVERNANCE, days: 1}}{extra}}}
    retention: {{keep_daily: 7}}
"""


@pytest.fixture
def svc(monkeypatch: pytest.MonkeyPatch) -> Iterator[Services]:
    text = POLICY.format(name="small", extra="") + POLICY.format(
        name="forced", extra=", class_by_lifetime: false"
    ).removeprefix("\nversion: 1\nclusters:\n")
    with moto_services(monkeypatch, vault_url="s3://vault/v", policy=text) as services:
        for cluster in ("small", "forced"):
            services.nodes.put(leader_node(cluster, time.time()))
        yield services


def measured_full(svc: Services, cluster: str, stored: int) -> None:
    """A complete full in the catalog, as Finalize and promotion leave it."""
    svc.catalog.put(
        catalog_item(
            {
                "cluster": cluster,
                "backup_id": "20260101T020000Z-aaaaaa",
                "status": "COMPLETE",
                "kind": "full",
                "completed_at": time.time() - 86_400,
                "bytes": stored,
                "stored_bytes": stored,
                "objects": 1,
                "location": "vault",
                "storage_class": "DEEP_ARCHIVE",
            }
        )
    )


def landed_class(svc: Services, cluster: str, vault: dict | None = None) -> str:
    request = parse(BackupRequest, {"cluster": cluster, "vault": vault, "execution_id": "x"})
    return backup.validate(request, svc, time.time()).vault.storage_class


def test_a_cluster_with_nothing_measured_lands_in_the_policys_class(svc) -> None:
    assert landed_class(svc, "small") == "DEEP_ARCHIVE"


def test_a_small_cluster_kept_a_week_lands_in_standard_ia(svc) -> None:
    measured_full(svc, "small", MiB)
    assert landed_class(svc, "small") == "STANDARD_IA"


def test_a_large_cluster_kept_a_week_stays_in_deep_archive(svc) -> None:
    measured_full(svc, "small", 100 * GiB)
    assert landed_class(svc, "small") == "DEEP_ARCHIVE"


def test_the_policy_or_the_request_may_force_the_class(svc) -> None:
    measured_full(svc, "forced", MiB)
    assert landed_class(svc, "forced") == "DEEP_ARCHIVE"
    measured_full(svc, "small", MiB)
    assert landed_class(svc, "small", {"storage_class": "DEEP_ARCHIVE"}) == "DEEP_ARCHIVE"
