"""The cost model: prices follow the price table, forecasts add up, a budget overrun alerts,
and ``shardvault cost`` prints the issue's modeled case."""

from __future__ import annotations

import pytest

from shardvault import cli, costs
from shardvault.policy import parse_policy
from shardvault.prices import RestoreTier, StorageClass

GiB = 2**30


@pytest.mark.parametrize("storage_class", list(StorageClass))
def test_storage_cost_grows_with_bytes(storage_class: StorageClass) -> None:
    small = costs.monthly_storage_cost(storage_class, 100 * GiB, 100)
    large = costs.monthly_storage_cost(storage_class, 1000 * GiB, 100)
    assert 9 < large / small <= 10  # per-object overheads make it a little under 10x


def test_archive_is_cheaper_to_keep_and_dearer_to_read() -> None:
    keep = {c: costs.monthly_storage_cost(c, 1000 * GiB, 100) for c in StorageClass}
    assert (
        keep[StorageClass.DEEP_ARCHIVE] < keep[StorageClass.GLACIER] < keep[StorageClass.STANDARD]
    )
    bulk = costs.price_restore(StorageClass.DEEP_ARCHIVE, 1000 * GiB, 100, tier=RestoreTier.BULK)
    fast = costs.price_restore(
        StorageClass.DEEP_ARCHIVE, 1000 * GiB, 100, tier=RestoreTier.STANDARD
    )
    assert bulk.total_usd < fast.total_usd


def test_a_backup_is_priced_by_its_objects_and_parts() -> None:
    one = costs.price_backup(10 * GiB, StorageClass.DEEP_ARCHIVE)
    ten = costs.price_backup(100 * GiB, StorageClass.DEEP_ARCHIVE)
    assert ten.objects > one.objects
    assert ten.parts > one.parts
    assert ten.requests_usd > one.requests_usd
    assert ten.orchestration_usd > one.orchestration_usd


def test_the_modeled_1_tib_case_adds_up() -> None:
    forecast = costs.target_forecast()
    assert forecast.fulls_per_month == pytest.approx(52 / 12, rel=0.05)
    assert forecast.incrementals_per_month == pytest.approx(365 / 12 - 52 / 12, rel=0.05)
    parts = [forecast.requests_usd, forecast.orchestration_usd, forecast.lambda_usd]
    assert forecast.overhead_usd == pytest.approx(sum(parts) + forecast.staging_usd)
    assert forecast.overhead_ratio == pytest.approx(forecast.overhead_usd / forecast.storage_usd)
    # Keeping 7 dailies in a class billed for 180 days costs early deletions: reported.
    assert forecast.early_deletion_usd > 0
    # Larger objects cut the per-object overhead (requests, transitions), not the storage.
    bigger = costs.target_forecast(part_size=256 * 2**20, object_size=8 * GiB)
    assert bigger.overhead_usd < forecast.overhead_usd / 3
    assert bigger.storage_usd == pytest.approx(forecast.storage_usd, rel=0.01)


def test_a_forecast_over_budget_alerts_with_the_fix() -> None:
    policy = parse_policy(
        "version: 1\nclusters:\n  big:\n    engine: sqlite\n    schedule: {full: '0 1 * * *'}\n"
        "    vault: {storage_class: GLACIER_IR, object_lock: {days: 7}}\n"
        "    retention: {keep_daily: 30}\n    budget_usd_per_month: 1\n"
    )
    forecast = costs.monthly_forecast(policy.cluster("big"), 500 * GiB, 0.05)
    alert = costs.budget_alert("big", forecast)
    assert alert is not None
    assert "over its budget of $1.00" in alert
    assert "Fix:" in alert
    roomy = forecast.model_copy(update={"budget_usd": 10_000.0})
    assert costs.budget_alert("big", roomy) is None


def test_cost_command_prints_the_modeled_case(capsys: pytest.CaptureFixture[str]) -> None:
    cli.console.width = 120
    assert cli.main(["cost", "--target"]) == 0
    out = capsys.readouterr().out
    forecast = costs.target_forecast()
    assert f"{forecast.storage_usd:,.2f}" in out
    assert f"{forecast.overhead_usd:,.2f}" in out
    assert f"{forecast.overhead_ratio:.2%}" in out


def test_cost_command_names_a_bad_policy(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "p.yaml"
    bad.write_text("version: 1\nclusters: {a: {engine: mysql}}\n")
    assert cli.main(["cost", "--policy", str(bad)]) == 2
    out = capsys.readouterr().out
    assert "PolicyError" in out
    assert "clusters.a.engine" in out
