"""``shardvault cost``: the forecast's figures as a person reads them, the budget verdict (exit 1
when over), a bad policy named with its field path (exit 2), and the catalog's spend."""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest
from rich.console import Console

from shardvault.client import cli
from shardvault.client import operations as ops
from shardvault.client.commands import cost as cost_command
from shardvault.contracts.catalog import ArchiveTotals, BackupItem
from shardvault.lifecycle import costs

POLICY = """
version: 1
clusters:
  {name}:
    engine: sqlite
    schedule: {{full: "0 1 * * *"}}
    vault: {{storage_class: GLACIER_IR, object_lock: {{days: 7}}}}
    retention: {{keep_daily: 30}}
    budget_usd_per_month: {budget}
"""


@pytest.fixture
def screen(monkeypatch: pytest.MonkeyPatch) -> Console:
    """What the command prints, as plain text (wide: no figure wraps)."""
    console = Console(width=160, record=True, file=io.StringIO())
    monkeypatch.setattr(cost_command, "console", console)
    monkeypatch.setattr(cli, "errors", console)
    monkeypatch.delenv("SHARDVAULT_CATALOG_TABLE", raising=False)
    return console


def policy_file(tmp_path: Path, name: str = "big", budget: float = 1) -> Path:
    path = tmp_path / "shardvault.yaml"
    path.write_text(POLICY.format(name=name, budget=budget))
    return path


def with_catalog(
    monkeypatch: pytest.MonkeyPatch,
    records: list[dict],
    archive: dict | None = None,
    asked: list[str] | None = None,
) -> None:
    """A catalog for ``cost``: these backup records and WAL archive counters (None: the
    cluster never archived); ``asked`` collects the clusters listed."""
    items = [BackupItem.model_validate(record) for record in records]
    totals = None
    if archive is not None:
        totals = ArchiveTotals.model_validate({"cluster": "big", "backup_id": "#archive"} | archive)

    def list_backups(config: object, cluster: str) -> list[BackupItem]:
        if asked is not None:
            asked.append(cluster)
        return items

    monkeypatch.setattr(ops, "list_backups", list_backups)
    monkeypatch.setattr(ops, "archive_totals", lambda config, c: totals)
    monkeypatch.setenv("SHARDVAULT_STATE_MACHINE_ARN", "arn:sm")
    monkeypatch.setenv("SHARDVAULT_CATALOG_TABLE", "catalog")


def cells(text: str) -> dict[str, list[str]]:
    """A printed table's rows: first cell -> the other cells."""
    rows = (line.split("│")[1:-1] for line in text.splitlines() if line.startswith("│"))
    return {row[0].strip(): [c.strip() for c in row[1:]] for row in rows}


def test_target_prints_the_modeled_1_tib_case(screen: Console) -> None:
    assert cli.main(["cost", "--target"]) == 0
    table = cells(screen.export_text())
    f = costs.target_forecast()
    assert table["storage (policy class DEEP_ARCHIVE)"] == [f"${f.storage_usd:,.2f}"]
    assert table["of which held beyond retention (paid minimum)"] == [f"${f.held_usd:,.2f}"]
    assert table["of which early-deletion charges"] == [f"${f.early_deletion_usd:,.2f}"]
    assert table["S3 requests (upload, verify, promote)"] == [f"${f.requests_usd:,.2f}"]
    assert table["Step Functions and DynamoDB"] == [f"${f.orchestration_usd:,.2f}"]
    assert table["Lambda"] == [f"${f.lambda_usd:,.2f}"]
    assert table["idle agents (doorbell polls, inbox reads, heartbeats)"] == [
        f"${f.agents_usd:,.2f}"
    ]
    assert table["request overhead: S3, orchestration, Lambda, idle agents"] == [
        f"${f.request_overhead_usd:,.2f}"
    ]
    assert table["request overhead (idle agents included) / storage"] == [
        f"{f.request_overhead_ratio:.2%} (target: at most 1%)"
    ]
    assert table["early-deletion charges / storage"] == [
        f"{f.early_deletion_share:.2%} (target: at most 5%)"
    ]
    assert table["backups landed per class (by lifetime)"] == ["DEEP_ARCHIVE 30.50"]
    assert table["objects made"] == [f"{f.objects_per_month:,.0f}"]
    assert table["budget"] == ["none set"]
    # The figures themselves (a change to the model or the prices shows here): the $22.27 of
    # early-deletion charges (55%) became storage held until DEEP_ARCHIVE's 180 days.
    assert f.storage_usd == pytest.approx(39.83, abs=0.01)
    assert f.held_usd == pytest.approx(21.69, abs=0.01)
    assert f.early_deletion_usd == pytest.approx(0.13, abs=0.01)
    assert f.agents_usd == pytest.approx(0.048, abs=0.001)
    assert f.request_overhead_usd == pytest.approx(0.39, abs=0.01)
    assert f.request_overhead_ratio == pytest.approx(0.0098, abs=0.0001)
    assert f.total_usd == pytest.approx(40.58, abs=0.01)


def test_the_deployments_own_month_is_printed_apart_from_every_cluster(screen: Console) -> None:
    """Keys, alarms, metrics and the dashboard cost whether or not anything is backed up; they
    are shared, so they are in no cluster's forecast (nor its budget), but they are shown, and
    each cluster adds its backup-age metric and alarm."""
    assert cli.main(["cost"]) == 0  # the example policy: two clusters
    one, two = costs.deployment_month(1), costs.deployment_month(2)
    assert one.total_usd == pytest.approx(
        costs.DEPLOYMENT_KMS_KEYS * 1.00
        + (costs.DEPLOYMENT_ALARM_METRICS + 1) * 0.10
        + (costs.DEPLOYMENT_CUSTOM_METRICS + 1) * 0.30
        + 3.00
        + one.watch_usd
    )
    assert two.total_usd - one.total_usd == pytest.approx(0.10 + 0.30)
    assert one.watch_usd < 0.10  # 2,880 short runs and PutMetricData calls
    text = " ".join(screen.export_text().split())
    assert f"the deployment itself (shared by its 2 cluster(s)): ${two.total_usd:,.2f} a month" in (
        text
    )


def test_a_cluster_over_budget_is_flagged_and_exits_1(screen: Console, tmp_path: Path) -> None:
    path = policy_file(tmp_path, budget=1)
    assert cli.main(["cost", "--policy", str(path), "--data-gib", "500"]) == 1
    text = screen.export_text()
    assert "big: 500 GiB, 5% a day" in text
    assert cells(text)["budget"][0].startswith("$1.00: over by $")
    assert "cluster big is forecast at $" in text
    assert "over its budget of $1.00" in text


def test_a_cluster_within_budget_exits_0(screen: Console, tmp_path: Path) -> None:
    path = policy_file(tmp_path, budget=10_000)
    assert cli.main(["cost", "--policy", str(path), "--data-gib", "500"]) == 0
    budget = cells(screen.export_text())["budget"][0]
    assert budget.startswith("$10,000.00: $")
    assert budget.endswith("to spare")


def test_a_bad_policy_is_named_by_field_and_refused(screen: Console, tmp_path: Path) -> None:
    bad = tmp_path / "p.yaml"
    bad.write_text("version: 1\nclusters: {a: {engine: mysql}}\n")
    assert cli.main(["cost", "--policy", str(bad)]) == cli.REFUSED
    text = screen.export_text()
    assert "PolicyError" in text
    engines = "'sqlite', 'postgres', 'mariadb', 'rocksdb' or 'hooks'"
    assert f"clusters.a.engine: Input should be {engines}, got 'mysql'" in text
    assert "clusters.a.vault: Field required. Fix: add vault" in text


@pytest.mark.parametrize(
    ("args", "error", "says"),
    [
        (["--policy", "missing.yaml"], "PolicyError", "missing.yaml cannot be read"),
        (["--cluster", "billing"], "PolicyError", "no cluster 'billing'"),
        (["--data-gib", "0"], "CostError", "0 bytes of data"),
        (["--daily-change", "2"], "CostError", "daily change of 2.0"),
    ],
)
def test_bad_arguments_are_named_and_refused(
    screen: Console, args: list[str], error: str, says: str
) -> None:
    assert cli.main(["cost", *args]) == cli.REFUSED
    text = screen.export_text()
    assert f"{error}: " in text
    assert says in text
    assert "Fix: " in text


def test_the_catalogs_spend_by_cluster_and_class(
    screen: Console, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gib = 2**30
    records = [
        {"cluster": "big", "backup_id": "a", "completed_at": 1, "status": "COMPLETE",
         "location": "vault", "storage_class": "GLACIER_IR", "bytes": 100 * gib, "objects": 400},
        {"cluster": "big", "backup_id": "b", "completed_at": 2, "status": "COMPLETE",
         "location": "vault", "storage_class": "GLACIER_IR", "bytes": 100 * gib, "objects": 400},
        {"cluster": "big", "backup_id": "c", "completed_at": 3, "status": "COMPLETE",
         "bytes": 10 * gib, "objects": 40},
        {"cluster": "big", "backup_id": "d", "status": "EXPIRED", "location": "vault",
         "storage_class": "GLACIER_IR", "bytes": 100 * gib, "objects": 400},
        {"cluster": "big", "backup_id": "e", "status": "FAILED", "bytes": 100 * gib},
    ]  # fmt: skip
    asked: list[str] = []
    with_catalog(monkeypatch, records, asked=asked)
    path = policy_file(tmp_path, budget=10_000)
    assert cli.main(["cost", "--policy", str(path), "--cluster", "big"]) == 0
    assert asked == ["big"]
    spend = [line for line in screen.export_text().splitlines() if line.startswith("│ ")]
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in spend]
    # Two complete backups of 100 GiB in GLACIER_IR at $0.004/GB; 10 GiB staged at $0.023.
    assert ["big", "GLACIER_IR", "2", "200.0", "$0.80"] in rows
    assert ["big", "STANDARD", "1", "10.0", "$0.23"] in rows
    assert ["total", "", "", "", "$1.03"] in rows


def test_with_a_catalog_the_forecast_uses_the_measured_sizes(
    screen: Console, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The newest full's stored bytes and the median incremental (as a share of its chain's
    full), not the defaults: what the cluster's backups really store."""
    gib = 2**30
    day = 86_400

    def backup(backup_id, at, size, parent=None):
        kind = {"kind": "incremental", "parent_id": parent} if parent else {}
        return {"cluster": "big", "backup_id": backup_id, "completed_at": at * day,
                "status": "COMPLETE", "stored_bytes": size, "bytes": 4 * size, **kind}  # fmt: skip

    records = [
        backup("old-full", 0, 50 * gib),
        backup("full", 7, 80 * gib),
        backup("i1", 8, 2 * gib, "full"),
        backup("i2", 9, 4 * gib, "i1"),
        backup("i3", 10, 40 * gib, "i2"),  # an outlier: the median ignores it
        backup("orphan", 11, 70 * gib, "gone"),  # its chain left the catalog: not measured
        {"cluster": "big", "backup_id": "f", "status": "FAILED", "bytes": 900 * gib},
    ]
    with_catalog(monkeypatch, records)
    path = policy_file(tmp_path, budget=10_000)

    assert cli.main(["cost", "--policy", str(path), "--cluster", "big"]) == 0

    text = screen.export_text()
    assert "full 80.00 GiB stored (measured)" in text
    assert "incrementals 5.00% of it (median of 3" in text
    from shardvault.config.policy import load_policy

    expected = costs.monthly_forecast(load_policy(path).cluster("big"), 80 * gib, 0.05)
    forecast = cells(text.split("Kept now")[0])  # the forecast, not the spend table
    assert forecast["total"] == [f"${expected.total_usd:,.2f}"]
    # Asked sizes win over measured ones.
    screen.file = io.StringIO()
    assert cli.main(["cost", "--policy", str(path), "--cluster", "big", "--data-gib", "10"]) == 0
    assert "(measured)" not in screen.export_text()


def test_a_clusters_wal_archive_is_priced_from_its_measured_growth(
    screen: Console, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = time.time()
    totals = {"first_at": now - 10 * 86_400, "stored_bytes": 20 * 2**30, "batches": 14_400}
    with_catalog(monkeypatch, [], archive=totals)
    path = policy_file(tmp_path, budget=10_000)

    assert cli.main(["cost", "--policy", str(path), "--cluster", "big"]) == 0

    text = screen.export_text()
    assert "WAL archive 2.00 GiB a day (measured)" in text
    forecast = cells(text.split("Kept now")[0])
    (row,) = [label for label in forecast if label.startswith("WAL archive at STANDARD")]
    growth = costs.WalGrowth(2 * 2**30, 1440)
    from shardvault.config.policy import load_policy

    cluster = load_policy(path).cluster("big")
    expected = costs.monthly_forecast(cluster, 10 * 2**30, 0.05, wal=growth)
    assert forecast[row] == [f"${expected.wal_storage_usd:,.2f}"]
    assert expected.wal_storage_usd > 0
