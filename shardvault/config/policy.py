"""The deployment's policy file (``shardvault.yaml``): its clusters and what is done to them.

Terms:
- *policy*: the one declarative file of a deployment, validated whole by ``load_policy``; an
  invalid file fails with every problem, each named by its *field path* (e.g.
  ``clusters.demo.retention.keep_daily``) and a fix.
- *cadence*: when a cluster is backed up: a *full* cron expression and an optional
  *incremental* one, read in the schedule's time zone. When both fire at the same minute, the
  full runs. An incremental holds what changed since its *parent*, the backup before it.
- *vault*: where verified backups land, in the policy's storage class (or, with
  ``class_by_lifetime``, a class with a shorter minimum billed duration when that costs less
  for the backup's expected lifetime: ``shardvault.lifecycle.lifetimes``), each object locked by S3
  Object Lock (*mode*, *minimum days*) as it lands.
- *paid minimum*: a class's minimum billed duration (30 days STANDARD_IA, 90 GLACIER_IR and
  GLACIER, 180 DEEP_ARCHIVE). Retention holds an expired backup until it has passed
  (``shardvault.lifecycle.retention``) unless ``delete_before_paid_minimum`` says otherwise.
- *retention*: keep counts in the style of restic's ``forget`` (``shardvault.lifecycle.retention``).
- *drill*: a scheduled restore of one of the cluster's backups into a cluster of drill nodes,
  validated, timed (its RTO) and torn down after a while (``shardvault.assurance.drills``).
"""

from __future__ import annotations

import difflib
import math
import types
from collections.abc import Hashable, Iterator
from datetime import UTC, datetime, timedelta
from enum import Enum
from itertools import pairwise
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple, Union, get_args, get_origin
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import yaml
from croniter import CroniterBadDateError, CroniterError, croniter
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from shardvault.config.targets import (
    STACK_TARGET,
    AwsTarget,
    VaultCopy,
    check_copies,
    invalid,
    recovery_key_of,
    target_name,
)
from shardvault.contracts import models
from shardvault.contracts.cut import database_name_problem
from shardvault.contracts.engines import traits
from shardvault.contracts.models import (
    DEFAULT_MIN_SOURCE_FREE_PERCENT,
    DEFAULT_THROTTLE_WINDOW_SECONDS,
    LOCK_DAYS_MAX,
    Compression,
    Engine,
    Frozen,
    LockMode,
    check_name,
    vault_class_fix,
)
from shardvault.contracts.sqlcheck import DIALECTS, check_validation_queries
from shardvault.data.planning import MiB, check_part_size
from shardvault.errors import InvalidRequest, PlanTooLarge, ShardVaultError
from shardvault.pricing.prices import VAULT_CLASSES, StorageClass


class PolicyError(ShardVaultError):
    """The policy file is missing, unreadable or invalid; ``problems`` lists every problem."""

    def __init__(self, message: str, *, fix: str = "", problems: list[Problem] | None = None):
        super().__init__(message, fix=fix)
        self.problems = problems or []


class Problem(NamedTuple):
    path: str  # field path, e.g. clusters.demo.retention.keep_daily
    message: str
    fix: str


BackupKind = models.BackupKind  # one definition, where the backup's records are modelled


# --- Field checks ------------------------------------------------------------------------------
CRON_FIX = (
    "write minute hour day-of-month month day-of-week, e.g. '0 2 * * 0' for Sundays at 02:00 "
    "(quote it in YAML)"
)


UNRESTRICTED_DAYS = ("*", "?")


def check_day_fields(expression: str) -> str:
    """Refuses a five-field cron expression that restricts both the day of month and the day
    of week. Standard cron (and croniter, hence the local scheduler and the cost forecast)
    fires when *either* matches; EventBridge Scheduler takes one day field only. The policy's
    validation and the conversion into Scheduler expressions (infra) share this one rule."""
    _, _, day_of_month, _, day_of_week = expression.split()
    if day_of_month not in UNRESTRICTED_DAYS and day_of_week not in UNRESTRICTED_DAYS:
        raise PolicyError(
            f"{expression!r} restricts both the day of month and the day of week: cron runs "
            "it when either matches ('0 2 1-7 * 1' runs on days 1 to 7 and on every Monday), "
            "which EventBridge Scheduler cannot express",
            fix="restrict only one of the two with '*' in the other, e.g. '0 2 1 * *' for the "
            "1st of each month or '0 2 * * 1' for Mondays",
        )
    return expression


def _cron(value: str) -> str:
    fields = len(value.split())
    if fields != 5:
        raise invalid(f"{value!r} has {fields} fields, not the five of a cron expression", CRON_FIX)
    try:
        # From a fixed date: an expression that never fires (February 30) would otherwise
        # pass here and stop the scheduler and the cost forecast later.
        croniter(value, datetime(2026, 1, 1, tzinfo=UTC)).get_next(datetime)
        check_day_fields(value)
    except CroniterBadDateError:
        raise invalid(
            f"{value!r} never fires (no such date)", "name a day that exists, e.g. '0 2 28 2 *'"
        ) from None
    except CroniterError as error:  # croniter says which value, e.g. "out of range"
        raise invalid(f"{value!r} is not a valid cron expression: {error}", CRON_FIX) from None
    except PolicyError as error:
        raise invalid(error.message, error.fix) from None
    return value


def _timezone(value: str) -> str:
    try:
        ZoneInfo(value)
    except (ZoneInfoNotFoundError, ValueError):
        raise invalid(
            f"{value!r} is not a known time zone",
            "use an IANA time zone name such as UTC, Europe/Paris or America/New_York",
        ) from None
    return value


def _cluster_name(value: str) -> str:
    try:
        return check_name("cluster", value)
    except InvalidRequest as error:
        raise invalid(error.message, error.fix) from None


def _validation_queries(value: tuple[str, ...]) -> tuple[str, ...]:
    try:
        return tuple(check_validation_queries(list(value)))
    except InvalidRequest as error:
        raise invalid(error.message, error.fix) from None


def _node_ids(value: list[str] | None) -> list[str] | None:
    if value is None:
        return None
    try:
        names = [check_name("node", v) for v in value]
    except InvalidRequest as error:
        raise invalid(error.message, error.fix) from None
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise invalid(f"{', '.join(twice)} listed twice", "list each node once")
    return names


def _engines(value: Any) -> Any:
    """One engine, or a list of them for a mixed cluster: checked before the field's own
    validation, whose errors would name the union's branches rather than the engines."""
    names = [engine.value for engine in Engine]
    for item in value if isinstance(value, list) else [value]:
        if item not in names:
            choices = ", ".join(repr(n) for n in names[:-1]) + f" or {names[-1]!r}"
            raise invalid(
                f"Input should be {choices}, got {_short(item)}",
                f"use one of {choices}, or a list of them for a cluster whose nodes mix "
                "engines (e.g. [postgres, rocksdb])",
            )
    if value == []:
        raise invalid("engine lists no engine", "name the cluster's engine, e.g. postgres")
    if isinstance(value, list) and (twice := sorted({v for v in value if value.count(v) > 1})):
        raise invalid(f"engine lists {', '.join(twice)} twice", "list each engine once")
    return value


def _vault_class(value: Any) -> Any:
    """Before the enum's own check, whose fix would offer STANDARD (not a vault class)."""
    if value in VAULT_CLASSES:
        return value
    raise invalid(f"{_short(value)} is not a vault storage class", vault_class_fix(value))


def _part_size_mib(value: int | None) -> int | None:
    if value is not None:
        try:
            check_part_size(value * MiB)
        except (InvalidRequest, PlanTooLarge):
            raise invalid(
                f"part size {value} MiB is outside S3's limits (5 MiB to 5 GiB)",
                "use 5 to 5120 MiB, or remove part_size_mib to have it chosen from the data size",
            ) from None
    return value


Cron = Annotated[str, AfterValidator(_cron)]
Count = Annotated[int, Field(ge=0, strict=True)]


# --- The model ---------------------------------------------------------------------------------
class Schedule(Frozen):
    timezone: Annotated[str, AfterValidator(_timezone)] = Field(
        "UTC",
        json_schema_extra={"shown_type": "time zone"},
        description="IANA time zone the cron expressions are read in, e.g. Europe/Paris.",
    )
    full: Cron = Field(
        json_schema_extra={"shown_type": "cron"},
        description="When full backups run: a cron expression (minute hour day-of-month month "
        "day-of-week), e.g. '0 2 * * 0' for Sundays at 02:00.",
    )
    incremental: Cron | None = Field(
        None,
        json_schema_extra={"shown_type": "cron"},
        description="When incremental backups run between fulls, e.g. '0 2 * * 1-6'; "
        "null: fulls only. The cluster's incremental settings say when one is made as a full.",
    )

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    def fires(self, start: datetime, end: datetime) -> Iterator[tuple[datetime, BackupKind]]:
        """Backups due in ``(start, end]``, in order; the full wins a minute both claim."""
        due: dict[datetime, BackupKind] = {}
        for kind, expr in (
            (BackupKind.INCREMENTAL, self.incremental),
            (BackupKind.FULL, self.full),
        ):
            if expr is None:
                continue
            times = croniter(expr, start.astimezone(self.zone))
            while (at := times.get_next(datetime)) <= end:
                due[at] = kind
        yield from sorted(due.items())

    def longest_gap_hours(self) -> float:
        """The longest wait between two scheduled backups over a year (months and leap days
        differ), from at most ``GAP_SAMPLE`` runs of each expression: a schedule that runs
        that often has shown its longest gap well before."""
        start = datetime(2026, 1, 1, tzinfo=self.zone)
        horizon = start + timedelta(days=366)
        times: set[datetime] = set()
        for expr in filter(None, (self.full, self.incremental)):
            runs = croniter(expr, start)
            own = []
            for _ in range(GAP_SAMPLE):
                at = runs.get_next(datetime)
                if at > horizon:
                    break
                own.append(at)
            horizon = own[-1] if len(own) == GAP_SAMPLE else horizon
            times |= set(own)
        ordered = sorted(t for t in times if t <= horizon)
        gaps = [(b - a).total_seconds() / 3600 for a, b in pairwise(ordered)]
        return max(gaps, default=366 * 24.0)


GAP_SAMPLE = 2000


class ObjectLock(Frozen):
    mode: LockMode = Field(
        LockMode.GOVERNANCE,
        description="GOVERNANCE (principals with s3:BypassGovernanceRetention may delete "
        "early) or COMPLIANCE (nobody can, the root user included).",
    )
    days: int = Field(
        ge=1,
        le=LOCK_DAYS_MAX,
        strict=True,
        description="Days each object stays locked after it lands; retention never expires a "
        "backup sooner.",
    )


class Vault(Frozen):
    name: Annotated[str, AfterValidator(target_name)] = Field(
        STACK_TARGET,
        description="The stack vault's name, as restore --from-vault and the catalog use it.",
    )
    storage_class: Annotated[StorageClass, BeforeValidator(_vault_class)] = Field(
        description="Storage class backups land in: STANDARD_IA, GLACIER_IR, GLACIER or "
        "DEEP_ARCHIVE.",
        json_schema_extra={"shown_type": " | ".join(VAULT_CLASSES)},
    )
    object_lock: ObjectLock = Field(description="S3 Object Lock applied to every object.")
    class_by_lifetime: bool = Field(
        True,
        strict=True,
        description="true: each backup lands in the class that costs least for its expected "
        "lifetime under retention (storage for the longer of that lifetime and the class's "
        "minimum billed duration, plus the requests that land it), among storage_class and "
        "the classes with a shorter minimum (shardvault/lifecycle/lifetimes.py); false: every "
        "backup lands in storage_class.",
    )
    delete_before_paid_minimum: bool = Field(
        False,
        strict=True,
        description="false: retention holds an expired backup (listed, restorable) until its "
        "class's minimum billed duration has passed, since deleting it sooner is billed the "
        "same; true: deletes it when retention expires it and pays the early-deletion charge "
        "(for erasure duties).",
    )
    copies: list[VaultCopy] = Field(
        default_factory=list,
        description="Other vault targets each verified backup is also copied to "
        "(shardvault/config/targets.py); []: the stack vault alone.",
    )

    @model_validator(mode="after")
    def _copies_named_and_held(self) -> Vault:
        check_copies(self.name, self.object_lock.days, self.copies)
        return self


class Retention(Frozen):
    keep_daily: Count = Field(
        0, description="Keep the newest backup of each of the last N days that have backups."
    )
    keep_weekly: Count = Field(
        0, description="Keep the newest backup of each of the last N ISO weeks (Monday-Sunday)."
    )
    keep_monthly: Count = Field(
        0, description="Keep the newest backup of each of the last N months."
    )
    keep_yearly: Count = Field(0, description="Keep the newest backup of each of the last N years.")

    @model_validator(mode="after")
    def _something_kept(self) -> Retention:
        if not (self.keep_daily or self.keep_weekly or self.keep_monthly or self.keep_yearly):
            raise invalid(
                "every keep count is 0",
                "set at least one of keep_daily, keep_weekly, keep_monthly, keep_yearly "
                "(with all at 0 only the newest backup would be kept)",
            )
        return self


class Upload(Frozen):
    part_size_mib: Annotated[int | None, AfterValidator(_part_size_mib)] = Field(
        None,
        strict=True,
        description="Part size in MiB, 5 to 5120 (S3's limits); null: chosen from the data "
        "size and the vault class (8 MiB parts, 256 MiB objects up to 256 GiB of data; for "
        "GLACIER and DEEP_ARCHIVE, parts up to 512 MiB while a backup keeps at least 4 "
        "objects).",
    )
    rate_limit_mib_per_second: float | None = Field(
        None,
        gt=0,
        strict=True,
        description="Cap on MiB read per second per node, sent to the agents with each backup; "
        "an agent applies the stricter of this and its own rate_limit_bytes_per_second. "
        "null: the agent's own.",
    )
    parallelism: int | None = Field(
        None,
        ge=1,
        strict=True,
        description="Parts of one object an agent sends at once, sent with each backup; an "
        "agent applies the smaller of this and its own upload_parallelism. null: the "
        "agent's own.",
    )
    throttle: Literal["static", "adaptive", "auto"] = Field(
        "auto",
        description="static: the agents read at the rate limit (or as fast as they can). "
        "adaptive: each agent steers its read rate by the source's health while it reads "
        "(the database server's CPU and IO stall from Linux PSI, and for PostgreSQL the time "
        "its server takes to answer a probe while other clients are connected): it cuts "
        "the rate by as much as either rises past its target (half at most), waits for the "
        "cut to show, and recovers it over seconds, under the rate limit and never below the "
        "floor. backup --wait and show report the rate and "
        "what limited it. auto: adaptive on a source in use as the backup starts reading "
        "(PostgreSQL: clients other than ShardVault's connected), static otherwise (an idle "
        "source, an engine that cannot tell).",
    )
    throttle_window_minutes: int = Field(
        DEFAULT_THROTTLE_WINDOW_SECONDS // 60,
        ge=1,
        strict=True,
        description="adaptive: the time a backup may take; the floor is at least the rate "
        "that reads the node's data once in this window.",
    )
    max_held_wal_mib: int | None = Field(
        None,
        ge=16,
        strict=True,
        description="PostgreSQL: the most WAL a backup may hold on a source (its replication "
        "slot keeps every segment written from the backup's start until its release); a "
        "backup that holds more fails with SourceLogFull and lets it go. null: no cap (what "
        "it holds is still reported, and min_source_free_percent still applies).",
    )
    min_source_free_percent: float = Field(
        DEFAULT_MIN_SOURCE_FREE_PERCENT,
        ge=0,
        lt=100,
        strict=True,
        description="PostgreSQL: a backup that holds WAL (a segment or more) while the disk "
        "of the source's pg_wal has less than this share free fails with SourceLogFull and "
        "lets it go, before the server stops for a full disk. 0: never.",
    )
    throttle_floor_mib_per_second: float = Field(
        4.0,
        gt=0,
        strict=True,
        description="adaptive: the lowest read rate per node, whatever the source's health.",
    )


def _database_name(value: str | None) -> str | None:
    """A PostgreSQL database name (``shardvault.contracts.cut.database_name_problem``). It
    reaches the agents' servers only as a connection parameter, never inside SQL."""
    if value is not None and (problem := database_name_problem(value)):
        raise invalid(
            f"{_short(value)} {problem}",
            "name the database your application takes commit_lock in, as PostgreSQL spells "
            "it (SELECT datname FROM pg_database)",
        )
    return value


# Scheduled cut periods, in minutes: each divides an hour or a day, so the cuts fall on the
# same clock minutes whether EventBridge or the local scheduler starts them, and "the newest
# cut before T" is never more than one period before T. Five minutes is the floor: each cut is
# a state machine execution (its transitions and Lambda calls, docs/reference/cost.md).
CUT_EVERY_MINUTES = (5, 10, 15, 20, 30, 60, 120, 180, 240, 360, 480, 720, 1440)


class Cut(Frozen):
    commit_lock: int | None = Field(
        None,
        ge=-(2**63),
        lt=2**63,
        strict=True,
        description="PostgreSQL: the advisory lock key your application's distributed commits "
        "hold shared on every node they commit on (pg_advisory_lock_shared, from before the "
        "first COMMIT PREPARED to after the last); each backup's cut holds it exclusively for "
        "a few milliseconds on every node around its restore point, so no such commit lands "
        "on one node's side of the cut and another's. null: no pause, a best-effort cut.",
    )
    database: Annotated[str | None, AfterValidator(_database_name)] = Field(
        None,
        strict=True,
        json_schema_extra={"shown_type": "PostgreSQL database name"},
        description="PostgreSQL: the database your application takes commit_lock in (required "
        "with commit_lock; one database: have every distributed commit take the lock there). "
        "Advisory locks are per database: the cut takes the lock there, on a session of its "
        "own, whatever database the agents' conninfo names. The agent's role needs CONNECT on "
        "it and EXECUTE on pg_create_restore_point(text) in it (function grants are per "
        "database too).",
    )

    every_minutes: int | None = Field(
        None,
        strict=True,
        description="PostgreSQL: take the cut on its own, with no backup, every this many "
        "minutes (scheduled cuts: one of "
        + ", ".join(str(n) for n in CUT_EVERY_MINUTES)
        + ", at the clock's multiples of it, UTC); a restore can then stop every node at one "
        "of them (restore --target-cut, --target-cut-before). Needs the shards' WAL archived. "
        "Each cut pauses the commits that hold commit_lock for about 10 ms (docs/guide/"
        "cluster-cut.md). null: cuts only as each backup ends.",
    )

    @field_validator("every_minutes")
    @classmethod
    def _every_minutes(cls, value: int | None) -> int | None:
        if value is not None and value not in CUT_EVERY_MINUTES:
            raise invalid(
                f"every_minutes {value} is not one of the periods scheduled cuts keep (they fall "
                "on the clock's multiples of it, the same minutes in every time zone)",
                "use one of " + ", ".join(str(n) for n in CUT_EVERY_MINUTES),
            )
        return value

    @property
    def cron(self) -> str | None:
        """When the scheduled cuts fall (a five-field cron, UTC); None: none are scheduled."""
        minutes = self.every_minutes
        if minutes is None:
            return None
        if minutes < 60:
            return f"*/{minutes} * * * *"
        return "0 0 * * *" if minutes == 24 * 60 else f"0 */{minutes // 60} * * *"

    def fires(self, start: datetime, end: datetime) -> Iterator[datetime]:
        """Scheduled cut times in ``(start, end]``, in order (none when none are scheduled)."""
        if self.cron is None:
            return
        times = croniter(self.cron, start.astimezone(UTC))
        while (at := times.get_next(datetime)) <= end:
            yield at

    @model_validator(mode="after")
    def _database_with_lock(self) -> Cut:
        # Defaulting to the agents' conninfo database was the bug this refuses: a lock taken
        # in a database the application does not use pauses nothing, yet the cut said paused.
        if self.commit_lock is not None and self.database is None:
            raise invalid(
                "commit_lock without database: PostgreSQL advisory locks are per database, so "
                "the pause holds your commits only in the database your application takes "
                "the lock in, which the policy must name",
                "add 'database: <that database>' under cut, e.g. cut: {commit_lock: "
                f"{self.commit_lock}, database: bank}}",
            )
        if self.commit_lock is None and self.database is not None:
            raise invalid(
                "database without commit_lock: it names where the pause takes its lock, and no "
                "pause is asked",
                "add the lock's key as commit_lock, or remove database",
            )
        return self


class Archive(Frozen):
    max_delay_seconds: float = Field(
        60.0,
        gt=0,
        le=3600,
        strict=False,
        description="Continuous log archiving: the longest a WAL file waits in the agent's "
        "spool for others to share its object (fewer requests; the archive's RPO is "
        "PostgreSQL's archive_timeout plus this). A batch that reaches 256 MiB goes at once. "
        "MariaDB: the longest a binary log stays open with changes before the agent closes "
        "and stores it (the archive's RPO).",
    )
    key_seconds: float = Field(
        86400.0,
        ge=60,
        strict=False,
        description="With encryption: kms, how long an agent seals WAL batches under one data "
        "key before it asks for a new one.",
    )
    window_days: float | None = Field(
        None,
        gt=0,
        strict=False,
        description="How far back a time can be restored to: the daily run expires the WAL no "
        "target inside the window needs; null: back to the oldest kept backup (all of its WAL "
        "is kept, as pgBackRest keeps archive for every kept full).",
    )


class Incremental(Frozen):
    max_chain: int = Field(
        6,
        ge=1,
        le=100,
        strict=True,
        description="Incrementals after a full before the next one is made as a full: a "
        "restore reads the whole chain, and a long chain restores slower and breaks with any "
        "of its backups.",
    )
    synthesized_fulls: int = Field(
        0,
        ge=0,
        le=52,
        strict=True,
        description="How many fulls in a row are synthesized before one is read from the "
        "database again: a synthesized full reads only the changes since the chain's newest "
        "backup, as an incremental, and copies the chain's objects beneath them inside the "
        "store, so it stands alone like a read full. Its restore reads every change since the "
        "last read full; a read full starts over. 0: every full is read. The chain's staging "
        "copy stays in the store (STANDARD) until the next full.",
    )
    when_parent_unavailable: Literal["full", "refuse"] = Field(
        "full",
        description="An incremental whose parent is missing, failed or expired (or older than "
        "block maps): full makes it a full (a schedule never skips a night); refuse fails "
        "it with ParentUnavailable before anything is read.",
    )


class Drill(Frozen):
    cron: Cron = Field(
        json_schema_extra={"shown_type": "cron"},
        description="When the drill runs, e.g. '0 9 * * 3' for Wednesdays at 09:00 (a time "
        "when someone reads its alarm).",
    )
    timezone: Annotated[str, AfterValidator(_timezone)] = Field(
        "UTC",
        json_schema_extra={"shown_type": "time zone"},
        description="IANA time zone the cron expression is read in.",
    )
    target_cluster: Annotated[str, AfterValidator(_cluster_name)] = Field(
        description="The cluster of drill nodes restored into: agents registered under this "
        "name, with a restore_dir. Never a cluster this policy backs up (a drill removes what "
        "it restored there)."
    )
    backup: Literal["latest", "random"] = Field(
        "latest",
        description="Which backup: latest (the newest complete one) or random (any complete "
        "one of the last within_days, chains included: older backups are proven too).",
    )
    within_days: int = Field(
        7, ge=1, le=3660, strict=True, description="backup: random picks among these days."
    )
    # A tuple: policies are hashed (cached forecasts), and a list cannot be.
    validation_queries: Annotated[tuple[str, ...], AfterValidator(_validation_queries)] = Field(
        (),
        json_schema_extra={"shown_type": "list of SQL"},
        description="Read-only queries each restored shard must answer true, e.g. "
        "'SELECT count(*) > 0 FROM orders', besides the engine's own checks.",
    )
    keep_minutes: int = Field(
        60,
        ge=0,
        le=7 * 24 * 60,
        strict=True,
        description="How long the validated copy stays up for a person to look at before it is "
        "torn down; 0: at once.",
    )
    rto_target_minutes: float | None = Field(
        None,
        gt=0,
        strict=True,
        description="The recovery time objective: a drill whose restore (start to validated) "
        "takes longer fails and notifies; null: recorded, never alarmed.",
    )
    from_vault: Annotated[str, AfterValidator(target_name)] | None = Field(
        None,
        description="The vault target the drill restores from (vault.name, or a copy's name), "
        "so that copy is proven by a restore; null: the stack vault once promoted.",
    )

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    def fires(self, start: datetime, end: datetime) -> Iterator[datetime]:
        """Drill times in ``(start, end]``, in order."""
        times = croniter(self.cron, start.astimezone(self.zone))
        while (at := times.get_next(datetime)) <= end:
            yield at

    def longest_gap_hours(self) -> float:
        """The longest wait between two drills over a year (as ``Schedule``'s)."""
        start = datetime(2026, 1, 1, tzinfo=self.zone)
        times = list(self.fires(start, start + timedelta(days=366)))[:GAP_SAMPLE]
        gaps = [(b - a).total_seconds() / 3600 for a, b in pairwise(times)]
        return max(gaps, default=366 * 24.0)


class ClusterPolicy(Frozen):
    engine: Annotated[Engine | list[Engine], BeforeValidator(_engines)] = Field(
        description="Database engine of the cluster: postgres, mariadb, sqlite, rocksdb or "
        "hooks; every node must run it. A list (e.g. [postgres, rocksdb]) lets the cluster's "
        "nodes run any of those engines: a backup records each shard's engine, and a restore "
        "places each shard on a target node of that engine.",
        json_schema_extra={
            "shown_type": "sqlite | postgres | mariadb | rocksdb | hooks, or a list"
        },
    )
    schedule: Schedule = Field(description="When backups run.")
    vault: Vault = Field(description="Where verified backups land and how they are locked.")
    retention: Retention = Field(description="Which backups are kept; the rest expire.")
    upload: Upload = Field(default_factory=Upload, description="How agents upload.")
    compression: Compression = Field(
        default_factory=Compression, description="How backups are compressed."
    )
    incremental: Incremental = Field(
        default_factory=Incremental, description="How incremental backups chain."
    )
    archive: Archive = Field(
        default_factory=Archive, description="How agents archive WAL continuously."
    )
    cut: Cut = Field(
        default_factory=Cut,
        description="How a backup cuts every node at one instant, and how often the cut is "
        "also taken on its own (scheduled cuts).",
    )
    encryption: Literal["none", "kms"] = Field(
        "none",
        description="kms: agents seal every frame with AES-256-GCM under a data key wrapped by "
        "the deployment's KMS key, with an encryption context naming the cluster (a reader of "
        "the bucket sees no plaintext); none: frames are stored as compressed.",
    )
    budget_usd_per_month: float | None = Field(
        None, gt=0, strict=True, description="Monthly budget in USD; null: none."
    )
    rpo_hours: float | None = Field(
        None,
        gt=0,
        strict=True,
        description="Hours the cluster may go without a new complete backup before its alarm "
        "fires (the age the watch publishes, shardvault.assurance.watch); null: the schedule's "
        "longest gap between two backups plus a quarter (30 for a nightly schedule).",
    )
    drill: Drill | None = Field(
        None,
        description="A scheduled restore drill: a backup restored into drill nodes, validated, "
        "timed and torn down (shardvault drills CLUSTER lists them); null: none.",
    )
    nodes: Annotated[list[str] | None, AfterValidator(_node_ids)] = Field(
        None,
        min_length=1,
        description="The cluster's node ids: only these agents may take part in its backups "
        "and restores, whatever cluster their configuration claims "
        "(shardvault.workflow.membership); "
        "null: any agent that registers under the cluster's name.",
    )

    @model_validator(mode="after")
    def _drill_from_a_target_of_its_own(self) -> ClusterPolicy:
        names = [self.vault.name, *(c.name for c in self.vault.copies)]
        if self.drill and self.drill.from_vault and self.drill.from_vault not in names:
            raise invalid(
                f"drill.from_vault names {self.drill.from_vault!r}, which is no vault target "
                "of this cluster",
                f"use one of {', '.join(names)} (vault.name and vault.copies), or leave it out",
            )
        return self

    @model_validator(mode="after")
    def _scheduled_cuts_of_engines_with_restore_points(self) -> ClusterPolicy:
        without = sorted(e.value for e in self.engines if "name" not in traits(e).targets)
        if self.cut.every_minutes is not None and without:
            raise invalid(
                f"cut.every_minutes asks for scheduled cuts, but {', '.join(without)} makes no "
                "restore point a restore could stop at",
                "remove cut.every_minutes for this cluster (its backups are its points)",
            )
        return self

    @model_validator(mode="after")
    def _drill_queries_read_as_the_engines_read_them(self) -> ClusterPolicy:
        """A drill's validation queries pass the gate as each of the cluster's engines lexes
        them (a database named for SQLite, one statement for one dialect and three for
        another), here rather than at every scheduled drill's admission."""
        if self.drill is not None and self.drill.validation_queries:
            dialects = [DIALECTS[e.value] for e in self.engines if e.value in DIALECTS]
            try:
                check_validation_queries(list(self.drill.validation_queries), dialects)
            except InvalidRequest as error:
                raise invalid(f"drill.validation_queries: {error.message}", error.fix) from None
        return self

    @model_validator(mode="after")
    def _copies_readable_without_the_stack(self) -> ClusterPolicy:
        """A copy out of the stack account's reach is worth little if only that account's
        KMS key unwraps it: an encrypted cluster's copy names a recovery key in its own
        account, or says by name that it accepts the stack's key."""
        for copy in self.vault.copies:
            recovery = recovery_key_of(copy)
            if self.encryption == "kms" and not (copy.stack_key_only or recovery):
                fix = (
                    "name a KMS key of account B as its recovery_key (shardvault copy-setup "
                    "prints its key policy)"
                    if isinstance(copy, AwsTarget)
                    else "set its stack_key_only: true to accept that restoring the copy needs "
                    "that key (a GCS copy takes no recovery key yet)"
                )
                raise invalid(
                    f"copy {copy.name!r} would hold backups whose data keys only the stack "
                    "account's KMS key unwraps",
                    f"{fix}, or encryption: none",
                )
            if recovery and self.encryption != "kms":
                raise invalid(
                    f"copy {copy.name!r} has a recovery_key, but the cluster's frames are not "
                    "sealed (encryption: none)",
                    "drop recovery_key, or set encryption: kms",
                )
        return self

    @property
    def engines(self) -> frozenset[Engine]:
        """The engines the cluster's nodes may run (more than one: a mixed cluster)."""
        return frozenset(self.engine if isinstance(self.engine, list) else [self.engine])


RPO_SLACK = 1.25  # the default RPO: the schedule's longest gap, and a quarter more


class Policy(Frozen):
    version: Literal[1] = Field(1, description="Format of this file; 1.")
    clusters: dict[Annotated[str, AfterValidator(_cluster_name)], ClusterPolicy] = Field(
        min_length=1, description="The clusters, by name."
    )

    @model_validator(mode="after")
    def _one_cluster_per_node(self) -> Policy:
        owners: dict[str, list[str]] = {}
        for name, cluster in self.clusters.items():
            for node in cluster.nodes or ():
                owners.setdefault(node, []).append(name)
        shared = {n: c for n, c in owners.items() if len(c) > 1}
        if shared:
            node, clusters = sorted(shared.items())[0]
            raise invalid(
                f"node {node!r} is listed under clusters {', '.join(clusters)}",
                "list each node under one cluster: a node's agent serves one cluster",
            )
        return self

    @model_validator(mode="after")
    def _drills_into_their_own_nodes(self) -> Policy:
        """A drill tears down what its target holds: never a backed-up cluster, never a target
        two drills share (one would remove the other's copy)."""
        targets: dict[str, str] = {}
        for name, cluster in sorted(self.clusters.items()):
            if cluster.drill is None:
                continue
            target = cluster.drill.target_cluster
            if target in self.clusters:
                raise invalid(
                    f"cluster {name!r} drills into {target!r}, a cluster this policy backs up",
                    "name a cluster of drill nodes only (e.g. '" + name + "-drill'): a drill "
                    "removes what it restored there",
                )
            if target in targets:
                raise invalid(
                    f"clusters {targets[target]!r} and {name!r} both drill into {target!r}",
                    "give each cluster's drill its own target_cluster",
                )
            targets[target] = name
        return self

    def rpo_hours(self, name: str) -> float:
        """The cluster's recovery point objective in hours: its ``rpo_hours``, or its
        schedule's longest gap plus a quarter (a late or retried night is not yet a miss)."""
        cluster = self.cluster(name)
        if cluster.rpo_hours is not None:
            return cluster.rpo_hours
        return math.ceil(cluster.schedule.longest_gap_hours() * RPO_SLACK)

    def cluster_of(self, node_id: str) -> str | None:
        """The cluster whose ``nodes`` list the node (None: no cluster lists it)."""
        return next((n for n, c in self.clusters.items() if node_id in (c.nodes or ())), None)

    def cluster(self, name: str) -> ClusterPolicy:
        if name not in self.clusters:
            raise PolicyError(
                f"the policy declares no cluster {name!r}.",
                fix=f"use one of {', '.join(sorted(self.clusters))}, or declare it under clusters.",
            )
        return self.clusters[name]


# --- Loading -----------------------------------------------------------------------------------
class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses a key given twice (PyYAML silently keeps the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # SafeLoader reports it
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_policy(path: Path | str) -> Policy:
    """Reads and validates a policy file; raises ``PolicyError`` naming every problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise PolicyError(
            f"policy file {path} cannot be read: {error.strerror}.",
            fix="pass the path of an existing, readable policy file (see "
            "examples/shardvault.yaml).",
        ) from None
    except UnicodeDecodeError as error:
        raise PolicyError(
            f"policy file {path} is not UTF-8 text (byte {error.start} is not).",
            fix="pass the YAML policy file itself, saved as UTF-8 (see examples/shardvault.yaml).",
        ) from None
    return parse_policy(text, source=str(path))


def parse_policy(text: str, *, source: str = "policy") -> Policy:
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no arbitrary objects
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error)
        raise PolicyError(
            f"{source} is not valid YAML{where}: {problem}.", fix="correct the YAML there."
        ) from None
    if not isinstance(data, dict):
        raise PolicyError(
            f"{source} holds no mapping of fields.",
            fix="start the file with 'clusters:' (see examples/shardvault.yaml).",
        )
    try:
        return Policy.model_validate(data)
    except ValidationError as error:
        problems = [_problem(item) for item in error.errors()]
        lines = "\n".join(f"- {p.path}: {p.message}. Fix: {p.fix}." for p in problems)
        raise PolicyError(
            f"{source} has {len(problems)} invalid field(s):\n{lines}\n",
            fix="correct each field named above.",
            problems=problems,
        ) from None


# --- Problems: a field path, what is wrong, and how to fix it -----------------------------------
def _problem(error: Any) -> Problem:
    loc = _without_tags([str(part) for part in error["loc"]])
    if error["type"] in ("union_tag_invalid", "union_tag_not_found"):  # the kind is the field
        loc.append(str(error["ctx"]["discriminator"]).strip("'"))
    is_key = loc[-1:] == ["[key]"]
    loc = loc[:-1] if is_key else loc
    path = ".".join(loc) or "(top level)"
    info = None if is_key else _field_at(loc)
    message = "unknown field" if error["type"] == "extra_forbidden" else error["msg"]
    if error["type"] not in ("missing", "extra_forbidden", "policy") and not is_key:
        message += f", got {_short(error['input'])}"
    fix = _fix(error, info, loc)
    if info is not None and info.description and error["type"] != "extra_forbidden":
        fix += f" ({loc[-1]}: {info.description.rstrip('.')})"
    name = path + (" (the name)" if is_key else "")
    return Problem(path=name, message=message.rstrip("."), fix=fix.rstrip("."))


def _fix(error: Any, info: FieldInfo | None, loc: list[str]) -> str:
    ctx, kind, leaf = error.get("ctx", {}), error["type"], (loc[-1] if loc else "")
    if kind == "policy":
        return ctx["fix"]
    if kind == "missing":
        return f"add {leaf}"
    if kind == "extra_forbidden":
        model = _model_at(loc[:-1])
        known = list(model.model_fields) if model else []
        guess = difflib.get_close_matches(leaf, known, n=1)
        meant = f": did you mean {guess[0]}?" if guess else ""
        names = f" (known here: {', '.join(known)})" if known else ""
        return f"remove {leaf} or correct its spelling{meant}{names}"
    if kind in ("enum", "literal_error"):
        return f"use one of {ctx['expected']}"
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        return f"use one of {ctx['expected_tags']}"
    limits = {"ge": "at least", "gt": "more than", "le": "at most", "lt": "less than"}
    for key, words in limits.items():
        if key in ctx:
            return f"use a value {words} {ctx[key]}"
    if kind.startswith(("int_", "float_")):
        return "write a number without quotes" + (", a whole one" if kind.startswith("int") else "")
    if kind == "too_short":
        return f"give at least {ctx.get('min_length', 1)} entry"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"write {leaf} as a mapping of fields"
    if kind == "string_type":
        return "write it as text (quote it)"
    return "see the field's description"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _without_tags(loc: list[str]) -> list[str]:
    """A field path as pydantic reports it, less the kind it inserts after a list index of
    kinds (``vault.copies.0.gcs.bucket``): the file has no such level."""
    return [
        part
        for index, part in enumerate(loc)
        if not (
            index >= 2
            and loc[index - 1].isdigit()
            and part in _members(_list_item(loc[: index - 1]))
        )
    ]


def _list_item(loc: list[str]) -> Any:
    """The item annotation of the list field at ``loc`` (None when it is none)."""
    parent = _model_at(loc[:-1]) if loc else None
    info = parent.model_fields.get(loc[-1]) if parent else None
    annotation = _inner(info.annotation) if info else None
    return get_args(annotation)[-1] if get_origin(annotation) is list else None


def _members(annotation: Any) -> dict[str, type[BaseModel]]:
    """A union of models told apart by ``kind``: each member by its kind (else {})."""
    annotation = _inner(annotation) if annotation is not None else None
    if get_origin(annotation) not in (Union, types.UnionType):
        return {}
    members = {}
    for member in get_args(annotation):
        kind = member.model_fields.get("kind") if _is_model(member) else None
        for value in get_args(kind.annotation) if kind else ():
            members[str(value)] = member
    return members


def _model_at(loc: list[str]) -> type[BaseModel] | None:
    """The model found by walking ``Policy`` along a field path (None where there is none);
    at a list of kinds, the next part after the index names the kind."""
    model: type[BaseModel] | None = Policy
    parts = iter(loc)
    for part in parts:
        info = model.model_fields.get(part) if model else None
        if info is None:
            return None
        annotation = _inner(info.annotation)
        if get_origin(annotation) in (dict, list):
            if next(parts, None) is None:  # skip the key (a cluster's name) or the index
                return None
            annotation = _inner(get_args(annotation)[-1])
            if members := _members(annotation):
                annotation = members.get(next(parts, ""))
        is_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        model = annotation if is_model else None
    return model


def _field_at(loc: list[str]) -> FieldInfo | None:
    parent = _model_at(loc[:-1]) if loc else None
    return parent.model_fields.get(loc[-1]) if parent else None


def _inner(annotation: Any) -> Any:
    """``X`` for ``X | None``; the annotation itself otherwise."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        annotation = args[0] if len(args) == 1 else annotation
    return get_args(annotation)[0] if get_origin(annotation) is Annotated else annotation


# --- Documentation -----------------------------------------------------------------------------
class FieldRow(NamedTuple):
    path: str
    type: str
    default: str  # in YAML spelling; "" when the field is required
    description: str


def fields_table() -> str:
    """The table of every field in docs/reference/policy.md (``scripts/policy_table.py``)."""
    lines = ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    for row in describe_fields():
        default = f"`{row.default}`" if row.default else "required"
        cells = [f"`{row.path}`", row.type.replace(" | ", " or "), default, row.description]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def describe_fields(model: type[BaseModel] = Policy, prefix: str = "") -> list[FieldRow]:
    """Every field of the policy file, depth first, for the reference's table."""
    rows: list[FieldRow] = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        annotation = _inner(info.annotation)
        rows.append(FieldRow(path, _type_name(info), _default(info), info.description or ""))
        if get_origin(annotation) is dict:
            rows += describe_fields(get_args(annotation)[1], f"{path}.<name>.")
        elif get_origin(annotation) is list and _is_model(get_args(annotation)[0]):
            rows += describe_fields(get_args(annotation)[0], f"{path}[].")
        elif get_origin(annotation) is list and (members := _members(get_args(annotation)[0])):
            for kind, member in members.items():  # each kind's fields, kind and all
                rows += describe_fields(member, f"{path}[kind={kind}].")
        elif _is_model(annotation):
            rows += describe_fields(annotation, f"{path}.")
    return rows


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _type_name(info: FieldInfo) -> str:
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    optional = _inner(info.annotation) is not info.annotation
    annotation = _inner(info.annotation)
    if "shown_type" in extra:
        name = str(extra["shown_type"])
    elif isinstance(annotation, type) and issubclass(annotation, Enum):
        name = " | ".join(str(member.value) for member in annotation)
    elif get_origin(annotation) is Literal:
        name = " | ".join(str(a) for a in get_args(annotation))
    elif get_origin(annotation) is dict or _is_model(annotation):
        name = "mapping"
    elif get_origin(annotation) is list and (
        _is_model(get_args(annotation)[0]) or _members(get_args(annotation)[0])
    ):
        name = "list of mappings"
    else:
        name = getattr(annotation, "__name__", str(annotation))
    bounds = [
        f"{sign} {getattr(item, attr)}"
        for item in info.metadata
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
        if getattr(item, attr, None) is not None
    ]
    return " ".join([name, ", ".join(bounds)]).strip() + (" | null" if optional else "")


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return ""
    if info.default_factory is list:
        return "[]"
    if info.default_factory is not None:
        return "{}"  # a mapping whose fields all take their defaults
    value = info.default
    if value is None:
        return "null"
    if value == ():
        return "[]"  # a tuple read from a YAML list
    return str(value.value if isinstance(value, Enum) else value)
