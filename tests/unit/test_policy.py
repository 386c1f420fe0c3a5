"""The policy file: the example loads, and every invalid field is named by its path with a fix,
all of them at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardvault.policy import PolicyError, load_policy, parse_policy

EXAMPLE = Path(__file__).parents[2] / "examples" / "shardvault.yaml"
LOCAL = Path(__file__).parents[2] / "shardvault" / "local" / "policy.yaml"
VALID = {
    "engine": "postgres",
    "schedule": '{timezone: Europe/Paris, full: "0 2 * * 0", incremental: "0 2 * * 1-6"}',
    "vault": "{storage_class: DEEP_ARCHIVE, object_lock: {mode: GOVERNANCE, days: 30}}",
    "retention": "{keep_daily: 7, keep_weekly: 4}",
}


def policy_with(**fields: str) -> str:
    body = {**VALID, **fields}
    lines = [f"    {key}: {value}" for key, value in body.items() if value is not None]
    return "version: 1\nclusters:\n  orders:\n" + "\n".join(lines) + "\n"


@pytest.mark.parametrize("path", [EXAMPLE, LOCAL], ids=["example", "local"])
def test_shipped_policies_load(path: Path) -> None:
    policy = load_policy(path)
    assert policy.clusters


@pytest.mark.parametrize(
    ("fields", "path", "says", "fix"),
    [
        ({"engine": "mysql"}, "clusters.orders.engine", "mysql", "postgres"),
        (
            {"schedule": '{full: "0 2 * *"}'},
            "clusters.orders.schedule.full",
            "five fields",
            "minute hour",
        ),
        (
            {"schedule": '{timezone: Mars/Olympus, full: "0 2 * * 0"}'},
            "clusters.orders.schedule.timezone",
            "Mars/Olympus",
            "IANA",
        ),
        (
            {"vault": "{storage_class: STANDARD, object_lock: {days: 3}}"},
            "clusters.orders.vault.storage_class",
            "STANDARD",
            "DEEP_ARCHIVE",
        ),
        (
            {"vault": "{storage_class: GLACIER, object_lock: {days: 0}}"},
            "clusters.orders.vault.object_lock.days",
            "0",
            "at least 1",
        ),
        (
            {"vault": "{storage_class: GLACIER, object_lock: {mode: STRICT, days: 3}}"},
            "clusters.orders.vault.object_lock.mode",
            "STRICT",
            "COMPLIANCE",
        ),
        (
            {"retention": "{keep_daily: -1}"},
            "clusters.orders.retention.keep_daily",
            "-1",
            "at least 0",
        ),
        (
            {"retention": "{keep_wekly: 3}"},
            "clusters.orders.retention.keep_wekly",
            "Extra",
            "keep_weekly",
        ),
        (
            {"upload": "{part_size_mib: 4}"},
            "clusters.orders.upload.part_size_mib",
            "4 MiB",
            "5 to 5120",
        ),
        (
            {"budget_usd_per_month": "-5"},
            "clusters.orders.budget_usd_per_month",
            "-5",
            "",
        ),
    ],
)
def test_an_invalid_field_is_named_with_a_fix(fields, path, says, fix) -> None:
    with pytest.raises(PolicyError) as raised:
        parse_policy(policy_with(**fields))
    (problem,) = raised.value.problems
    assert problem.path == path
    assert says in problem.message
    assert fix in problem.fix
    assert path in raised.value.message  # the message a person reads names it too


def test_every_problem_is_reported_at_once() -> None:
    text = policy_with(engine="mysql", retention="{keep_daily: -1}", upload="{parallelism: 0}")
    with pytest.raises(PolicyError) as raised:
        parse_policy(text)
    paths = {p.path for p in raised.value.problems}
    assert paths == {
        "clusters.orders.engine",
        "clusters.orders.retention.keep_daily",
        "clusters.orders.upload.parallelism",
    }


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "no mapping"),
        ("version: 1\nclusters: {orders: [\n", "not valid YAML"),
        ("version: 1\nclusters: {}\n", "clusters"),
        ("version: 2\nclusters: {a: {}}\n", "version"),
    ],
)
def test_files_that_are_not_policies_are_refused(text: str, says: str) -> None:
    with pytest.raises(PolicyError) as raised:
        parse_policy(text)
    assert says in str(raised.value)


def test_a_missing_file_names_the_path_and_the_example(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as raised:
        load_policy(tmp_path / "nope.yaml")
    assert "nope.yaml" in raised.value.message
    assert "examples/shardvault.yaml" in raised.value.fix


def test_an_unknown_cluster_is_refused_by_name() -> None:
    policy = parse_policy(policy_with())
    with pytest.raises(PolicyError, match="no cluster 'billing'"):
        policy.cluster("billing")
