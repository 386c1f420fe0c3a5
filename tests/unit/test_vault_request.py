"""A backup request's ``vault`` can make the policy's vault stricter, never weaker: every field
is checked when the Validate step parses the request, a weaker one is refused by name, and a
refused request leaves no lock item and no catalog record behind.

The policy here (``POLICY``) names two clusters: ``orders`` (GLACIER, GOVERNANCE, 30 days) and
``ledger`` (DEEP_ARCHIVE, COMPLIANCE, 90 days); ``adhoc`` has agents but no policy entry.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from shardvault import backup
from shardvault.aws.lambda_support import parse
from shardvault.aws.services import Services
from shardvault.contracts.models import (
    BackupContext,
    BackupRequest,
    VaultRequest,
    VaultTarget,
)
from shardvault.errors import InvalidRequest

from .support import leader_node, moto_services

POLICY = """
version: 1
clusters:
  orders:
    engine: sqlite
    schedule: {full: "0 2 * * 0"}
    vault: {storage_class: GLACIER, object_lock: {mode: GOVERNANCE, days: 30}}
    retention: {keep_daily: 7}
  ledger:
    engine: sqlite
    schedule: {full: "0 2 * * 0"}
    vault: {storage_class: DEEP_ARCHIVE, object_lock: {mode: COMPLIANCE, days: 90}}
    retention: {keep_daily: 7}
"""
CLUSTERS = ("orders", "ledger", "adhoc")


def register(svc: Services, now: float) -> None:
    for cluster in CLUSTERS:
        svc.nodes.put(leader_node(cluster, now))


@pytest.fixture
def svc(monkeypatch: pytest.MonkeyPatch) -> Iterator[Services]:
    with moto_services(monkeypatch, vault_url="s3://vault/v", policy=POLICY) as services:
        register(services, time.time())
        yield services


def validate(svc: Services, cluster: str, vault: Any) -> BackupContext:
    """What the Validate Lambda does with an execution's input."""
    request = parse(BackupRequest, {"cluster": cluster, "vault": vault, "execution_id": "x"})
    return backup.validate(request, svc, time.time())


def assert_nothing_written(svc: Services, cluster: str) -> None:
    assert svc.catalog.lock_holder(cluster) is None
    assert svc.catalog.backups(cluster) == []


MALFORMED = [
    # (the request's vault, in the message, in the fix)
    ({"lock_mode": "NONE"}, "vault.lock_mode 'NONE' is not an Object Lock mode", "always locked"),
    ({"lock_mode": "off"}, "vault.lock_mode 'off'", "GOVERNANCE or COMPLIANCE"),
    ({"lock_mode": "compliance"}, "vault.lock_mode 'compliance'", "capitals: COMPLIANCE"),
    ({"lock_mode": "LEGAL_HOLD"}, "vault.lock_mode 'LEGAL_HOLD'", "use GOVERNANCE or COMPLIANCE"),
    ({"storage_class": "BOGUS"}, "vault.storage_class 'BOGUS' is not a vault storage class",
     "STANDARD_IA, GLACIER_IR, GLACIER, DEEP_ARCHIVE"),
    ({"storage_class": "STANDARD"}, "vault.storage_class 'STANDARD'", "where backups are staged"),
    ({"storage_class": "glacier"}, "vault.storage_class 'glacier'", "capitals: GLACIER"),
    ({"lock_days": 0}, "vault.lock_days 0", "from 1 to 36500"),
    ({"lock_days": 36_501}, "vault.lock_days 36501", "from 1 to 36500"),
    ({"lock_days": "60"}, "vault.lock_days '60'", "without quotes"),
    ({"lock_days": True}, "vault.lock_days True", "whole number"),
    ({"lock_days": 1.5}, "vault.lock_days 1.5", "whole number"),
    ({"lock": "COMPLIANCE"}, "vault has no field 'lock' (did you mean lock_mode?)",
     "storage_class, lock_mode, lock_days"),
    ({"retention_days": 9}, "vault has no field 'retention_days'", "storage_class, lock_mode"),
    ("on", "vault 'on' is not a mapping", '"lock_mode": "COMPLIANCE"'),
]  # fmt: skip


@pytest.mark.parametrize("cluster", ["orders", "adhoc"])
@pytest.mark.parametrize(("vault", "message", "fix"), MALFORMED)
def test_a_malformed_vault_field_is_refused_by_name(svc, cluster, vault, message, fix):
    with pytest.raises(InvalidRequest) as refused:
        validate(svc, cluster, vault)
    assert message in refused.value.message
    assert fix in refused.value.fix
    assert_nothing_written(svc, cluster)


WEAKER = [
    # (cluster, the request's vault, in the message, in the fix)
    ("orders", {"lock_days": 29}, "vault.lock_days 29 is shorter than the policy's vault for "
     "cluster 'orders', which requires at least 30 days", "30 days or more"),
    ("orders", {"storage_class": "DEEP_ARCHIVE"}, "vault.storage_class DEEP_ARCHIVE differs "
     "from the policy's vault for cluster 'orders', which requires GLACIER",
     "leave storage_class out"),
    ("ledger", {"lock_mode": "GOVERNANCE"}, "vault.lock_mode GOVERNANCE is weaker than the "
     "policy's vault for cluster 'ledger', which requires COMPLIANCE", "ask for COMPLIANCE"),
    ("ledger", {"lock_mode": "COMPLIANCE", "lock_days": 30}, "vault.lock_days 30 is shorter",
     "90 days or more"),
    # A full target is a request for every field: its default class differs from orders'.
    ("orders", VaultTarget(lock_days=60), "vault.storage_class DEEP_ARCHIVE differs", "GLACIER"),
]  # fmt: skip


@pytest.mark.parametrize(("cluster", "vault", "message", "fix"), WEAKER)
def test_a_request_weaker_than_the_policy_is_refused_not_raised(svc, cluster, vault, message, fix):
    with pytest.raises(InvalidRequest) as refused:
        validate(svc, cluster, vault)
    assert message in refused.value.message
    assert fix in refused.value.fix
    assert_nothing_written(svc, cluster)


STRICTER = [
    # (cluster, the request's vault, the vault the backup is promoted into)
    ("orders", None, ("GLACIER", "GOVERNANCE", 30)),
    ("orders", {}, ("GLACIER", "GOVERNANCE", 30)),
    ("orders", {"lock_days": 45}, ("GLACIER", "GOVERNANCE", 45)),
    ("orders", {"lock_mode": "COMPLIANCE"}, ("GLACIER", "COMPLIANCE", 30)),
    ("orders", {"storage_class": "GLACIER", "lock_days": 30}, ("GLACIER", "GOVERNANCE", 30)),
    ("orders", {"lock_mode": None, "lock_days": 31}, ("GLACIER", "GOVERNANCE", 31)),
    ("ledger", {"lock_days": 365}, ("DEEP_ARCHIVE", "COMPLIANCE", 365)),
    # A cluster the policy does not name may opt in; what it leaves out takes the defaults.
    ("adhoc", {"lock_days": 2}, ("DEEP_ARCHIVE", "GOVERNANCE", 2)),
    ("adhoc", {"storage_class": "GLACIER_IR", "lock_mode": "COMPLIANCE", "lock_days": 1},
     ("GLACIER_IR", "COMPLIANCE", 1)),
]  # fmt: skip


@pytest.mark.parametrize(("cluster", "vault", "expected"), STRICTER)
def test_a_request_may_make_the_policy_stricter(svc, cluster, vault, expected):
    context = validate(svc, cluster, vault)

    target = context.vault
    assert (target.storage_class, target.lock_mode, target.lock_days) == expected
    assert svc.catalog.lock_holder(cluster).holder == context.backup_id
    # The record's context, which later steps and the reaper read, holds the merged vault.
    (record,) = svc.catalog.backups(cluster)
    assert BackupContext.model_validate_json(record.context).vault == target


def test_a_cluster_outside_the_policy_without_a_vault_request_stays_in_the_store(svc):
    assert validate(svc, "adhoc", None).vault is None


def test_a_vault_request_where_the_deployment_has_no_vault_is_refused(monkeypatch):
    with moto_services(monkeypatch, policy=POLICY) as svc:  # no vault_url: no vault bucket
        register(svc, time.time())
        with pytest.raises(InvalidRequest, match="this deployment has none"):
            validate(svc, "orders", {"lock_days": 45})
        assert_nothing_written(svc, "orders")


def test_a_request_built_in_python_sends_only_the_fields_it_names():
    """What ``operations.start_backup`` sends: fields left out stay out, so they take the
    policy's values rather than a default that could differ from it."""
    request = BackupRequest(cluster="orders", vault=VaultRequest(lock_days=45))
    assert request.model_dump(mode="json", exclude_none=True)["vault"] == {"lock_days": 45}
