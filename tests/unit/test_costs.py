"""The cost model (``shardvault.lifecycle.costs``) against the price table and the reference's
worked figures (``shared/reference/aws-facts.md``, 1 TB = 1,024 GB): storage per class and month,
requests counted per PUT and COPY, restores by tier, early-deletion charges, a year of a
policy averaged into a month, the issue's 1% target and the budget alert."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from shardvault.config.policy import load_policy, parse_policy
from shardvault.contracts.catalog import ArchiveTotals
from shardvault.lifecycle import costs
from shardvault.lifecycle.costs import CostError, Landing
from shardvault.lifecycle.promote import COPY_CONFIG
from shardvault.pricing.prices import DAYS_PER_MONTH, RestoreTier, StorageClass

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40
ROOT = Path(__file__).parents[2]
DEEP_TIB_MONTH = 0.00099 * 1024  # DEEP_ARCHIVE, $ per TiB-month


# --- Storage -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("storage_class", "per_tib"),
    [
        (StorageClass.STANDARD, 23.55),
        (StorageClass.STANDARD_IA, 12.80),
        (StorageClass.GLACIER_IR, 4.10),
        (StorageClass.GLACIER, 3.69),
        (StorageClass.DEEP_ARCHIVE, 1.01),
    ],
)
def test_a_month_of_storage_is_the_class_rate_times_the_bytes(
    storage_class: StorageClass, per_tib: float
) -> None:
    assert costs.monthly_storage_cost(storage_class, TiB, 1) == pytest.approx(per_tib, abs=0.01)
    # Proportional to the bytes: each further TiB adds the same.
    one, two, five = (costs.monthly_storage_cost(storage_class, n * TiB, 1) for n in (1, 2, 5))
    assert two - one == pytest.approx((five - one) / 4)
    assert five == pytest.approx(5 * one, rel=1e-6)


def test_small_objects_are_billed_at_the_class_minimum_size() -> None:
    # 1,000 objects of 1 KiB in STANDARD_IA are billed as 1,000 x 128 KiB.
    billed = costs.monthly_storage_cost(StorageClass.STANDARD_IA, 1000 * KiB, 1000)
    assert billed == pytest.approx(1000 * 128 * KiB / GiB * 0.0125)


def test_each_archived_object_adds_40_kib_of_metadata() -> None:
    # 32 KiB at the archive rate and 8 KiB at STANDARD, per object, even when empty.
    empty = costs.monthly_storage_cost(StorageClass.DEEP_ARCHIVE, 0, 1000)
    assert empty == pytest.approx(1000 * (32 * KiB * 0.00099 + 8 * KiB * 0.023) / GiB)


def test_early_deletion_bills_the_rest_of_the_minimum_duration() -> None:
    month = costs.monthly_storage_cost(StorageClass.DEEP_ARCHIVE, TiB, 1)
    at_30_days = costs.early_deletion_charge(StorageClass.DEEP_ARCHIVE, TiB, 1, 30)
    assert at_30_days == pytest.approx(month * 150 / DAYS_PER_MONTH, rel=1e-4)
    assert costs.early_deletion_charge(StorageClass.DEEP_ARCHIVE, TiB, 1, 180) == 0
    assert costs.early_deletion_charge(StorageClass.GLACIER_IR, TiB, 1, 89) > 0
    assert costs.early_deletion_charge(StorageClass.STANDARD, TiB, 1, 0) == 0


# --- Requests ----------------------------------------------------------------------------------
PUT_STANDARD, GET_STANDARD = 0.005 / 1000, 0.0004 / 1000


def test_requests_are_counted_per_put_and_copy() -> None:
    # 10 GiB in 256 MiB objects of 8 MiB parts: 40 objects, 1,280 parts, landed in GLACIER.
    cost = costs.price_backup(
        10 * GiB, StorageClass.GLACIER, part_size=8 * MiB, object_size=256 * MiB
    )
    assert (cost.objects, cost.parts) == (40, 1280)
    upload = (1280 + 2 * 40) * PUT_STANDARD  # UploadPart, Create and Complete at STANDARD
    verify = 40 * GET_STANDARD  # GetObjectAttributes of each uploaded object
    copy = 40 * 0.03 / 1000  # one CopyObject per object, at GLACIER's PUT price
    # Promotion also asks the vault twice per object (already there? the copy's checksum),
    # s3transfer heads the source, and the staging copy is tagged for expiry.
    promote = 40 * (2 * 0.0004 / 1000 + GET_STANDARD + PUT_STANDARD)
    assert cost.requests_usd == pytest.approx(upload + verify + copy + promote)
    assert cost.requests == 1280 + 2 * 40 + 40 + 40 + 4 * 40


def test_objects_of_5_gib_or_more_are_copied_in_parts_as_promote_does() -> None:
    assert COPY_CONFIG.multipart_threshold == costs.COPY_THRESHOLD
    assert COPY_CONFIG.multipart_chunksize == costs.COPY_PART_SIZE
    # Two 8 GiB objects: create + 2 UploadPartCopy of 5 GiB and 3 GiB + complete, each.
    big = costs.price_backup(16 * GiB, StorageClass.GLACIER, part_size=256 * MiB)
    small = costs.price_backup(
        16 * GiB, StorageClass.GLACIER, part_size=256 * MiB, object_size=4 * GiB
    )
    assert (big.objects, small.objects) == (2, 4)
    assert big.requests - (big.parts + 3 * big.objects + 4 * big.objects) == 2 * 4
    assert small.requests - (small.parts + 3 * small.objects + 4 * small.objects) == 4 * 1


def test_landing_by_transition_or_directly_prices_its_own_requests() -> None:
    sizes = {"part_size": 8 * MiB, "object_size": 256 * MiB}
    moved = costs.price_backup(GiB, StorageClass.DEEP_ARCHIVE, landing=Landing.TRANSITION, **sizes)
    assert moved.requests_usd == pytest.approx(
        (32 * 4 + 2 * 4) * PUT_STANDARD + 4 * GET_STANDARD + 4 * 0.05 / 1000
    )
    direct = costs.price_backup(GiB, StorageClass.DEEP_ARCHIVE, landing=Landing.DIRECT, **sizes)
    assert direct.requests_usd == pytest.approx((32 * 4 + 2 * 4) * 0.05 / 1000 + 4 * 0.0004 / 1000)
    assert direct.staging_usd == 0  # nothing waits at STANDARD


def test_staged_copies_are_billed_until_promotion_deletes_them() -> None:
    promote_source = (ROOT / "shardvault" / "lifecycle" / "promote.py").read_text()
    assert "remove_staging_copy(svc, staging_keys)" in promote_source
    cost = costs.price_backup(TiB, StorageClass.DEEP_ARCHIVE)
    hours = costs.PROMOTION_HOURS
    assert cost.staging_usd == pytest.approx(23.55 * hours / (24 * DAYS_PER_MONTH), rel=1e-3)
    # Left to the 1-day lifecycle backstop (36 hours on average) it would cost 18 times more.
    kept = costs.price_backup(TiB, StorageClass.DEEP_ARCHIVE, staging_hours=36)
    assert kept.staging_usd == pytest.approx(cost.staging_usd * 36 / hours)


def test_orchestration_is_counted_per_object_and_per_backup() -> None:
    one = costs.price_backup(GiB, StorageClass.DEEP_ARCHIVE, object_size=256 * MiB)
    two = costs.price_backup(2 * GiB, StorageClass.DEEP_ARCHIVE, object_size=256 * MiB)
    per_object = (two.orchestration_usd - one.orchestration_usd) / 4
    # Each object's commands ring the agent's doorbell: send, receive, delete.
    rings = costs.COMMANDS_PER_OBJECT * costs.SQS_REQUESTS_PER_COMMAND * 0.40e-6
    assert per_object == pytest.approx(
        costs.TRANSITIONS_PER_OBJECT * 0.025 / 1000
        + costs.DYNAMODB_WRITES_PER_OBJECT * 0.625e-6
        + rings
    )
    assert two.lambda_usd > one.lambda_usd


def _longest_path(states: dict, start: str) -> int:
    """The most states one run through ``states`` enters from ``start`` (Next, Default and
    Choices; the graph has no loops)."""
    state = states[start]
    after = [c["Next"] for c in state.get("Choices", [])]
    after += [state[key] for key in ("Next", "Default") if key in state]
    return 1 + max((_longest_path(states, n) for n in after), default=0)


def test_the_per_object_transitions_cover_the_upload_maps_item_path() -> None:
    """An object's item starts a child execution and ends it (2 transitions) and enters every
    state on its way: the constant the forecast prices must not fall behind the workflow."""
    asl = json.loads((ROOT / "statemachines" / "backup.asl.json").read_text())
    items = asl["States"]["Upload"]["ItemProcessor"]
    assert 2 + _longest_path(items["States"], items["StartAt"]) <= costs.TRANSITIONS_PER_OBJECT


def _read_path(branch: dict) -> int:
    """The states a branch enters when every choice takes its default (a read full's path:
    no synthesis)."""
    entered, name = 0, branch["StartAt"]
    while name:
        state = branch["States"][name]
        entered += 1
        name = state.get("Default") or state.get("Next")
    return entered


def test_the_per_backup_transitions_are_a_two_node_fulls_path() -> None:
    """A full of two nodes: every state it enters from Accept to Succeeded (the Upload map
    twice, Release beside Finalize, one promotion copy), and in each of the four per-node
    Maps a child per node that starts, runs its task and ends."""
    states = json.loads((ROOT / "statemachines" / "backup.asl.json").read_text())["States"]
    choices = {"FlushApart": "Flush", "ScanApart": "PlanData", "DataPacked": "HasObjects"}
    choices |= {"HasObjects": "Upload", "ToVault": "Promote", "MoreToCopy": "Succeeded"}
    after_upload = iter(["CheckUploads", "ReleaseAndFinalize"])
    entered, name = 0, "Accept"
    while states[name]["Type"] != "Succeed":
        entered += 1 + sum(_read_path(b) for b in states[name].get("Branches", []))
        if name == "AfterUpload":
            name = next(after_upload)
        else:
            name = choices.get(name) or states[name]["Next"]
    node_maps = ["Flush", "Checkpoint", "Stop", "Release"]
    assert entered + 1 + len(node_maps) * 2 * 3 == costs.TRANSITIONS_PER_BACKUP


# --- Restores ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("storage_class", "tier", "usd"),
    [
        # The reference: 1 TB from Deep Archive, about $2.6 (Bulk) or $20.9 (Standard).
        (StorageClass.DEEP_ARCHIVE, RestoreTier.BULK, 1024 * 0.0025 + 4096 * 0.025 / 1000),
        (StorageClass.DEEP_ARCHIVE, RestoreTier.STANDARD, 1024 * 0.02 + 4096 * 0.10 / 1000),
        (StorageClass.GLACIER, RestoreTier.EXPEDITED, 1024 * 0.03 + 4096 * 10 / 1000),
        (StorageClass.GLACIER, RestoreTier.STANDARD, 1024 * 0.01 + 4096 * 0.05 / 1000),
        (StorageClass.GLACIER, RestoreTier.BULK, 0.0),
    ],
)
def test_a_restore_is_priced_by_its_tier(
    storage_class: StorageClass, tier: RestoreTier, usd: float
) -> None:
    cost = costs.price_restore(storage_class, TiB, 4096, tier=tier, keep_days=0)
    gets = 4096 * 0.0004 / 1000
    assert cost.total_usd == pytest.approx(usd + gets)
    assert cost.restored_copy_usd == 0


def test_the_restored_copy_is_billed_at_standard_while_it_is_kept() -> None:
    cost = costs.price_restore(StorageClass.DEEP_ARCHIVE, TiB, 4096, keep_days=7)
    assert cost.restored_copy_usd == pytest.approx(23.55 * 7 / DAYS_PER_MONTH, rel=1e-3)
    assert cost.ready_within_hours == 48  # Bulk, the default


def test_instant_classes_are_read_without_a_restore() -> None:
    cost = costs.price_restore(StorageClass.GLACIER_IR, TiB, 4096, tier=RestoreTier.EXPEDITED)
    assert cost.tier is None
    assert cost.retrieval_usd == pytest.approx(1024 * 0.03)


def test_a_tier_the_class_lacks_is_refused_by_name() -> None:
    with pytest.raises(CostError, match="DEEP_ARCHIVE has no EXPEDITED") as raised:
        costs.price_restore(StorageClass.DEEP_ARCHIVE, TiB, 1, tier=RestoreTier.EXPEDITED)
    assert "STANDARD, BULK" in raised.value.fix


# --- A month of a policy -----------------------------------------------------------------------
def cluster(
    schedule: str,
    retention: str,
    storage_class: str = "DEEP_ARCHIVE",
    extra: str = "",
    *,
    vault: str = "",
):
    """``vault``: more fields of the vault, e.g. ", delete_before_paid_minimum: true"."""
    policy = parse_policy(
        "version: 1\nclusters:\n  c:\n    engine: postgres\n"
        f"    schedule: {schedule}\n"
        f"    vault: {{storage_class: {storage_class}, object_lock: {{days: 7}}{vault}}}\n"
        f"    retention: {retention}\n{extra}"
    )
    return policy.cluster("c")


def prompt(policy):
    """The cluster with holds off: deletion when retention expires, as before holds."""
    vault = policy.vault.model_copy(update={"delete_before_paid_minimum": True})
    return policy.model_copy(update={"vault": vault})


def test_the_issues_target_request_overhead_is_at_most_1_percent_of_storage() -> None:
    """Every recurring control-plane cost counted, the idle agent of the one node included."""
    forecast = costs.target_forecast()
    print(f"\n{forecast.summary()}")
    assert forecast.agents_usd == costs.agents_monthly_cost(1) > 0
    assert forecast.request_overhead_usd == pytest.approx(
        forecast.requests_usd
        + forecast.orchestration_usd
        + forecast.lambda_usd
        + forecast.agents_usd
    )
    assert forecast.request_overhead_ratio == pytest.approx(
        forecast.request_overhead_usd / forecast.storage_usd
    )
    assert forecast.request_overhead_ratio <= 0.01
    assert forecast.meets_overhead_target
    # Counted once in the total.
    assert forecast.total_usd == pytest.approx(
        forecast.storage_usd + forecast.request_overhead_usd + forecast.staging_usd
    )


def test_the_idle_agents_cost_their_doorbell_polls_inbox_reads_and_heartbeats() -> None:
    # A month of 2,629,800 s: 87,660 long polls (20 s each, and a 10 s pause) at $0.40 per
    # million, 58,440 strongly consistent reads (one in 45 s) at $0.125 per million and 8,766
    # writes at $0.625 per million.
    per_node = 87_660 * 0.40e-6 + 58_440 * 0.125e-6 + 8_766 * 0.625e-6
    assert costs.agents_monthly_cost(1) == pytest.approx(per_node, rel=1e-6)
    assert costs.agents_monthly_cost(1) <= 0.05  # the issue's bound for an idle agent
    assert costs.agents_monthly_cost(3) == pytest.approx(3 * per_node, rel=1e-6)
    # A tighter cadence costs more: polls are the bulk.
    assert costs.agents_monthly_cost(1, listen_pause_seconds=0) > 1.3 * per_node


def test_the_cost_model_uses_the_agents_own_idle_defaults() -> None:
    from shardvault_agent.config import AgentConfig

    fields = AgentConfig.model_fields
    assert fields["doorbell_wait_seconds"].default == costs.AGENT_DOORBELL_WAIT_SECONDS
    assert fields["idle_listen_pause_seconds"].default == costs.AGENT_LISTEN_PAUSE_SECONDS
    assert fields["idle_inbox_poll_seconds"].default == costs.AGENT_INBOX_READ_SECONDS
    assert fields["idle_heartbeat_seconds"].default == costs.AGENT_HEARTBEAT_SECONDS


def test_the_target_cases_early_deletion_falls_from_55_percent_to_at_most_5() -> None:
    """All in DEEP_ARCHIVE, as before; deleting dailies and weeklies when retention expired
    them cost $22.27 of $40.28 in early-deletion charges (55%). Held until their 180 days,
    that money buys storage they keep; what is left is incrementals deleted with their full."""
    before = costs.monthly_forecast(prompt(costs.TARGET_CLUSTER), TiB, 0.05)
    after = costs.target_forecast()
    print(f"\nbefore: {before.summary()}\nafter: {after.summary()}")
    assert before.early_deletion_usd == pytest.approx(22.27, abs=0.01)
    assert before.storage_usd == pytest.approx(40.28, abs=0.01)
    assert before.early_deletion_share == pytest.approx(0.553, abs=0.001)
    assert after.early_deletion_share <= costs.EARLY_DELETION_TARGET
    assert after.meets_early_deletion_target
    assert not before.meets_early_deletion_target
    assert after.held_usd > 20  # the charge became storage held beyond retention
    assert after.total_usd <= before.total_usd
    assert after.landed_per_month == {StorageClass.DEEP_ARCHIVE: pytest.approx(30.5, abs=0.1)}


def test_the_modeled_1_tib_case_adds_up() -> None:
    forecast = costs.target_forecast()
    assert forecast.fulls_per_month == pytest.approx(52 / 12, rel=0.02)
    assert forecast.incrementals_per_month == pytest.approx((365 - 52) / 12, rel=0.02)
    # Seven dailies, four weeklies and twelve monthly chains of a 1 TiB full and 51 GiB
    # incrementals, each kept at least the 180 days DEEP_ARCHIVE bills: some 39 TiB, at $1.01
    # a TiB-month.
    assert 35 * TiB < forecast.stored_bytes < 42 * TiB
    kept = forecast.storage_usd - forecast.early_deletion_usd
    assert kept == pytest.approx(forecast.stored_bytes / TiB * DEEP_TIB_MONTH, rel=0.01)
    # The archive sizes cut the request overhead, not the storage: the general sizes (8 MiB
    # parts and 256 MiB objects for each incremental) cost ten times as much in requests.
    general = costs.target_forecast(part_size=8 * MiB, object_size=256 * MiB)
    without_agents = forecast.request_overhead_usd - forecast.agents_usd
    assert without_agents < (general.request_overhead_usd - general.agents_usd) / 10
    assert general.storage_usd == pytest.approx(forecast.storage_usd, rel=0.01)


def test_deep_archive_charges_early_deletion_when_retention_is_shorter_than_180_days() -> None:
    # Weekly fulls kept four weeks, deleted then: each is some 150 days short of its minimum.
    weekly, four = '{full: "0 2 * * 0"}', "{keep_weekly: 4}"
    short = costs.monthly_forecast(prompt(cluster(weekly, four)), TiB, 0.05)
    owed = DEEP_TIB_MONTH * (180 - 28) / DAYS_PER_MONTH  # deleted at 28 days of 180
    assert short.early_deletion_usd == pytest.approx(short.fulls_per_month * owed, rel=0.01)
    # Monthly fulls kept a year outlive the minimum: no charge, nothing held.
    long = costs.monthly_forecast(cluster('{full: "0 2 1 * *"}', "{keep_monthly: 12}"), TiB, 0.05)
    assert long.early_deletion_usd == 0
    assert long.held_usd == 0
    # GLACIER_IR bills 90 days: weeklies kept four weeks are charged there too.
    instant = costs.monthly_forecast(prompt(cluster(weekly, four, "GLACIER_IR")), TiB, 0.05)
    assert instant.early_deletion_usd > 0


def test_held_weeklies_pay_their_minimum_as_storage_not_as_a_charge() -> None:
    weekly, four = '{full: "0 2 * * 0"}', "{keep_weekly: 4}"
    held = costs.monthly_forecast(cluster(weekly, four), TiB, 0.05)
    deleted = costs.monthly_forecast(prompt(cluster(weekly, four)), TiB, 0.05)
    assert held.early_deletion_usd == 0
    # Each full held 152 days past its 28: the charge it would have paid.
    assert held.held_usd == pytest.approx(deleted.early_deletion_usd, rel=0.02)
    assert held.storage_usd == pytest.approx(deleted.storage_usd, rel=0.02)
    assert held.stored_bytes > 5 * deleted.stored_bytes  # 180 days kept, not 28


def test_the_policy_that_asks_for_prompt_deletion_is_forecast_with_its_charges() -> None:
    weekly, four = '{full: "0 2 * * 0"}', "{keep_weekly: 4}"
    erasing = cluster(weekly, four, vault=", delete_before_paid_minimum: true")
    forecast = costs.monthly_forecast(erasing, TiB, 0.05)
    assert forecast.held_usd == 0
    assert forecast.early_deletion_share > 0.5


def test_a_forecast_prices_small_short_lived_backups_in_the_class_their_life_suits() -> None:
    # 1 MiB fulls kept a week (7-day lock): DEEP_ARCHIVE's $0.05 per thousand PUTs outweigh
    # the storage of 180 days, so they land in STANDARD_IA; forced, they stay.
    daily, seven = '{full: "0 2 * * *"}', "{keep_daily: 7}"
    moved = costs.monthly_forecast(cluster(daily, seven), MiB, 0.05)
    assert set(moved.landed_per_month) == {StorageClass.STANDARD_IA}
    forced = cluster(daily, seven, vault=", class_by_lifetime: false")
    kept = costs.monthly_forecast(forced, MiB, 0.05)
    assert set(kept.landed_per_month) == {StorageClass.DEEP_ARCHIVE}
    assert moved.storage_usd + moved.requests_usd < kept.storage_usd + kept.requests_usd
    # 1 TiB of the same stays in DEEP_ARCHIVE: its minimum paid, still the cheapest.
    big = costs.monthly_forecast(cluster(daily, seven), TiB, 0.05)
    assert set(big.landed_per_month) == {StorageClass.DEEP_ARCHIVE}


def test_the_policys_part_size_cuts_the_forecasts_objects() -> None:
    schedule, retention = '{full: "0 2 * * *"}', "{keep_daily: 7}"
    knob = "    upload: {part_size_mib: 64}\n"
    # 100 GiB in STANDARD_IA: 400 objects of 256 MiB by default, 50 of 2 GiB with 64 MiB parts;
    # in DEEP_ARCHIVE, 7 of 16 GiB by default, and the knob still rules.
    for storage_class, objects in (("STANDARD_IA", 400), ("DEEP_ARCHIVE", 7)):
        chosen = costs.monthly_forecast(
            cluster(schedule, retention, storage_class), 100 * GiB, 0.05
        )
        given = costs.monthly_forecast(
            cluster(schedule, retention, storage_class, extra=knob), 100 * GiB, 0.05
        )
        assert chosen.objects_per_month == pytest.approx(objects * 365.25 / 12, rel=0.01)
        assert given.objects_per_month == pytest.approx(50 * 365.25 / 12, rel=0.01)


@pytest.mark.parametrize(
    ("data_bytes", "daily_change", "says"),
    [(0, 0.05, "0 bytes of data"), (TiB, -0.1, "-0.1"), (TiB, 1.5, "1.5")],
)
def test_a_forecast_of_nonsense_is_refused_with_the_fix(
    data_bytes: int, daily_change: float, says: str
) -> None:
    with pytest.raises(CostError, match=re.escape(says)) as raised:
        costs.monthly_forecast(costs.TARGET_CLUSTER, data_bytes, daily_change)
    assert "--" in raised.value.fix  # names the CLI option to change


# --- The budget --------------------------------------------------------------------------------
def test_a_forecast_over_budget_alerts_with_the_figures_and_the_fix() -> None:
    big = cluster(
        '{full: "0 1 * * *"}', "{keep_daily: 30}", "GLACIER_IR", "    budget_usd_per_month: 1\n"
    )
    forecast = costs.monthly_forecast(big, 500 * GiB, 0.05)
    alert = costs.budget_alert("big", forecast)
    assert alert is not None
    assert f"cluster big is forecast at ${forecast.total_usd:.2f}/month" in alert
    assert "over its budget of $1.00" in alert
    assert "Fix: shorten retention, choose a cheaper class, or raise budget_usd_per_month" in alert


@pytest.mark.parametrize("room", [None, 0.0, 1.0], ids=["no-budget", "exactly", "under"])
def test_no_alert_within_budget_or_without_one(room: float | None) -> None:
    forecast = costs.target_forecast()
    budget = None if room is None else forecast.total_usd + room
    assert costs.budget_alert("c", forecast.model_copy(update={"budget_usd": budget})) is None


def test_the_wal_archive_costs_its_window_at_standard_and_its_requests() -> None:
    policy = load_policy(Path(__file__).parents[2] / "examples" / "shardvault.yaml")
    name = sorted(policy.clusters)[0]
    cluster = policy.clusters[name]
    growth = costs.WalGrowth(stored_bytes_per_day=GiB, batches_per_day=1440)
    without = costs.monthly_forecast(cluster, 100 * GiB, 0.05)
    archived = costs.monthly_forecast(cluster, 100 * GiB, 0.05, wal=growth)
    assert without.wal_usd == 0
    assert archived.total_usd == pytest.approx(without.total_usd + archived.wal_usd)
    windowed = cluster.model_copy(
        update={"archive": cluster.archive.model_copy(update={"window_days": 7.0})}
    )
    week = costs.monthly_forecast(windowed, 100 * GiB, 0.05, wal=growth)
    days = 7 + cluster.schedule.longest_gap_hours() / 24
    assert week.wal_bytes == pytest.approx(days * GiB)
    assert week.wal_storage_usd == pytest.approx(days * 0.023)
    assert archived.wal_bytes > week.wal_bytes  # back to the oldest kept backup by default
    # 1,440 batches a day: two PUTs and a check each, three function calls, three writes.
    # $1.0e-5 of PUTs, 4e-7 a check, 6e-7 + 2e-6 the function, 1.9e-6 the items: 1.49e-5.
    assert week.wal_requests_usd == pytest.approx(1440 * costs.DAYS_PER_MONTH * 1.4875e-5, rel=0.01)
    two_days = ArchiveTotals(cluster="c", backup_id="#archive", first_at=0, stored_bytes=2 * GiB)
    assert costs.measured_wal(two_days, 2 * 86400)
    hour = ArchiveTotals(cluster="c", backup_id="#archive", first_at=0, stored_bytes=1, batches=1)
    assert costs.measured_wal(hour, 3600) is None


def test_weekly_drills_read_the_data_back_from_the_class_backups_land_in() -> None:
    """A drill's restore is priced as a restore: a Standard thaw of an archived backup of the
    data's size, its requests and thawed copy; a drill-less cluster pays nothing for them."""
    schedule, retention = "{full: '0 2 * * *'}", "{keep_daily: 7}"
    drill = "    drill: {cron: '0 10 * * 3', target_cluster: c-drill}\n"
    plain = costs.monthly_forecast(cluster(schedule, retention), 100 * GiB, 0.05)
    drilled = costs.monthly_forecast(cluster(schedule, retention, extra=drill), 100 * GiB, 0.05)
    assert (plain.drills_per_month, plain.drill_usd) == (0.0, 0.0)
    assert drilled.drills_per_month == pytest.approx(52 / 12, rel=0.03)
    (landed,) = drilled.landed_per_month  # every daily lands in one class
    objects = costs.price_backup(100 * GiB, landed).objects
    one = costs.price_restore(landed, 100 * GiB, objects, tier=RestoreTier.STANDARD, keep_days=2)
    assert drilled.drill_usd == pytest.approx(drilled.drills_per_month * one.total_usd)
    assert drilled.total_usd == pytest.approx(plain.total_usd + drilled.drill_usd)
    assert drilled.request_overhead_usd == pytest.approx(plain.request_overhead_usd)


def test_scheduled_cuts_cost_their_runs_of_the_cut_state_machine() -> None:
    """Every five minutes on three nodes: 8,640 runs a month of 15 transitions, 5 Lambda calls,
    10 item writes and 6 SQS requests each, about $3.40; none without ``every_minutes``."""
    schedule, retention = "{full: '0 2 * * *'}", "{keep_daily: 7}"
    cut = "    cut: {every_minutes: 5}\n"
    plain = costs.monthly_forecast(cluster(schedule, retention), 100 * GiB, 0.05, nodes=3)
    cut_ = costs.monthly_forecast(cluster(schedule, retention, extra=cut), 100 * GiB, 0.05, nodes=3)
    assert (plain.cuts_per_month, plain.cut_usd) == (0.0, 0.0)
    assert cut_.cuts_per_month == pytest.approx(12 * 24 * DAYS_PER_MONTH, rel=0.01)
    one = 15 * 0.025e-3 + 5 * (0.2e-6 + 0.05 * 0.0000133334) + 10 * 0.625e-6 + 6 * 0.4e-6
    assert cut_.cut_usd == pytest.approx(cut_.cuts_per_month * one)
    assert 3.0 < cut_.cut_usd < 4.0
    assert cut_.total_usd == pytest.approx(plain.total_usd + cut_.cut_usd)
    assert "scheduled cuts $" in cut_.summary()


def test_a_cluster_that_lists_its_nodes_is_forecast():
    """Issue 44 (1): a policy with a ``nodes:`` list (not hashable) broke the forecast's cache,
    and with it the daily retention run of every cluster."""
    listed = parse_policy(
        "version: 1\nclusters:\n  fa:\n    engine: sqlite\n    nodes: [fa-node-1, fa-node-2]\n"
        '    schedule: {full: "0 2 * * 0"}\n'
        "    vault: {storage_class: GLACIER_IR, object_lock: {mode: GOVERNANCE, days: 1}}\n"
        "    retention: {keep_daily: 7}\n"
    ).cluster("fa")
    first = costs.monthly_forecast(listed, 10 * 2**30, 0.01)
    again = costs.monthly_forecast(listed, 10 * 2**30, 0.01)  # from the cache
    assert first.storage_usd > 0
    assert again == first


# --- vault copies --------------------------------------------------------------------------------
def with_copy(storage_class: str, days: int, select: str = "all"):
    copy = (
        f", copies: [{{name: offsite, kind: gcs, project: p, bucket: acme-b, "
        f"storage_class: {storage_class}, retention: {{days: {days}}}, select: {select}}}]"
    )
    return cluster('{full: "0 2 * * 0", incremental: "0 2 * * 1-6"}', "{keep_daily: 7}", vault=copy)


def test_a_copy_is_priced_in_its_class_for_its_longest_stay_and_its_egress() -> None:
    """ARCHIVE bills 365 days of every copy whatever the stack vault keeps; each byte leaves
    AWS once, at the internet egress price."""
    data = 100 * 1024**3
    forecast = costs.monthly_forecast(with_copy("ARCHIVE", 30), data, 0.01)
    copy = forecast.copies_usd["offsite"]

    assert copy.backups_per_month == pytest.approx(
        forecast.fulls_per_month + forecast.incrementals_per_month
    )
    # A year of each month's copies (the bytes that left AWS), at ARCHIVE's rate.
    monthly_gb = copy.egress_usd / 0.09
    assert monthly_gb > 0
    assert copy.storage_usd == pytest.approx(monthly_gb * 365 / DAYS_PER_MONTH * 0.0012, rel=1e-6)
    assert forecast.total_usd == pytest.approx(
        forecast.storage_usd
        + forecast.overhead_usd
        + forecast.wal_usd
        + forecast.drill_usd
        + copy.total_usd
    )
    assert "copy offsite: $" in forecast.summary()


def test_a_copy_that_takes_fulls_or_weekly_pays_less_egress() -> None:
    data = 100 * 1024**3
    every = costs.monthly_forecast(with_copy("NEARLINE", 30), data, 0.05).copies_usd["offsite"]
    fulls = costs.monthly_forecast(with_copy("NEARLINE", 30, "fulls"), data, 0.05)
    weekly = costs.monthly_forecast(with_copy("NEARLINE", 30, "weekly"), data, 0.05)

    taken = fulls.copies_usd["offsite"]
    assert taken.backups_per_month == pytest.approx(fulls.fulls_per_month)
    assert taken.egress_usd < every.egress_usd
    # One full a week already: weekly takes the same ones.
    assert weekly.copies_usd["offsite"].backups_per_month == pytest.approx(taken.backups_per_month)


def test_an_account_b_copy_is_priced_at_s3s_class_with_no_transfer_in_one_region() -> None:
    """An aws copy: S3's DEEP_ARCHIVE for the longest of its stay, lock and 180-day minimum,
    a write per object, and nothing for the bytes between two accounts of one region."""
    copy = (
        ", copies: [{name: b, kind: aws, account: '222233334444', bucket: vault-b, "
        "region: eu-west-1, role_arn: 'arn:aws:iam::222233334444:role/w', external_id: x1, "
        "kms_key: 'arn:aws:kms:eu-west-1:222233334444:key/k1', storage_class: DEEP_ARCHIVE, "
        "object_lock: {days: 30}, select: fulls}]"
    )
    entry = cluster('{full: "0 2 * * 0"}', "{keep_daily: 7}", vault=copy)

    def priced_from(region: str) -> costs.CopyMonth:
        forecast = costs.monthly_forecast(entry, 100 * 1024**3, 0.01, stack_region=region)
        return forecast.copies_usd["b"]

    same, across = priced_from("eu-west-1"), priced_from("us-east-1")

    assert same.storage_class == "DEEP_ARCHIVE"
    assert same.egress_usd == 0
    assert same.storage_usd == pytest.approx(same.stored_bytes / 1024**3 * 0.00099)
    assert same.requests_usd > 0
    # From another region, each byte crosses once at the inter-region rate.
    monthly_gb = same.stored_bytes / 1024**3 * DAYS_PER_MONTH / 180  # 180 days kept
    assert across.egress_usd == pytest.approx(monthly_gb * 0.02, rel=0.05)
    assert across.storage_usd == same.storage_usd


def test_synthesized_fulls_pay_for_the_chain_the_store_keeps() -> None:
    """A full on Sundays, 5 % a day: the kept chain is a full and 0 to 6 incrementals of 5 %,
    at STANDARD; a policy that reads every full keeps none."""
    read = costs.TARGET_CLUSTER
    incremental = read.incremental.model_copy(update={"synthesized_fulls": 3})
    synthesized = read.model_copy(update={"incremental": incremental})

    kept = costs.monthly_forecast(synthesized, TiB, 0.05)
    plain = costs.monthly_forecast(read, TiB, 0.05)

    assert plain.kept_chain_usd == 0
    assert TiB * 1.0 < kept.kept_chain_bytes < TiB * 1.3  # a full and 3 days of 5 % on average
    assert kept.kept_chain_usd == pytest.approx(kept.kept_chain_bytes / 2**30 * 0.023, rel=0.01)
    assert kept.total_usd - plain.total_usd == pytest.approx(kept.kept_chain_usd, rel=1e-6)
    assert "chain kept for synthesized fulls" in kept.summary()
