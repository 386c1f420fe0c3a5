"""The policy file: the shipped files load as written, and every invalid field is named by its
field path with a fix, all of them at once; files that are not policies are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardvault.config.policy import LockMode, PolicyError, load_policy, parse_policy
from shardvault.pricing.prices import StorageClass

EXAMPLE = Path(__file__).parents[2] / "examples" / "shardvault.yaml"
LOCAL = Path(__file__).parents[2] / "shardvault" / "local" / "policy.yaml"
VALID = {
    "engine": "postgres",
    "schedule": '{timezone: Europe/Paris, full: "0 2 * * 0", incremental: "0 2 * * 1-6"}',
    "vault": "{storage_class: DEEP_ARCHIVE, object_lock: {mode: GOVERNANCE, days: 30}}",
    "retention": "{keep_daily: 7, keep_weekly: 4}",
}


def policy_with(**fields: str | None) -> str:
    """A policy of one cluster, ``orders``, with ``fields`` replaced (None: left out)."""
    body = {**VALID, **fields}
    lines = [f"    {key}: {value}" for key, value in body.items() if value is not None]
    return "version: 1\nclusters:\n  orders:\n" + "\n".join(lines) + "\n"


def test_the_example_loads_as_written() -> None:
    policy = load_policy(EXAMPLE)
    assert sorted(policy.clusters) == ["orders", "sessions"]
    orders, sessions = policy.cluster("orders"), policy.cluster("sessions")
    assert orders.schedule.timezone == "Europe/Paris"
    assert orders.schedule.incremental == "0 2 * * 1-6"
    assert orders.vault.storage_class == StorageClass.DEEP_ARCHIVE
    assert orders.retention.keep_yearly == 2
    assert orders.budget_usd_per_month == 60
    # What the example leaves out takes the documented defaults.
    assert sessions.schedule.timezone == "UTC"
    assert sessions.schedule.incremental is None
    assert sessions.vault.object_lock.mode == LockMode.COMPLIANCE
    assert sessions.upload.part_size_mib is None
    assert sessions.upload.parallelism is None  # the agent's own
    assert sessions.budget_usd_per_month is None


def test_the_local_stacks_policy_loads() -> None:
    assert load_policy(LOCAL).clusters


BAD_FIELDS = [
    # (the cluster's fields replaced, the field path, in the message, in the fix)
    ({"engine": "mysql"}, "engine", "'mysql'", "'postgres'"),
    ({"schedule": '{full: "0 2 * *"}'}, "schedule.full", "has 4 fields", "minute hour"),
    ({"schedule": '{full: "61 2 * * 0"}'}, "schedule.full", "out of range", "minute hour"),
    ({"schedule": '{full: "0 2 30 2 *"}'}, "schedule.full", "never fires", "a day that exists"),
    ({"schedule": "{full: 5}"}, "schedule.full", "valid string", "quote it"),
    (
        {"schedule": '{full: "0 2 * * 0", incremental: "0 2 * * 8"}'},
        "schedule.incremental",
        "out of range",
        "day-of-week",
    ),
    (
        {"schedule": '{full: "0 2 1-7 * 1"}'},
        "schedule.full",
        "restricts both the day of month and the day of week",
        "restrict only one of the two",
    ),
    (
        {"schedule": '{full: "0 2 * * 0", incremental: "0 3 1 * 1-5"}'},
        "schedule.incremental",
        "cron runs it when either matches",
        "'0 2 1 * *' for the 1st of each month",
    ),
    (
        {"schedule": '{timezone: Mars/Olympus, full: "0 2 * * 0"}'},
        "schedule.timezone",
        "'Mars/Olympus' is not a known time zone",
        "IANA time zone name",
    ),
    ({"schedule": "{timezone: UTC}"}, "schedule.full", "Field required", "add full"),
    (
        {"vault": "{storage_class: TAPE, object_lock: {days: 3}}"},
        "vault.storage_class",
        "'TAPE' is not a vault storage class",
        "use one of STANDARD_IA, GLACIER_IR, GLACIER, DEEP_ARCHIVE",
    ),
    (
        {"vault": "{storage_class: STANDARD, object_lock: {days: 3}}"},
        "vault.storage_class",
        "'STANDARD' is not a vault storage class",
        "STANDARD is where backups are staged",
    ),
    (
        {"vault": "{storage_class: deep_archive, object_lock: {days: 3}}"},
        "vault.storage_class",
        "'deep_archive'",
        "write it in capitals: DEEP_ARCHIVE",
    ),
    (
        {"vault": "{storage_class: GLACIER, object_lock: {days: 0}}"},
        "vault.object_lock.days",
        "got 0",
        "at least 1",
    ),
    (
        {"vault": "{storage_class: GLACIER, object_lock: {days: -3}}"},
        "vault.object_lock.days",
        "got -3",
        "at least 1",
    ),
    (
        {"vault": "{storage_class: GLACIER, object_lock: {days: '30'}}"},
        "vault.object_lock.days",
        "got '30'",
        "without quotes",
    ),
    (
        {"vault": "{storage_class: GLACIER, object_lock: {mode: STRICT, days: 3}}"},
        "vault.object_lock.mode",
        "'STRICT'",
        "'COMPLIANCE'",
    ),
    (
        {"vault": "{storage_class: GLACIER}"},
        "vault.object_lock",
        "Field required",
        "add object_lock",
    ),
    ({"vault": None}, "vault", "Field required", "add vault"),
    ({"retention": "{keep_daily: -1}"}, "retention.keep_daily", "got -1", "at least 0"),
    ({"retention": "{keep_weekly: 2.5}"}, "retention.keep_weekly", "got 2.5", "a whole one"),
    ({"retention": "{keep_monthly: '3'}"}, "retention.keep_monthly", "got '3'", "without quotes"),
    (
        {"retention": "{keep_daily: 0}"},
        "retention",
        "every keep count is 0",
        "set at least one of keep_daily",
    ),
    (
        {"retention": "{keep_daily: 7, keep_wekly: 3}"},
        "retention.keep_wekly",
        "unknown field",
        "did you mean keep_weekly?",
    ),
    ({"shedule": "{}"}, "shedule", "unknown field", "did you mean schedule?"),
    ({"upload": "{part_size_mib: 4}"}, "upload.part_size_mib", "4 MiB", "use 5 to 5120 MiB"),
    (
        {"upload": "{part_size_mib: 5121}"},
        "upload.part_size_mib",
        "5121 MiB",
        "use 5 to 5120 MiB",
    ),
    ({"upload": "{parallelism: 0}"}, "upload.parallelism", "got 0", "at least 1"),
    (
        {"upload": "{rate_limit_mib_per_second: 0}"},
        "upload.rate_limit_mib_per_second",
        "got 0",
        "more than 0",
    ),
    ({"budget_usd_per_month": "-5"}, "budget_usd_per_month", "got -5", "more than 0"),
]


@pytest.mark.parametrize(
    ("fields", "path", "says", "fix"), BAD_FIELDS, ids=[f"{p}:{s}" for _, p, s, _ in BAD_FIELDS]
)
def test_an_invalid_field_is_named_with_a_fix(
    fields: dict[str, str | None], path: str, says: str, fix: str
) -> None:
    with pytest.raises(PolicyError) as raised:
        parse_policy(policy_with(**fields))
    (problem,) = raised.value.problems
    assert problem.path == f"clusters.orders.{path}"
    assert says in problem.message
    assert fix in problem.fix
    # The message a person reads names the field, what is wrong and the fix, on one line.
    line = next(x for x in str(raised.value.message).splitlines() if problem.path in x)
    assert says in line
    assert f"Fix: {problem.fix}" in line


def test_every_problem_is_reported_at_once() -> None:
    text = policy_with(
        engine="mysql",
        schedule='{timezone: Mars/Olympus, full: "0 2 * *"}',
        retention="{keep_daily: -1}",
        upload="{parallelism: 0, part_size_mib: 4}",
    ) + ("  sessions:\n    engine: sqlite\n    schedule: {full: '0 3 * * *'}\n")
    with pytest.raises(PolicyError) as raised:
        parse_policy(text)
    paths = {p.path for p in raised.value.problems}
    assert paths == {
        "clusters.orders.engine",
        "clusters.orders.schedule.timezone",
        "clusters.orders.schedule.full",
        "clusters.orders.retention.keep_daily",
        "clusters.orders.upload.parallelism",
        "clusters.orders.upload.part_size_mib",
        "clusters.sessions.vault",
        "clusters.sessions.retention",
    }
    assert "has 8 invalid field(s)" in raised.value.message


@pytest.mark.parametrize(
    ("text", "says", "fix"),
    [
        ("", "holds no mapping of fields", "start the file with 'clusters:'"),
        ("# nothing but a comment\n", "holds no mapping of fields", "examples/shardvault.yaml"),
        ("- orders\n", "holds no mapping of fields", "start the file with 'clusters:'"),
        ("version: 1\nclusters: {orders: [\n", "not valid YAML at line 3", "correct the YAML"),
        ("clusters: {}\nclusters: {}\n", "duplicate key 'clusters'", "correct the YAML"),
        ("version: 1\nclusters: {}\n", "clusters: Dictionary should have at least 1", "entry"),
        ("version: 2\nclusters: {}\n", "version: Input should be 1", "use one of 1"),
        ("versoin: 1\nclusters: {}\n", "versoin: unknown field", "did you mean version?"),
        ("clusters:\n  Orders Fleet: {}\n", "clusters.Orders Fleet (the name)", "a-z, 0-9"),
    ],
    ids=[
        "empty",
        "comment-only",
        "a-list",
        "yaml-syntax",
        "duplicate-key",
        "no-clusters",
        "version",
        "top-level-typo",
        "bad-cluster-name",
    ],
)
def test_files_that_are_not_policies_are_refused(text: str, says: str, fix: str) -> None:
    with pytest.raises(PolicyError) as raised:
        parse_policy(text, source="shardvault.yaml")
    assert "shardvault.yaml" in raised.value.message
    assert says in raised.value.message
    assert fix in raised.value.message + raised.value.fix


def test_a_missing_file_names_the_path_and_the_example(tmp_path: Path) -> None:
    with pytest.raises(PolicyError) as raised:
        load_policy(tmp_path / "nope.yaml")
    assert f"{tmp_path / 'nope.yaml'} cannot be read: No such file or directory" in str(
        raised.value.message
    )
    assert "examples/shardvault.yaml" in raised.value.fix


def test_an_unknown_cluster_is_refused_by_name() -> None:
    policy = parse_policy(policy_with())
    with pytest.raises(PolicyError, match="no cluster 'billing'") as raised:
        policy.cluster("billing")
    assert "orders" in raised.value.fix


# --- vault copies (shardvault/config/targets.py) ----------------------------------------------
def with_copies(*copies: str, encryption: str = "none") -> str:
    vault = (
        "{storage_class: DEEP_ARCHIVE, object_lock: {mode: GOVERNANCE, days: 30}, copies: ["
        + ", ".join(copies)
        + "]}"
    )
    return policy_with(vault=vault, encryption=encryption)


def gcs(**fields: str) -> str:
    body = {
        "name": "offsite",
        "kind": "gcs",
        "project": "acme",
        "bucket": "acme-backups",
        "storage_class": "ARCHIVE",
        "retention": "{days: 30}",
        **fields,
    }
    return "{" + ", ".join(f"{k}: {v}" for k, v in body.items() if v) + "}"


B_KEY = "arn:aws:kms:eu-west-1:222233334444:key/1234abcd-12ab-34cd-56ef-1234567890ab"
B_RECOVERY = "arn:aws:kms:us-east-1:222233334444:key/0d4e7b52-8c1f-4e3a-9b6d-5f2a1c8e7d34"


def aws(**fields: str) -> str:
    body = {
        "name": "air-gapped",
        "kind": "aws",
        "account": "'222233334444'",
        "bucket": "acme-vault-b",
        "region": "eu-west-1",
        "role_arn": "arn:aws:iam::222233334444:role/shardvault-vault-writer",
        "external_id": "acme-7f3",
        "kms_key": B_KEY,
        "storage_class": "DEEP_ARCHIVE",
        "object_lock": "{days: 30}",
        **fields,
    }
    return "{" + ", ".join(f"{k}: {v}" for k, v in body.items() if v) + "}"


def test_an_aws_copy_loads_locked_in_compliance_beside_a_gcs_one() -> None:
    gcs_copy, aws_copy = parse_policy(with_copies(gcs(), aws())).cluster("orders").vault.copies
    assert (gcs_copy.kind, aws_copy.kind) == ("gcs", "aws")
    assert (aws_copy.object_lock.mode, aws_copy.held_days) == ("COMPLIANCE", 30)
    assert (aws_copy.storage_class, aws_copy.prefix) == ("DEEP_ARCHIVE", "shardvault")


def test_a_gcs_copy_loads_with_its_defaults() -> None:
    (copy,) = parse_policy(with_copies(gcs())).cluster("orders").vault.copies
    assert (copy.name, copy.storage_class, copy.prefix) == ("offsite", "ARCHIVE", "shardvault")
    assert (copy.retention.style, copy.retention.days, copy.select) == ("object", 30, "all")
    assert copy.workload_identity is None


BAD_COPIES = [
    # (the copies, the cluster's encryption, the field path, in the message, in the fix)
    ([gcs(retention="")], "none", "vault.copies.0.retention", "Field required", "add retention"),
    (
        [gcs(storage_class="DEEP_ARCHIVE")],
        "none",
        "vault.copies.0.storage_class",
        "not a storage class GCS has",
        "GCS's nearest is ARCHIVE",
    ),
    (
        [gcs(storage_class="nearline")],
        "none",
        "vault.copies.0.storage_class",
        "'nearline'",
        "capitals: NEARLINE",
    ),
    (
        [gcs(retention="{days: 7}")],
        "none",
        "vault",
        "retains for 7 days, less than the stack vault's lock of 30",
        "at least 30",
    ),
    ([gcs(), gcs()], "none", "vault", "named 'offsite'", "its own name"),
    ([gcs(name="stack")], "none", "vault", "named 'stack'", "its own name"),
    (
        [gcs(retention="{style: bucket, days: 30}")],
        "none",
        "vault.copies.0",
        "bucket's retention policy and selects all",
        "select: fulls",
    ),
    ([gcs()], "kms", "", "only the stack account's KMS key unwraps", "stack_key_only: true"),
    ([gcs(kind="azure")], "none", "vault.copies.0.kind", "'azure'", "'gcs'"),
    ([gcs(name="Off_Site")], "none", "vault.copies.0.name", "lowercase", "gcs-archive"),
    (
        [aws(object_lock="{mode: GOVERNANCE, days: 30}")],
        "none",
        "vault.copies.0.object_lock.mode",
        "GOVERNANCE",
        "set mode: COMPLIANCE",
    ),
    (
        [aws(object_lock="{days: 7}")],
        "none",
        "vault",
        "retains for 7 days, less than the stack vault's lock of 30",
        "object_lock.days to at least 30",
    ),
    (
        [aws(role_arn="arn:aws:iam::111122223333:role/vault-writer")],
        "none",
        "vault.copies.0",
        "role_arn is in account 111122223333, not 222233334444",
        "a role in the source account",
    ),
    (
        [aws(kms_key=B_KEY.replace("eu-west-1", "us-east-1"))],
        "none",
        "vault.copies.0",
        "kms_key is in account 222233334444, region us-east-1",
        "the bucket's region",
    ),
    (
        [aws(storage_class="ARCHIVE")],
        "none",
        "vault.copies.0.storage_class",
        "'ARCHIVE'",
        "DEEP_ARCHIVE",
    ),
    ([aws(account="'2222'")], "none", "vault.copies.0.account", "12-digit", "222233334444"),
    ([aws(account="222233334444")], "none", "vault.copies.0.account", "string", "quote it"),
    ([aws()], "kms", "", "only the stack account's KMS key unwraps", "as its recovery_key"),
    (
        [aws(recovery_key=B_KEY.replace("222233334444", "111122223333"))],
        "kms",
        "vault.copies.0",
        "recovery_key is in account 111122223333, not 222233334444",
        "a key account B owns",
    ),
    (
        [aws(recovery_key=B_RECOVERY, stack_key_only="true")],
        "kms",
        "vault.copies.0",
        "a recovery_key and stack_key_only: true",
        "drop stack_key_only",
    ),
    (
        [aws(recovery_key=B_RECOVERY)],
        "none",
        "",
        "not sealed (encryption: none)",
        "drop recovery_key",
    ),
    ([aws(recovery_key=B_KEY)], "kms", "vault.copies.0", "recovery_key is its kms_key", "its own"),
    ([aws(recovery_key="key-1")], "kms", "vault.copies.0.recovery_key", "KMS key's ARN", "arn:"),
    (
        [gcs(workload_identity="{audience: pool}")],
        "none",
        "vault.copies.0.workload_identity.audience",
        "not a workload identity provider's audience",
        "//iam.googleapis.com/projects/",
    ),
]


@pytest.mark.parametrize(
    ("copies", "encryption", "path", "says", "fix"),
    BAD_COPIES,
    ids=[f"{p}:{s[:30]}" for _, _, p, s, _ in BAD_COPIES],
)
def test_a_bad_vault_copy_is_refused_by_name_with_a_fix(
    copies: list[str], encryption: str, path: str, says: str, fix: str
) -> None:
    with pytest.raises(PolicyError) as raised:
        parse_policy(with_copies(*copies, encryption=encryption))
    (problem,) = raised.value.problems
    assert problem.path == "clusters.orders" + (f".{path}" if path else "")
    assert says in problem.message
    assert fix in problem.fix


def test_an_encrypted_clusters_copy_may_accept_the_stack_key_by_name() -> None:
    policy = parse_policy(with_copies(gcs(stack_key_only="true"), encryption="kms"))
    assert policy.cluster("orders").vault.copies[0].stack_key_only


def test_an_encrypted_clusters_aws_copy_takes_a_recovery_key_in_account_b() -> None:
    policy = parse_policy(with_copies(aws(recovery_key=B_RECOVERY), encryption="kms"))
    assert policy.cluster("orders").vault.copies[0].recovery_key == B_RECOVERY
