"""What backups, restores and clusters cost: a pure model over the price table (``prices``).

Terms:
- *storage cost*, *early-deletion charge*: as ``storage_costs`` defines them.
- *overhead*: what making a backup costs once, apart from keeping it: S3 requests (multipart
  upload, verification, landing in the vault), Step Functions state transitions, Lambda time,
  DynamoDB writes of the agents' commands, and the hours its objects wait at STANDARD.
- *request overhead*: every recurring control-plane cost, without the hours at STANDARD:
  requests, orchestration, Lambda, and the idle agents' doorbell polls, inbox reads and
  heartbeats (``agents_monthly_cost``). The issue's target is a request overhead of at most 1%
  of the monthly storage cost.
- *held beyond retention*: storage of backups retention has expired but holds until their
  class's minimum billed duration has passed (``retention``: *held*); billed the same whether
  deleted or not, so part of the storage cost, not an extra.
- *early-deletion share*: early-deletion charges as a part of the storage cost (the issue's
  target: at most 5%). With holds, what is left is incrementals deleted with their parent
  before their own minimum, and clusters whose policy deletes before the paid minimum.
- *landing*: how verified objects reach the vault's class. ``COPY`` (the default, what
  ``shardvault.lifecycle.promote`` does): uploaded and verified at STANDARD, then copied into the
  vault, where they are locked; the staging copy is deleted once the vault holds the backup.
  ``TRANSITION``: a lifecycle rule moves them. ``DIRECT``: uploaded into the class (every
  part at its request price, and objects are locked before they are verified).
- *forecast*: a cluster's steady-state month: its schedule and retention are simulated until
  the oldest kept backup of the first months has expired, then one year is averaged. Each
  simulated backup is priced in its lifetime class (``lifetimes.lifetime_class``, from when
  the simulation expires it) and deleted when retention's hold ends.
- *measured sizes*: what a cluster's catalog says its backups store: the newest full's stored
  bytes, and each incremental's stored bytes as a share of its chain's full (data, WAL tail
  and block map, compressed and sealed: what the bucket bills). A forecast from measured sizes
  makes each scheduled incremental the median measured share of a full, whatever the
  schedule's interval: the measured incrementals ran on that schedule (or by hand, minutes
  apart, where a per-day rate would mean nothing).

The orchestration counts below are estimates from the state machine, not measurements.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum
from functools import cache, lru_cache
from itertools import pairwise
from typing import NamedTuple

from pydantic import Field

from shardvault.config.policy import (
    BackupKind,
    ClusterPolicy,
    LockMode,
    ObjectLock,
    Retention,
    Schedule,
    Vault,
)
from shardvault.config.targets import AwsTarget, Selection, VaultCopy
from shardvault.contracts.catalog import ArchiveTotals, BackupItem, recorded_stored_bytes
from shardvault.contracts.deployment import WATCH_MINUTES
from shardvault.contracts.models import THAW_DAYS, Frozen
from shardvault.data.planning import (
    GiB,
    MiB,
    TiB,
    choose_part_size,
    object_size_for,
)
from shardvault.errors import ShardVaultError
from shardvault.lifecycle.lifetimes import LIFETIME_HORIZON, lifetime_class
from shardvault.lifecycle.retention import BackupRecord, decide, from_catalog, hold_end
from shardvault.pricing.prices import (
    ALARM_MONTH,
    ARCHIVE_CLASSES,
    AWS_EGRESS_INTERNET_GB,
    AWS_INTER_REGION_GB,
    CUSTOM_METRIC_MONTH,
    DASHBOARD_MONTH,
    DAYS_PER_MONTH,
    DYNAMODB_READ,
    DYNAMODB_WRITE,
    GB,
    GCS_EGRESS_INTERNET_GB,
    GCS_STORAGE,
    KMS_KEY_MONTH,
    LAMBDA_GB_SECOND,
    LAMBDA_REQUEST,
    PUT_METRIC_DATA_REQUEST,
    RESTORE,
    SQS_REQUEST,
    STATE_TRANSITION,
    STORAGE,
    RestoreTier,
    StorageClass,
)
from shardvault.pricing.storage_costs import early_deletion_charge, monthly_storage_cost


class Landing(StrEnum):
    COPY = "copy"
    TRANSITION = "transition"
    DIRECT = "direct"


# Per object: the Map item's child execution starts and ends, and enters PackedAtScan,
# NotSignedYet, Pack, Sign, Transfer and Complete (an object packed at the scan or the stop
# skips Pack; tests/unit/test_costs.py keeps this in step with the workflow). Per backup: the
# 27 states from Accept to Succeeded (two rounds of the Upload map, the second checked by
# Finalize, promotion in one copy), and in each of the four per-node Maps a child per node that
# starts, runs its task and ends: 51 for two nodes.
TRANSITIONS_PER_OBJECT = 8
TRANSITIONS_PER_BACKUP = 51
# Per object: two dispatches (0.1 s at 0.5 GB), sign (0.3 s at 0.5 GB), complete (0.5 s at 1 GB).
LAMBDA_INVOCATIONS_PER_OBJECT = 4
LAMBDA_GB_SECONDS_PER_OBJECT = 0.75
LAMBDA_INVOCATIONS_PER_BACKUP = 20  # validate, plans, checks, finalize, dispatches to nodes
LAMBDA_GB_SECONDS_PER_BACKUP = 10.0
# A scheduled cut (shardvault/backup/cuts.py, cut.asl.json): Accept, Plan, Aim, Cut, Record and
# the end, and per node a Map child that starts, runs CutNode and ends; Plan and Record, and a
# dispatch per node (0.1 s at 0.5 GB each); the cut's catalog item, and per node its command
# written to the inbox, answered and deleted; a doorbell ring per node (send and receive).
TRANSITIONS_PER_CUT, TRANSITIONS_PER_CUT_NODE = 6, 3
LAMBDA_GB_SECONDS_PER_CALL = 0.05
DYNAMODB_WRITES_PER_CUT, DYNAMODB_WRITES_PER_CUT_NODE = 1, 3
DYNAMODB_WRITES_PER_OBJECT = 4  # two commands written to an inbox, then deleted
DYNAMODB_WRITES_PER_BACKUP = 20  # catalog record, lock, per-node commands
# Each command dispatched to an agent rings its doorbell: the send, the agent's receive and
# its delete. Two commands per object (pack, upload); per backup, about ten per node.
SQS_REQUESTS_PER_COMMAND = 3
COMMANDS_PER_OBJECT = 2
COMMANDS_PER_BACKUP = 10
# How long an object is billed at STANDARD before it lands. COPY: promotion deletes the staging
# copy once the vault holds the backup, so for about as long as the backup takes to upload and
# promote (an estimate: a 1 TiB full at 200 MiB/s uploads in 1.5 hours). Were it left to the
# staging bucket's 1-day ExpirePromotedBackups rule (the backstop), it would be 36 hours:
# lifecycle acts at the first midnight UTC after creation + the rule's days. TRANSITION waits
# for a 0-day transition rule; DIRECT never waits.
PROMOTION_HOURS = 2.0
STAGING_HOURS = {
    Landing.COPY: PROMOTION_HOURS,
    Landing.TRANSITION: 12.0,
    Landing.DIRECT: 0.0,
}
# Promotion per object (shardvault.lifecycle.promote): GetObjectAttributes on the vault (already
# there?), s3transfer's HeadObject of the source, the copy, GetObjectAttributes of the copy, and the
# staging object's promoted tag. s3transfer copies above COPY_THRESHOLD in COPY_PART_SIZE parts
# (promote.COPY_CONFIG).
COPY_THRESHOLD = 5 * GiB
COPY_PART_SIZE = 5 * GiB
# The daily change a forecast assumes until the cluster has a measured incremental.
DEFAULT_DAILY_CHANGE = 0.05
OVERHEAD_TARGET = 0.01  # the issue's: request overhead at most 1% of the storage cost
EARLY_DELETION_TARGET = 0.05  # the issue's: early-deletion charges at most 5% of storage
# The agent's idle defaults (agents/shardvault_agent): it long-polls its node's SQS doorbell
# queue (WaitTimeSeconds=20) with a 10 s pause between two polls (one request per 30 s while
# nothing rings), reads its inbox as a safety net every 45 s (a strongly consistent
# DynamoDB read: a lost ring must not outlast the workflows' 60 s task heartbeat) and writes
# its registry heartbeat every 300 s (a DynamoDB write): $0.047 a month an agent, the
# issue's bound being $0.05.
AGENT_DOORBELL_WAIT_SECONDS = 20.0
AGENT_LISTEN_PAUSE_SECONDS = 10.0
AGENT_INBOX_READ_SECONDS = 45.0
AGENT_HEARTBEAT_SECONDS = 300.0
# What the stack holds that costs a month whether or not anything is backed up (infra/): the
# notifications topic's key, the schedules' dead-letter key, the data key; alarm metrics: two
# per state machine (backup, restore, retention, verify, probe, drill, cut), the dead letters,
# silent agents, outdated agents, stalled WAL spools and the three functions no workflow runs
# (FunctionErrors sums one metric each); custom metrics: the functions' six outcome metrics,
# silent agents, outdated agents and stalled spools; the dashboard. Each cluster of the policy
# adds its backup-age metric and alarm. tests/infra checks these against the template.
DEPLOYMENT_KMS_KEYS = 3
DEPLOYMENT_ALARM_METRICS = 21
DEPLOYMENT_CUSTOM_METRICS = 9
DEPLOYMENT_DASHBOARDS = 1
PER_CLUSTER_ALARM_METRICS = 1
PER_CLUSTER_CUSTOM_METRICS = 1
# The watch (shardvault/assurance/watch.py): a run every WATCH_MINUTES, of about a second at 512 MB,
# and one PutMetricData call.
WATCH_GB_SECONDS = 0.5
MAX_SIMULATED_BACKUPS = 20_000
NO_HOLDS = {"delete_before_paid_minimum": True}
DAY = timedelta(days=1)
YEAR = timedelta(days=12 * DAYS_PER_MONTH)


class CostError(ShardVaultError):
    """A cost was asked of something the price table cannot price."""


# --- One backup --------------------------------------------------------------------------------
class BackupCost(Frozen):
    storage_class: StorageClass
    landing: Landing
    bytes: int
    objects: int
    parts: int
    requests: int  # S3 requests
    state_transitions: int
    storage_usd_per_month: float
    requests_usd: float
    orchestration_usd: float  # Step Functions and DynamoDB
    lambda_usd: float
    staging_usd: float

    @property
    def overhead_usd(self) -> float:
        return self.requests_usd + self.orchestration_usd + self.lambda_usd + self.staging_usd


def price_backup(
    size: int,
    storage_class: StorageClass,
    *,
    part_size: int | None = None,
    object_size: int | None = None,
    landing: Landing = Landing.COPY,
    staging_hours: float | None = None,
) -> BackupCost:
    """A backup of ``size`` bytes, cut as the planner cuts it unless sizes are given; staged
    for as long as ``landing`` keeps objects at STANDARD unless ``staging_hours`` is given."""
    part_size = part_size or choose_part_size(size, storage_class)
    object_size = object_size or object_size_for(part_size)
    whole, rest = divmod(size, object_size)
    objects = max(1, whole + (rest > 0))
    parts = max(1, whole * -(-object_size // part_size) + -(-rest // part_size))
    requests, requests_usd = _requests(
        landing, storage_class, objects, parts, min(size, object_size)
    )
    transitions = TRANSITIONS_PER_BACKUP + TRANSITIONS_PER_OBJECT * objects
    writes = DYNAMODB_WRITES_PER_BACKUP + DYNAMODB_WRITES_PER_OBJECT * objects
    rings = COMMANDS_PER_BACKUP + COMMANDS_PER_OBJECT * objects
    invocations = LAMBDA_INVOCATIONS_PER_BACKUP + LAMBDA_INVOCATIONS_PER_OBJECT * objects
    gb_seconds = LAMBDA_GB_SECONDS_PER_BACKUP + LAMBDA_GB_SECONDS_PER_OBJECT * objects
    hours = STAGING_HOURS[landing] if staging_hours is None else staging_hours
    return BackupCost(
        storage_class=storage_class,
        landing=landing,
        bytes=size,
        objects=objects,
        parts=parts,
        requests=requests,
        state_transitions=transitions,
        storage_usd_per_month=monthly_storage_cost(storage_class, size, objects),
        requests_usd=requests_usd,
        orchestration_usd=transitions * STATE_TRANSITION
        + writes * DYNAMODB_WRITE
        + rings * SQS_REQUESTS_PER_COMMAND * SQS_REQUEST,
        lambda_usd=invocations * LAMBDA_REQUEST + gb_seconds * LAMBDA_GB_SECOND,
        staging_usd=monthly_storage_cost(StorageClass.STANDARD, size, objects)
        * hours
        / (24 * DAYS_PER_MONTH),
    )


def _requests(
    landing: Landing, storage_class: StorageClass, objects: int, parts: int, object_size: int
) -> tuple[int, float]:
    """The S3 requests that make a backup and land it in ``storage_class``, and their price."""
    upload = STORAGE[storage_class if landing == Landing.DIRECT else StorageClass.STANDARD]
    vault, standard = STORAGE[storage_class], STORAGE[StorageClass.STANDARD]
    # CreateMultipartUpload, UploadPart..., CompleteMultipartUpload, then GetObjectAttributes.
    writes = parts + 2 * objects
    count, usd = writes + objects, writes * upload.put + objects * upload.get
    if landing == Landing.TRANSITION:
        return count + objects, usd + objects * vault.transition
    if landing == Landing.COPY:
        copies = objects * _copy_requests(object_size)
        count += copies + 4 * objects
        usd += copies * vault.put + objects * (2 * vault.get + standard.get + standard.put)
    return count, usd


def _copy_requests(object_size: int) -> int:
    """Requests of one copy: CopyObject, or create + UploadPartCopy per part + complete."""
    if object_size < COPY_THRESHOLD:
        return 1
    return 2 + -(-object_size // COPY_PART_SIZE)


# --- A restore ---------------------------------------------------------------------------------
class RestoreCost(Frozen):
    storage_class: StorageClass
    tier: RestoreTier | None  # None: the class is read without a restore
    bytes: int
    objects: int
    keep_days: float
    retrieval_usd: float
    requests_usd: float
    restored_copy_usd: float  # the temporary copy at STANDARD, while it lives
    ready_within_hours: float

    @property
    def total_usd(self) -> float:
        return self.retrieval_usd + self.requests_usd + self.restored_copy_usd


def price_restore(
    storage_class: StorageClass,
    size: int,
    objects: int,
    *,
    tier: RestoreTier = RestoreTier.BULK,
    keep_days: float = 7.0,
) -> RestoreCost:
    """Reading a backup back: a restore per archived object (at ``tier``), kept ``keep_days``
    at STANDARD, then one GET per object. IA and GLACIER_IR are read directly (tier unused)."""
    gets = objects * STORAGE[storage_class].get
    gb = size / GB
    if storage_class not in ARCHIVE_CLASSES:
        retrieval = gb * STORAGE[storage_class].retrieval_gb
        return RestoreCost(
            storage_class=storage_class,
            tier=None,
            bytes=size,
            objects=objects,
            keep_days=0.0,
            retrieval_usd=retrieval,
            requests_usd=gets,
            restored_copy_usd=0.0,
            ready_within_hours=0.0,
        )
    prices = RESTORE.get((storage_class, tier))
    if prices is None:
        tiers = ", ".join(t for (c, t) in RESTORE if c == storage_class)
        raise CostError(f"{storage_class} has no {tier} restore tier.", fix=f"use one of {tiers}.")
    copy = monthly_storage_cost(StorageClass.STANDARD, size, objects) * keep_days
    return RestoreCost(
        storage_class=storage_class,
        tier=tier,
        bytes=size,
        objects=objects,
        keep_days=keep_days,
        retrieval_usd=gb * prices.per_gb,
        requests_usd=objects * prices.per_request + gets,
        restored_copy_usd=copy / DAYS_PER_MONTH,
        ready_within_hours=prices.ready_within_hours,
    )


class StoredPart(NamedTuple):
    """What one backup of a restored chain keeps in the store: its class, bytes and objects."""

    storage_class: StorageClass
    bytes: int
    objects: int


class RestoreOption(NamedTuple):
    """Restoring a chain at one retrieval tier (None: nothing archived, read directly)."""

    tier: RestoreTier | None
    usd: float
    ready_within_hours: float  # the thaw, before any byte moves


def stored_part(record: BackupItem) -> StoredPart:
    """A catalog record as a restore reads it: the class it is billed in (``recorded_class``:
    its vault class once promoted, else the staging bucket's STANDARD), bytes and objects."""
    return StoredPart(recorded_class(record), recorded_stored_bytes(record), record.objects or 0)


def restore_options(parts: Iterable[StoredPart]) -> list[RestoreOption]:
    """What restoring a backup (with its chain: every member is read) costs and how long
    its thaw takes, per retrieval tier every archived member offers, cheapest last."""
    parts = list(parts)
    archived = {p.storage_class for p in parts if p.storage_class in ARCHIVE_CLASSES}
    if not archived:
        usd = sum(price_restore(p.storage_class, p.bytes, p.objects).total_usd for p in parts)
        return [RestoreOption(None, usd, 0.0)]
    tiers = [t for t in RestoreTier if all((c, t) in RESTORE for c in archived)]
    return [
        RestoreOption(
            tier,
            sum(price_restore(*p, tier=tier).total_usd for p in parts),
            max(RESTORE[(c, tier)].ready_within_hours for c in archived),
        )
        for tier in tiers
    ]


def copy_restore_options(parts: Iterable[StoredPart], kind: str) -> list[RestoreOption]:
    """Restoring a chain from a copy target (``restore --from-vault NAME``), whose records give
    each part's class there. An aws copy (account B) is priced as the stack vault is, at S3's
    prices for its class: a thaw per tier for GLACIER and DEEP_ARCHIVE, no transfer within the
    region. A GCS copy reads at once in every class: its retrieval fee per GB, one read per
    object, and the bytes leaving Google for the store where the restore stages them."""
    parts = list(parts)
    if kind == "aws":
        return restore_options(
            StoredPart(StorageClass(p.storage_class), p.bytes, p.objects) for p in parts
        )
    usd = sum(
        p.bytes / GB * (GCS_STORAGE[p.storage_class].retrieval_gb + GCS_EGRESS_INTERNET_GB)
        + p.objects * GCS_STORAGE[p.storage_class].get
        for p in parts
    )
    return [RestoreOption(None, usd, 0.0)]


def stored_copy_part(record: BackupItem, name: str) -> StoredPart | None:
    """A backup as copy target ``name`` holds it (None: that target holds no copy of it)."""
    held = record.vault_copies.get(name)
    if held is None or held.state != "COPIED" or not held.storage_class:
        return None
    stored = held.bytes if held.bytes is not None else recorded_stored_bytes(record)
    return StoredPart(held.storage_class, stored, held.objects or 0)  # type: ignore[arg-type]


def agents_monthly_cost(
    nodes: int,
    *,
    doorbell_wait_seconds: float = AGENT_DOORBELL_WAIT_SECONDS,
    listen_pause_seconds: float = AGENT_LISTEN_PAUSE_SECONDS,
    inbox_read_seconds: float = AGENT_INBOX_READ_SECONDS,
    heartbeat_seconds: float = AGENT_HEARTBEAT_SECONDS,
) -> float:
    """What ``nodes`` idle agents cost a month, the one place this is modelled: each long
    poll of the doorbell queue (one per wait and pause) is an SQS request, each safety read of
    the inbox a strongly consistent read unit, each heartbeat a registry write unit
    (defaults: the agent's)."""
    seconds = DAYS_PER_MONTH * 86_400
    polls = seconds / (doorbell_wait_seconds + listen_pause_seconds) * SQS_REQUEST
    reads = seconds / inbox_read_seconds * DYNAMODB_READ
    return nodes * (polls + reads + seconds / heartbeat_seconds * DYNAMODB_WRITE)


class DeploymentMonth(Frozen):
    """What the deployment costs a month before any backup (USD), shared by its clusters."""

    clusters: int
    kms_keys: int
    alarm_metrics: int
    custom_metrics: int
    dashboards: int
    keys_usd: float
    alarms_usd: float
    metrics_usd: float
    dashboards_usd: float
    watch_usd: float

    @property
    def total_usd(self) -> float:
        return (
            self.keys_usd
            + self.alarms_usd
            + self.metrics_usd
            + self.dashboards_usd
            + self.watch_usd
        )


def deployment_month(clusters: int) -> DeploymentMonth:
    """The deployment's own month with ``clusters`` clusters in its policy: keys, alarms,
    custom metrics, the dashboard and the watch. In no cluster's forecast (nor budget)."""
    alarm_metrics = DEPLOYMENT_ALARM_METRICS + PER_CLUSTER_ALARM_METRICS * clusters
    custom_metrics = DEPLOYMENT_CUSTOM_METRICS + PER_CLUSTER_CUSTOM_METRICS * clusters
    runs = DAYS_PER_MONTH * 24 * 60 / WATCH_MINUTES
    return DeploymentMonth(
        clusters=clusters,
        kms_keys=DEPLOYMENT_KMS_KEYS,
        alarm_metrics=alarm_metrics,
        custom_metrics=custom_metrics,
        dashboards=DEPLOYMENT_DASHBOARDS,
        keys_usd=DEPLOYMENT_KMS_KEYS * KMS_KEY_MONTH,
        alarms_usd=alarm_metrics * ALARM_MONTH,
        metrics_usd=custom_metrics * CUSTOM_METRIC_MONTH,
        dashboards_usd=DEPLOYMENT_DASHBOARDS * DASHBOARD_MONTH,
        watch_usd=runs
        * (LAMBDA_REQUEST + WATCH_GB_SECONDS * LAMBDA_GB_SECOND + PUT_METRIC_DATA_REQUEST),
    )


# --- A cluster's month -------------------------------------------------------------------------
class CopyMonth(Frozen):
    """One copy target's month (USD): what it keeps, what crosses to it, what it is asked."""

    storage_class: str
    backups_per_month: float
    stored_bytes: float  # average bytes kept there
    storage_usd: float
    egress_usd: float
    requests_usd: float

    @property
    def total_usd(self) -> float:
        return self.storage_usd + self.egress_usd + self.requests_usd

    def summary(self) -> str:
        return (
            f"${self.total_usd:.2f}/month in {self.storage_class} ({self.backups_per_month:.2f} "
            f"backups a month, {self.stored_bytes / TiB:.2f} TiB kept: storage "
            f"${self.storage_usd:.2f}, egress ${self.egress_usd:.2f}, requests "
            f"${self.requests_usd:.2f})"
        )


class Forecast(Frozen):
    """A cluster's steady-state month on its policy (USD per month)."""

    storage_class: StorageClass  # the policy's
    landed_per_month: dict[StorageClass, float]  # backups a month landing in each class
    data_bytes: int
    daily_change: float
    fulls_per_month: float
    incrementals_per_month: float
    objects_per_month: float
    stored_bytes: float  # average bytes kept in the vault
    storage_usd: float  # keeping them, early-deletion charges included
    early_deletion_usd: float  # (part of storage_usd)
    held_usd: float  # held beyond retention until the paid minimum (part of storage_usd)
    requests_usd: float
    orchestration_usd: float
    lambda_usd: float
    staging_usd: float
    agents_usd: float  # idle agents' polls and heartbeats: not tied to backups, but recurring
    budget_usd: float | None
    # Continuous WAL archiving (PostgreSQL): the archive kept in the staging bucket (STANDARD)
    # over its window, and its requests (PUTs, checks, the archive function, its items).
    wal_bytes: float = 0.0  # average bytes kept
    wal_storage_usd: float = 0.0
    wal_requests_usd: float = 0.0
    # Restore drills (policy ``drill``): each reads a backup of the data's size back from the
    # class most backups land in, thawed at the Standard tier as a drill's restore asks.
    drills_per_month: float = 0.0
    drill_usd: float = 0.0
    # Scheduled cuts (policy ``cut.every_minutes``): each a run of the cut state machine, its
    # Lambda calls, inbox items and doorbells (``cut_month``). The WAL a cut makes archive (on an
    # idle server, a segment closed by archive_timeout) is in the measured archive's growth.
    cuts_per_month: float = 0.0
    cut_usd: float = 0.0
    # Vault copies (policy ``vault.copies``), by target: storage in the target's class for the
    # longer of the stack vault's stay, the copy's retention and the class's minimum; the
    # egress out of AWS; the target's write requests.
    copies_usd: dict[str, CopyMonth] = Field(default_factory=dict)
    # Synthesized fulls (policy ``incremental.synthesized_fulls``): the newest chain's staging
    # copy kept at STANDARD (its full and the incrementals since, averaged over the year).
    kept_chain_bytes: float = 0.0
    kept_chain_usd: float = 0.0

    @property
    def request_overhead_usd(self) -> float:
        """Every recurring control-plane cost: requests, orchestration, Lambda and the idle
        agents. What the issue's 1% target is about."""
        return self.requests_usd + self.orchestration_usd + self.lambda_usd + self.agents_usd

    @property
    def request_overhead_ratio(self) -> float:
        """The request overhead, idle agents included, as a part of the storage cost."""
        return self.request_overhead_usd / self.storage_usd

    @property
    def early_deletion_share(self) -> float:
        """Early-deletion charges as a part of the storage cost (which includes them)."""
        return self.early_deletion_usd / self.storage_usd

    @property
    def meets_early_deletion_target(self) -> bool:
        return self.early_deletion_share <= EARLY_DELETION_TARGET

    @property
    def meets_overhead_target(self) -> bool:
        return self.request_overhead_ratio <= OVERHEAD_TARGET

    @property
    def overhead_usd(self) -> float:
        """The request overhead (idle agents included) and the staging copies, the chain kept
        for synthesized fulls included."""
        return self.request_overhead_usd + self.staging_usd + self.kept_chain_usd

    @property
    def wal_usd(self) -> float:
        return self.wal_storage_usd + self.wal_requests_usd

    @property
    def copy_usd(self) -> float:
        return sum(c.total_usd for c in self.copies_usd.values())

    @property
    def total_usd(self) -> float:
        return (
            self.storage_usd
            + self.overhead_usd
            + self.wal_usd
            + self.drill_usd
            + self.cut_usd
            + self.copy_usd
        )

    @property
    def over_budget(self) -> bool:
        return self.budget_usd is not None and self.total_usd > self.budget_usd

    def summary(self) -> str:
        return (
            f"{self.data_bytes / TiB:g} TiB, policy class {self.storage_class} (landed a "
            f"month: {self.landed_summary()}), {self.fulls_per_month:.2f} fulls + "
            f"{self.incrementals_per_month:.2f} incrementals and {self.objects_per_month:,.0f} "
            f"objects a month, {self.stored_bytes / TiB:.2f} TiB kept: storage "
            f"${self.storage_usd:.2f}/month (held beyond retention ${self.held_usd:.2f}; early "
            f"deletion ${self.early_deletion_usd:.2f} = {self.early_deletion_share:.1%} of "
            f"storage, target {EARLY_DELETION_TARGET:.0%}); request overhead "
            f"${self.request_overhead_usd:.2f}/month = requests ${self.requests_usd:.2f} + "
            f"orchestration ${self.orchestration_usd:.2f} + lambda ${self.lambda_usd:.2f} + "
            f"idle agents ${self.agents_usd:.2f}, {self.request_overhead_ratio:.2%} of storage "
            f"(target {OVERHEAD_TARGET:.0%}); staging ${self.staging_usd:.2f}/month"
            + (
                f"; restore drills ${self.drill_usd:.2f}/month ({self.drills_per_month:.1f})"
                if self.drills_per_month
                else ""
            )
            + (
                f"; scheduled cuts ${self.cut_usd:.2f}/month ({self.cuts_per_month:,.0f})"
                if self.cuts_per_month
                else ""
            )
            + "".join(f"; copy {name}: {c.summary()}" for name, c in self.copies_usd.items())
            + (
                f"; chain kept for synthesized fulls ${self.kept_chain_usd:.2f}/month"
                if self.kept_chain_usd
                else ""
            )
        )

    def landed_summary(self) -> str:
        """Backups a month per class they land in, e.g. 'DEEP_ARCHIVE 30.44'."""
        return ", ".join(f"{c} {n:.2f}" for c, n in self.landed_per_month.items())


class Lifetime(NamedTuple):
    """One simulated backup: when it completed and when retention expired it (None: kept)."""

    completed_at: datetime
    expired_at: datetime | None
    kind: BackupKind
    bytes: int
    parent: int | None = None  # an incremental's parent: its index among the simulated

    def span(self) -> timedelta:
        """How long retention kept it; one still kept when the simulation ends (which runs
        ``LIFETIME_HORIZON`` past the year) lived at least that long."""
        if self.expired_at is None:
            return LIFETIME_HORIZON
        return self.expired_at - self.completed_at


class Stay(NamedTuple):
    """A simulated backup in its lifetime class: priced, and when it is deleted (None: after
    the simulation)."""

    life: Lifetime
    cost: BackupCost
    deleted_at: datetime | None

    @property
    def kept_days(self) -> float:
        """Days from its completion to its deletion (0: not deleted within the simulation)."""
        return (self.deleted_at - self.life.completed_at) / DAY if self.deleted_at else 0.0


def monthly_forecast(
    cluster: ClusterPolicy,
    data_bytes: int,
    daily_change: float,
    *,
    part_size: int | None = None,
    object_size: int | None = None,
    landing: Landing = Landing.COPY,
    staging_hours: float | None = None,
    nodes: int = 1,
    wal: WalGrowth | None = None,
    stack_region: str | None = None,
) -> Forecast:
    """A cluster of ``data_bytes`` whose data changes by ``daily_change`` (a fraction) a day,
    backed up and expired by its policy, averaged over a year in steady state. Parts are the
    policy's ``upload.part_size_mib`` unless ``part_size`` is given; ``stack_region``: where
    the stack runs, so an aws copy in another region pays the transfer between them."""
    _check_forecast_inputs(data_bytes, daily_change)
    if part_size is None and cluster.upload.part_size_mib is not None:
        part_size = cluster.upload.part_size_mib * MiB
    lives, end = simulate_lifetimes(cluster, data_bytes, daily_change)
    start = end - YEAR

    @cache
    def price(size: int, storage_class: StorageClass) -> BackupCost:
        return price_backup(
            size,
            storage_class,
            part_size=part_size,
            object_size=object_size,
            landing=landing,
            staging_hours=staging_hours,
        )

    stays = _stays(cluster, lives, price)
    made = [(s.life, s.cost) for s in stays if start < s.life.completed_at <= end]
    kept_days = [(_days_within(s.life.completed_at, s.deleted_at, start, end), s) for s in stays]
    held_days = [(_days_within(s.life.expired_at, s.deleted_at, start, end), s) for s in stays]
    charges = sum(
        early_deletion_charge(
            s.cost.storage_class, s.life.bytes, s.cost.objects, (gone - s.life.completed_at) / DAY
        )
        for s in stays
        if (gone := s.deleted_at) is not None and start < gone <= end
    )
    months = YEAR / DAY / DAYS_PER_MONTH

    def per_month(values: Iterable[float]) -> float:
        return sum(values) / months

    def storage(days: list[tuple[float, Stay]]) -> float:
        return per_month(d / DAYS_PER_MONTH * s.cost.storage_usd_per_month for d, s in days)

    landed = {c: per_month(cost.storage_class == c for _, cost in made) for c in StorageClass}
    # The archive's window: the policy's, else back to the oldest kept backup (the longest
    # stay), plus the gap before it to the base a restore there starts from.
    window = cluster.archive.window_days or max((s.kept_days for s in stays), default=0.0)
    window += cluster.schedule.longest_gap_hours() / 24  # back to the base before it
    wal_month = archive_month(wal, window) if wal else None
    drills = drill_month(cluster, data_bytes, landed, price, start, end)
    copies = {t.name: copy_month(t, stays, start, end, stack_region) for t in cluster.vault.copies}
    kept_chain = kept_chain_bytes(lives, start, end) if cluster.incremental.synthesized_fulls else 0
    return Forecast(
        storage_class=cluster.vault.storage_class,
        landed_per_month={c: n for c, n in landed.items() if n},
        data_bytes=data_bytes,
        daily_change=daily_change,
        fulls_per_month=per_month(life.kind == BackupKind.FULL for life, _ in made),
        incrementals_per_month=per_month(life.kind == BackupKind.INCREMENTAL for life, _ in made),
        objects_per_month=per_month(cost.objects for _, cost in made),
        stored_bytes=sum(days * s.life.bytes for days, s in kept_days) / (YEAR / DAY),
        storage_usd=storage(kept_days) + charges / months,
        early_deletion_usd=charges / months,
        held_usd=storage(held_days),
        requests_usd=per_month(cost.requests_usd for _, cost in made),
        orchestration_usd=per_month(cost.orchestration_usd for _, cost in made),
        lambda_usd=per_month(cost.lambda_usd for _, cost in made),
        staging_usd=per_month(cost.staging_usd for _, cost in made),
        agents_usd=agents_monthly_cost(nodes),
        budget_usd=cluster.budget_usd_per_month,
        **(wal_month or {}),
        **drills,
        **cut_month(cluster, nodes, start, end),
        copies_usd=copies,
        kept_chain_bytes=kept_chain,
        kept_chain_usd=monthly_storage_cost(StorageClass.STANDARD, round(kept_chain)),
    )


def kept_chain_bytes(lives: list[Lifetime], start: datetime, end: datetime) -> float:
    """The bytes of the newest chain (its full and the incrementals since), averaged over
    ``start`` to ``end``: what the store keeps for the next synthesized full."""
    made = sorted(lives, key=lambda life: life.completed_at)
    weighted, chain = 0.0, 0
    for life, after in zip(made, [*made[1:], None], strict=True):
        chain = life.bytes if life.kind == BackupKind.FULL else chain + life.bytes
        since = max(life.completed_at, start)
        until = min(after.completed_at if after else end, end)
        if until > since:
            weighted += chain * ((until - since) / DAY)
    return weighted / ((end - start) / DAY)


def copy_month(
    target: VaultCopy,
    stays: list[Stay],
    start: datetime,
    end: datetime,
    stack_region: str | None = None,
) -> CopyMonth:
    """A copy target's steady-state month: each backup it takes (``selected_stays``) is kept
    there for the longest of its stay in the stack vault, the copy's retention and the class's
    minimum billed duration; its bytes cross once (out of AWS to GCS; between regions to an
    aws target in another region than ``stack_region``, free within one); each object is one
    write."""
    if isinstance(target, AwsTarget):
        prices = STORAGE[StorageClass(target.storage_class)]
        across = stack_region is not None and target.region != stack_region
        egress_gb = AWS_INTER_REGION_GB if across else 0.0
    else:
        prices, egress_gb = GCS_STORAGE[target.storage_class], AWS_EGRESS_INTERNET_GB
    taken = selected_stays(target, stays)
    made = [s for s in taken if start < s.life.completed_at <= end]
    months = (end - start) / DAY / DAYS_PER_MONTH

    def kept_days(stay: Stay) -> float:
        stayed = stay.kept_days or LIFETIME_HORIZON / DAY
        return max(stayed, target.held_days, prices.minimum_days)

    byte_days = sum(s.life.bytes * kept_days(s) for s in made)
    return CopyMonth(
        storage_class=target.storage_class,
        backups_per_month=len(made) / months,
        stored_bytes=byte_days / DAYS_PER_MONTH / months,
        storage_usd=byte_days / GB / DAYS_PER_MONTH * prices.storage_gb_month / months,
        egress_usd=sum(s.life.bytes for s in made) / GB * egress_gb / months,
        requests_usd=sum(s.cost.objects + 1 for s in made) * prices.put / months,
    )


def selected_stays(target: VaultCopy, stays: list[Stay]) -> list[Stay]:
    """The simulated backups a copy target takes (``shardvault.lifecycle.copies``'s selection):
    all; fulls; or the first full of each ISO week."""
    if target.select == Selection.ALL:
        return stays
    fulls = [s for s in stays if s.life.kind == BackupKind.FULL]
    if target.select == Selection.FULLS:
        return fulls
    weeks: dict[tuple[int, int], Stay] = {}
    for stay in sorted(fulls, key=lambda s: s.life.completed_at):
        year, week, _ = stay.life.completed_at.isocalendar()
        weeks.setdefault((year, week), stay)
    return list(weeks.values())


def drill_month(
    cluster: ClusterPolicy,
    data_bytes: int,
    landed: Mapping[StorageClass, float],
    price: Callable[[int, StorageClass], BackupCost],
    start: datetime,
    end: datetime,
) -> dict[str, float]:
    """The cluster's restore drills a month: each restores a backup of ``data_bytes`` from the
    class most backups land in (a thaw at the Standard tier from an archive class, the
    restore's default, and ``THAW_DAYS`` of thawed copy), by the drill's schedule."""
    if cluster.drill is None:
        return {}
    months = (end - start) / DAY / DAYS_PER_MONTH
    runs = sum(1 for _ in cluster.drill.fires(start, end)) / months
    storage_class = max(landed, key=lambda c: landed[c]) if any(landed.values()) else None
    storage_class = storage_class or cluster.vault.storage_class
    objects = price(data_bytes, storage_class).objects
    one = price_restore(
        storage_class, data_bytes, objects, tier=RestoreTier.STANDARD, keep_days=THAW_DAYS
    )
    return {"drills_per_month": runs, "drill_usd": runs * one.total_usd}


def cut_month(cluster: ClusterPolicy, nodes: int, start: datetime, end: datetime) -> dict:
    """The cluster's scheduled cuts a month (``cut.every_minutes``), on ``nodes`` source
    nodes: each a run of the cut state machine and its requests (``TRANSITIONS_PER_CUT``)."""
    if cluster.cut.every_minutes is None:
        return {}
    months = (end - start) / DAY / DAYS_PER_MONTH
    runs = sum(1 for _ in cluster.cut.fires(start, end)) / months
    calls = 2 + nodes
    one = (
        (TRANSITIONS_PER_CUT + TRANSITIONS_PER_CUT_NODE * nodes) * STATE_TRANSITION
        + calls * (LAMBDA_REQUEST + LAMBDA_GB_SECONDS_PER_CALL * LAMBDA_GB_SECOND)
        + (DYNAMODB_WRITES_PER_CUT + DYNAMODB_WRITES_PER_CUT_NODE * nodes) * DYNAMODB_WRITE
        + 2 * nodes * SQS_REQUEST
    )
    return {"cuts_per_month": runs, "cut_usd": runs * one}


class WalGrowth(NamedTuple):
    """How fast a cluster's WAL archive grows, as measured (``measured_wal``)."""

    stored_bytes_per_day: float
    batches_per_day: float


# Per recorded WAL batch: its PUT and its index's, the stored checksum read back, three calls
# of the archive function (about 0.1 s at 512 MB each) and the request item written and deleted.
WAL_PUTS_PER_BATCH, WAL_GETS_PER_BATCH = 2, 1
WAL_LAMBDA_CALLS_PER_BATCH, WAL_LAMBDA_GB_SECONDS_PER_BATCH = 3, 0.15
WAL_DYNAMODB_WRITES_PER_BATCH = 3  # the request item, its deletion, the archive's counters


def archive_month(growth: WalGrowth, window_days: float) -> dict[str, float]:
    """The archive's month: ``window_days`` of WAL kept at STANDARD, and its requests."""
    kept = growth.stored_bytes_per_day * window_days
    standard = STORAGE[StorageClass.STANDARD]
    batches = growth.batches_per_day * DAYS_PER_MONTH
    per_batch = (
        WAL_PUTS_PER_BATCH * standard.put
        + WAL_GETS_PER_BATCH * standard.get
        + WAL_LAMBDA_CALLS_PER_BATCH * LAMBDA_REQUEST
        + WAL_LAMBDA_GB_SECONDS_PER_BATCH * LAMBDA_GB_SECOND
        + WAL_DYNAMODB_WRITES_PER_BATCH * DYNAMODB_WRITE
    )
    return {
        "wal_bytes": kept,
        "wal_storage_usd": kept / GiB * standard.storage_gb_month,
        "wal_requests_usd": batches * per_batch,
    }


def measured_wal(totals: ArchiveTotals | None, now: float) -> WalGrowth | None:
    """The archive's growth from its counters (``Catalog.archive_totals``): what it recorded
    since its first batch, a day's worth at a time; None before a day of it."""
    if totals is None or totals.first_at is None:
        return None
    days = (now - totals.first_at) / 86400
    if days < 1:
        return None
    return WalGrowth(totals.stored_bytes / days, totals.batches / days)


class MeasuredSizes(NamedTuple):
    """A cluster's backups as its catalog measured them (see *measured sizes*)."""

    full_bytes: int  # the newest full's stored bytes
    incremental_share: float | None  # median incremental / its full; None: none measured
    incrementals: int  # how many were measured

    def daily_change(self, schedule: Schedule) -> float | None:
        """The share a forecast's incremental holds per day since its parent, such that one
        incremental of this schedule's cadence holds the measured share."""
        if self.incremental_share is None:
            return None
        return min(1.0, self.incremental_share / incremental_interval_days(schedule))


def measured_sizes(items: Iterable[BackupItem], cluster: str) -> MeasuredSizes | None:
    """The cluster's measured sizes from its catalog items (None: no complete full yet)."""
    backups = from_catalog(cluster, items)
    by_id = {b.backup_id: b for b in backups}
    fulls = [b for b in backups if b.kind == BackupKind.FULL and b.bytes]
    if not fulls:
        return None
    shares = sorted(
        b.bytes / root.bytes
        for b in backups
        if b.kind == BackupKind.INCREMENTAL and (root := _chain_full(b, by_id)) and root.bytes
    )
    newest = max(fulls, key=lambda b: b.completed_at)
    median = shares[len(shares) // 2] if shares else None
    return MeasuredSizes(newest.bytes, median, len(shares))


def _chain_full(backup: BackupRecord, by_id: Mapping[str, BackupRecord]) -> BackupRecord | None:
    """The full an incremental's chain starts with, if the catalog still holds the chain."""
    while backup.kind == BackupKind.INCREMENTAL:
        parent = by_id.get(backup.parent_id or "")
        if parent is None:
            return None
        backup = parent
    return backup


def incremental_interval_days(schedule: Schedule) -> float:
    """The median days between an incremental of the schedule and the backup before it."""
    start = datetime(2026, 1, 1, tzinfo=schedule.zone)
    fires = list(schedule.fires(start, start + timedelta(days=28)))
    gaps = sorted(
        (b - a) / DAY for (a, _), (b, due) in pairwise(fires) if due == BackupKind.INCREMENTAL
    )
    return gaps[len(gaps) // 2] if gaps else 1.0


def forecast_measured(
    cluster: ClusterPolicy, measured: MeasuredSizes, daily_change: float
) -> Forecast:
    """A forecast at the cluster's measured full size and, once an incremental was measured,
    its measured incremental size (``daily_change`` until then)."""
    change = measured.daily_change(cluster.schedule)
    return monthly_forecast(
        cluster, max(measured.full_bytes, 1), daily_change if change is None else change
    )


def _check_forecast_inputs(data_bytes: int, daily_change: float) -> None:
    if data_bytes <= 0:
        raise CostError(
            f"a forecast of {data_bytes} bytes of data means nothing.",
            fix="give the cluster's data size, more than 0 (--data-gib).",
        )
    if not 0 <= daily_change <= 1:
        raise CostError(
            f"a daily change of {daily_change} is not a fraction of the data.",
            fix="give the part of the data that changes a day, from 0 to 1, e.g. 0.05 for 5% "
            "(--daily-change).",
        )


def _stays(
    cluster: ClusterPolicy,
    lives: tuple[Lifetime, ...],
    price: Callable[[int, StorageClass], BackupCost],
) -> list[Stay]:
    """Each simulated backup in its lifetime class, and when it is deleted: when retention
    expires it, or, held (``retention``: *held*), once its class's minimum has passed or
    with its parent, whichever comes first (parents come first in ``lives``)."""
    stays: list[Stay] = []
    for life in lives:
        chosen = lifetime_class(cluster.vault, life.span(), life.bytes)
        deleted = life.expired_at
        if deleted is not None and not cluster.vault.delete_before_paid_minimum:
            paid = life.completed_at + timedelta(days=STORAGE[chosen].minimum_days)
            parent = None if life.parent is None else stays[life.parent].deleted_at
            deleted = max(deleted, hold_end(paid, parent))
        stays.append(Stay(life, price(life.bytes, chosen), deleted))
    return stays


def _days_within(
    since: datetime | None, until: datetime | None, start: datetime, end: datetime
) -> float:
    """Days of the window ``(start, end]`` between ``since`` (None: never) and ``until``
    (None: after the window)."""
    if since is None:
        return 0.0
    return max(timedelta(0), min(until or end, end) - max(since, start)) / DAY


@dataclass(frozen=True)
class ByValue:
    """A cluster's policy as a cache key: equal when its values are (a policy holds lists,
    ``nodes:`` for one, and is not hashable itself)."""

    cluster: ClusterPolicy = field(compare=False, hash=False)
    key: str = ""

    @classmethod
    def of(cls, cluster: ClusterPolicy) -> ByValue:
        return cls(cluster, cluster.model_dump_json())


def simulate_lifetimes(
    cluster: ClusterPolicy, data_bytes: int, daily_change: float
) -> tuple[tuple[Lifetime, ...], datetime]:
    """See ``_simulate_lifetimes``; each answer is computed once per policy's values."""
    return _simulate_lifetimes(ByValue.of(cluster), data_bytes, daily_change)


@lru_cache(maxsize=32)
def _simulate_lifetimes(
    policy: ByValue, data_bytes: int, daily_change: float
) -> tuple[tuple[Lifetime, ...], datetime]:
    """Every backup the schedule makes, expired by retention run after each backup, from a
    fixed start until a year past the warm-up; and the end of that year. The simulation goes
    on for ``LIFETIME_HORIZON`` past that end, so that every backup of the year is known to
    expire or to outlive every class's minimum billed duration (``lifetimes.expected_lifetime``
    gives the same lifetimes one at a time). An incremental holds the change since its parent
    (the backup before it); the first backup is a full."""
    cluster = policy.cluster
    schedule, zone = cluster.schedule, cluster.schedule.zone
    start = datetime(2026, 1, 1, tzinfo=zone)  # fixed: forecasts are reproducible
    end = start + _warm_up(cluster, start) + YEAR
    lock = timedelta(days=cluster.vault.object_lock.days)
    live: list[BackupRecord] = []
    made: list[BackupRecord] = []
    expired: dict[str, datetime] = {}
    for n, (at, due) in enumerate(schedule.fires(start, end + LIFETIME_HORIZON)):
        if n >= MAX_SIMULATED_BACKUPS:
            raise CostError(
                f"the schedule runs more than {MAX_SIMULATED_BACKUPS} backups in the forecast.",
                fix="forecast a schedule with fewer backups a day.",
            )
        parent = live[-1] if live else None  # the newest backup is never expired
        kind = due if parent else BackupKind.FULL
        size = data_bytes
        if parent and kind == BackupKind.INCREMENTAL:
            size = min(
                data_bytes, round(data_bytes * daily_change * ((at - parent.completed_at) / DAY))
            )
        made.append(
            BackupRecord(
                backup_id=f"{n:06d}",
                cluster="forecast",
                completed_at=at,
                kind=kind,
                parent_id=parent.backup_id if parent and kind == BackupKind.INCREMENTAL else None,
                storage_class=cluster.vault.storage_class,
                retain_until=at + lock,
                bytes=size,
            )
        )
        # When retention expires each backup; holds come after (``_stays``): a held backup
        # changes no keep decision.
        decision = decide([*live, made[-1]], cluster.retention, at, zone, **NO_HOLDS)
        gone = set(decision.expire)
        expired |= dict.fromkeys(gone, at)
        live = [b for b in [*live, made[-1]] if b.backup_id not in gone]
    index = {b.backup_id: n for n, b in enumerate(made)}
    lives = tuple(
        Lifetime(
            b.completed_at,
            expired.get(b.backup_id),
            b.kind,
            b.bytes,
            None if b.parent_id is None else index[b.parent_id],
        )
        for b in made
    )
    return lives, end


def _warm_up(cluster: ClusterPolicy, start: datetime) -> timedelta:
    """Long enough for the backups kept longest to have come and gone once."""
    keep = cluster.retention
    days = max(
        keep.keep_daily + 1,
        7 * (keep.keep_weekly + 1),
        31 * (keep.keep_monthly + 1),
        366 * (keep.keep_yearly + 1),
        cluster.vault.object_lock.days,
    )
    return timedelta(days=days) + _longest_full_gap(cluster.schedule, start)


def _longest_full_gap(schedule: Schedule, start: datetime) -> timedelta:
    """The longest time between fulls over a year (how far back a chain can reach)."""
    fulls = Schedule(timezone=schedule.timezone, full=schedule.full)
    times = [start] + [at for at, _ in fulls.fires(start, start + YEAR)]
    return max((b - a for a, b in pairwise(times)), default=YEAR)


# --- The target ------------------------------------------------------------------------
TARGET_CLUSTER = ClusterPolicy(
    engine="postgres",
    schedule=Schedule(timezone="UTC", full="0 2 * * 0", incremental="0 2 * * 1-6"),
    vault=Vault(
        storage_class=StorageClass.DEEP_ARCHIVE,
        object_lock=ObjectLock(mode=LockMode.GOVERNANCE, days=30),
    ),
    retention=Retention(keep_daily=7, keep_weekly=4, keep_monthly=12),
)


def target_forecast(*, part_size: int | None = None, object_size: int | None = None) -> Forecast:
    """The issue's target case: 1 TiB changing 5% a day, a full on Sundays and an incremental
    the other days, in DEEP_ARCHIVE, kept 7 daily, 4 weekly and 12 monthly (the issue names
    no retention: this one is ours). Objects as the planner cuts them unless sizes are given."""
    return monthly_forecast(
        TARGET_CLUSTER, 1 * TiB, 0.05, part_size=part_size, object_size=object_size
    )


def budget_alert(cluster: str, forecast: Forecast) -> str | None:
    """The alert to send when a cluster's monthly forecast exceeds its budget (else None)."""
    if not forecast.over_budget:
        return None
    return (
        f"ShardVault: cluster {cluster} is forecast at ${forecast.total_usd:.2f}/month, over its "
        f"budget of ${forecast.budget_usd:.2f} (storage ${forecast.storage_usd:.2f}, of which "
        f"early deletion ${forecast.early_deletion_usd:.2f}; overhead "
        f"${forecast.overhead_usd:.2f}). Fix: shorten retention, choose a cheaper class, or "
        "raise budget_usd_per_month in the policy."
    )


# --- Recorded spend ----------------------------------------------------------------------------
class Spend(NamedTuple):
    """What one cluster's complete backups in one class cost a month to keep."""

    cluster: str
    storage_class: StorageClass
    backups: int
    bytes: int
    usd_per_month: float


def recorded_spend(records: Iterable[BackupItem]) -> list[Spend]:
    """The catalog's complete backups (failed, running and expired ones cost nothing to keep)
    priced by cluster and class: promoted ones in their vault class, others at STANDARD."""
    totals: dict[tuple[str, StorageClass], Spend] = {}
    for record in records:
        if record.status != "COMPLETE":
            continue
        key = (record.cluster, recorded_class(record))
        size, objects = recorded_stored_bytes(record), max(1, record.objects or 1)
        was = totals.get(key, Spend(*key, 0, 0, 0.0))
        totals[key] = Spend(
            *key,
            was.backups + 1,
            was.bytes + size,
            was.usd_per_month + monthly_storage_cost(key[1], size, objects),
        )
    return [totals[key] for key in sorted(totals)]


def recorded_class(record: BackupItem) -> StorageClass:
    """The class a backup is billed in; a class the price table lacks (a non-AWS store's own)
    is priced as STANDARD."""
    name = record.storage_class if record.location == "vault" else None
    return StorageClass(name) if name in StorageClass.__members__ else StorageClass.STANDARD
