"""The catalog's items: one model per kind, used by every reader and writer of the table.

The catalog table (``shardvault.aws.tables.Catalog``) holds, per cluster:

- *backup items*, keyed by the backup's id (``BackupItem``);
- *restore items*, keyed ``restore#<restore id>`` under the target cluster (``RestoreItem``);
- *drill items*, keyed ``drill#<drill id>`` under the drilled cluster (``DrillItem``);
- *cut items*, keyed ``cut#<cut id>`` under the cut cluster (``CutItem``): a scheduled cut's
  restore points (``shardvault.wal.cuts``);
- the cluster's *lock* while a backup runs (``LockItem``) and its WAL archive's counters
  (``ArchiveTotals``).

An item grows as its workflow runs: each step writes its fields through ``Kind.changes(...)``,
which checks every name and value against the model before anything is written. A misspelt
field, or a value of the wrong type, fails the step that wrote it, not the reader a week
later.

An item read back drops the fields this release does not know (an older release's), so an
upgrade never stops a reader. The catalog indexes the manifests in the store; it is never the
only copy of anything.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from shardvault.contracts.commands import RestoredShard
from shardvault.contracts.models import BackupKind, BackupStatus, ThrottleReport

log = logging.getLogger("shardvault.contracts.catalog")

RESTORE_PREFIX = "restore#"  # restore items share the table, under the target cluster
DRILL_PREFIX = "drill#"  # drill items, under the drilled cluster
CUT_PREFIX = "cut#"  # scheduled cuts, under the cut cluster; sorts after every backup id
ARCHIVE_KEY = "#archive"  # a cluster's WAL archive, counted as it is recorded (the cost model)

EXPIRING, EXPIRED = BackupStatus.EXPIRING, BackupStatus.EXPIRED
DrillStatus = Literal["running", "passed", "slow", "failed", "refused"]
CutStatus = Literal["complete", "failed"]


@dataclass(frozen=True)
class Changes:
    """Fields to set on one item, each checked against its kind's model (``changes``)."""

    kind: type[CatalogItem]
    values: Mapping[str, object]  # as stored: JSON types (Decimals are the table's business)


class CatalogItem(BaseModel):
    """What every item has: its cluster (the partition) and its key within it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cluster: str
    backup_id: str  # the table's sort key: a backup's id, or a restore's or drill's key

    @classmethod
    def from_item(cls, item: Mapping[str, object]) -> Self:
        """The item as the table returned it (plain numbers), without fields this release
        does not know."""
        unknown = sorted(set(item) - set(cls.model_fields))
        if unknown:
            log.debug("%s %s: fields ignored: %s", cls.__name__, item.get("backup_id"), unknown)
        return cls.model_validate({k: v for k, v in item.items() if k in cls.model_fields})

    @classmethod
    def changes(cls, **fields: object) -> Changes:
        """Fields to set on an item of this kind, checked now: an unknown name or a value of
        the wrong type raises ``ValueError`` naming the field."""
        keys = set(CatalogItem.model_fields)
        values: dict[str, object] = {}
        for name, value in fields.items():
            if name in keys or name not in cls.model_fields:
                raise ValueError(f"{cls.__name__} has no field {name!r} to set")
            adapter = _field_adapter(cls, name)
            try:
                checked = adapter.validate_python(value)
            except ValidationError as error:
                problem = error.errors()[0]["msg"]
                raise ValueError(f"{cls.__name__}.{name} cannot be {value!r}: {problem}") from None
            values[name] = adapter.dump_python(checked, mode="json")
        return Changes(cls, values)

    def stored(self) -> dict[str, object]:
        """The item as written: JSON types, unset (None) fields left out."""
        return self.model_dump(mode="json", exclude_none=True)


@cache
def _field_adapter(kind: type[CatalogItem], name: str) -> TypeAdapter[object]:
    field = kind.model_fields[name]
    annotation = (
        Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation
    )
    return TypeAdapter(annotation)


class Outcome(CatalogItem):
    """The fields every operation's item shares: how it ran and how it ended."""

    status: BackupStatus  # a restore's: RUNNING, COMPLETE or FAILED
    started_at: float = 0.0
    execution_id: str = ""
    requested_by: str = ""
    engine: str = ""
    completed_at: float | None = None
    duration_seconds: float | None = None
    failed_at: float | None = None
    error: str | None = None
    cause: str | None = None
    # Progress while it runs (``Catalog.add_progress``): what the CLI's bar shows.
    bytes_done: int = 0
    objects_done: int = 0
    bytes_total: int | None = None
    objects_total: int | None = None


# --- backups ---------------------------------------------------------------------------------
class WalRange(BaseModel):
    """The WAL archive a verify read for one shard (``shardvault.assurance.verify``)."""

    model_config = ConfigDict(
        frozen=True, extra="forbid", populate_by_name=True, serialize_by_alias=True
    )

    first: str = Field(alias="from")
    last: str = Field(alias="to")
    batches: int
    log: str = "WAL"  # how messages name the engine's log: WAL, binary log


class VerifyRecord(BaseModel):
    """The last verify of a backup's chain, as ``show`` prints it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    verified_at: float
    result: Literal["ok", "damaged"]
    objects: int
    read: int
    skipped: int
    covered: list[str] = Field(default_factory=list)
    wal_archive: dict[str, WalRange] = Field(default_factory=dict)
    problems: list[str] = Field(default_factory=list)
    more_problems: int = 0


class CopyRecord(BaseModel):
    """A backup's copy in one vault target beyond the stack's vault (``vault.copies``), as
    read back from that provider (``shardvault.lifecycle.copies``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    state: Literal["COPIED", "FAILED", "SKIPPED"]
    kind: Literal["gcs", "aws"] = "gcs"
    reason: str | None = None  # why it was skipped, or what failed
    bucket: str | None = None
    manifest_key: str | None = None
    # The manifest a restore reads: its GCS generation, or its S3 version id (an aws target).
    manifest_generation: str | None = None
    storage_class: str | None = None
    retention_mode: str | None = None  # the weakest any object holds: Locked, COMPLIANCE
    retain_until: str | None = None  # ISO 8601, the earliest any object holds
    objects: int | None = None
    bytes: int | None = None
    # What the provider proved: GCS, every object's CRC32C and MD5 equal those of the bytes
    # whose CRC64NVME is the manifest's; S3 in account B, the manifest's CRC64NVME itself.
    proof: str | None = None
    copied_at: float | None = None
    seconds: float | None = None  # spent copying, over every budgeted call
    verified_at: float | None = None  # the last ``verify --from-vault`` of this copy
    verify: Literal["ok", "damaged"] | None = None
    # The KMS key the copy's manifest wraps its data key under, as read back from the written
    # manifest: a recovery key in the target's account, or the stack's (stack_key_only); None:
    # unsealed frames, or a copy made before this was recorded.
    data_key: str | None = None


class BackupItem(Outcome):
    """A backup: written at admission (RUNNING), grown by each phase's plan, completed by
    finalize, moved by promotion, verify and retention."""

    kind: BackupKind = BackupKind.FULL
    nodes: list[str] = Field(default_factory=list)
    shards: list[str] = Field(default_factory=list)
    # What cleanup needs after an execution that never reached its failure path
    # (``BackupContext``, as JSON).
    context: str | None = None
    # Its chain (``shardvault.backup.admission.chain_fields``): a full is its own root.
    parent_id: str | None = None
    depth: int = 0
    chain_root: str | None = None
    ancestors: list[str] = Field(default_factory=list)
    # A synthesized full (``shardvault.backup.synthesis``): the backup whose chain it copied,
    # and how many fulls in a row its chain's were synthesized (0: read from the database).
    synthesized_from: str | None = None
    synthesized_in_row: int = 0
    full_reason: str | None = None  # why a full the policy would synthesize was read
    synthesis_objects: int | None = None  # the chain's objects a synthesized full copies
    synthesis_copied: int | None = None  # of them, copied and verified so far
    # Promotion kept the staging copy: the next synthesized full copies this chain from it.
    staging_kept: bool = False
    # Each phase's plan (``shardvault.backup.planner``).
    part_size: int | None = None
    data_bytes: int | None = None
    data_blockmap_bytes: int | None = None
    data_objects: int | None = None
    data_read_bytes: int | None = None
    data_packed: bool | None = None
    data_screened_bytes: int | None = None
    tail_bytes: int | None = None
    tail_blockmap_bytes: int | None = None
    tail_objects: int | None = None
    tail_read_bytes: int | None = None
    read_bytes: int | None = None  # what the agents read from the databases
    checkpoint_skew_seconds: float | None = None
    # The cluster's cut (``shardvault.contracts.cut``): None where no shard cut.
    cut_name: str | None = None
    cut_skew_seconds: float | None = None
    cut_late_seconds: float | None = None
    cut_shards: int | None = None
    cut_paused: bool | None = None
    cut_pause_seconds: float | None = None
    # Reported by the agents as they packed (``Catalog.add_progress``).
    throttle: ThrottleReport | None = None
    held_log_bytes: int | None = None
    # Finalize: the manifest's summary (``shardvault.backup.manifest``).
    bytes: int | None = None  # the streams' bytes sent (an incremental's: its changes)
    stored_bytes: int | None = None  # in the store: compressed, with block maps
    pack_cpu_seconds: float | None = None  # the agents' (``Manifest.pack_cpu_seconds``)
    frame_levels: dict[int, int] | None = None  # frames per zstd level
    format: int | None = None
    objects: int | None = None
    blockmap_objects: int | None = None
    parts: int | None = None
    wal_from: dict[str, str] = Field(default_factory=dict)
    verification: str | None = None
    manifest_key: str | None = None
    throughput_mib_s: float | None = None
    estimated_storage_usd_per_month: float | None = None
    estimated_overhead_usd: float | None = None
    # The failure path's cleanup.
    aborted_uploads: int | None = None
    deleted_objects: int | None = None
    # Promotion into the vault: read back from the vault, never copied from the request.
    location: Literal["vault"] | None = None
    vault_manifest_key: str | None = None
    vault_manifest_version: str | None = None
    storage_class: str | None = None
    lock_mode: str | None = None
    retain_until: str | None = None  # ISO 8601, the earliest any of its copies holds
    promoted_at: float | None = None
    vault_copies: dict[str, CopyRecord] = Field(default_factory=dict)  # by target name
    staging_left: int | None = None
    # FAILED: not in the stack vault; PARTIAL: there, but a copy target failed.
    promotion: Literal["FAILED", "PARTIAL"] | None = None
    promotion_error: str | None = None
    promotion_cause: str | None = None
    promotion_failed_at: float | None = None
    # Verify and retention.
    verified_at: float | None = None
    verify: VerifyRecord | None = None
    held_until: str | None = None  # ISO 8601: retention expired it, its class's minimum holds it
    held_for: str | None = None
    expiring_at: float | None = None
    expired_at: float | None = None

    @property
    def is_incremental(self) -> bool:
        return self.kind == BackupKind.INCREMENTAL


def recorded_stored_bytes(record: BackupItem) -> int:
    """What the store holds for a backup (compressed, sealed): its ``stored_bytes``; items of
    backups made before compression hold only ``bytes``."""
    return record.stored_bytes or record.bytes or 0


# --- restores --------------------------------------------------------------------------------
class RestoreItem(Outcome):
    """A restore, under its target cluster (key ``restore#<restore id>``)."""

    restore_id: str
    source_cluster: str
    source_backup_id: str
    source: str | None = None  # where it was read: store, vault or copy:NAME
    placement: dict[str, str] = Field(default_factory=dict)  # shard -> node
    frozen: int | None = None  # objects a thaw found in a cold class
    bytes: int | None = None
    objects: int | None = None
    throughput_mib_s: float | None = None
    shards: list[RestoredShard] = Field(default_factory=list)
    validation: Literal["passed", "failed"] | None = None
    # A point-in-time restore: the archive batches planned for it, and those its nodes fed
    # recovery (it fetches only what recovery reaches, and a few batches ahead).
    wal_batches: int | None = None
    wal_batches_fetched: int | None = None
    wal_bytes_fetched: int | None = None
    wal_stored_bytes_fetched: int | None = None


def kind_of(key: str) -> type[CatalogItem]:
    """The kind of item a catalog sort key holds: ``#archive`` the archive's counters, other
    ``#`` keys a lock, ``restore#``, ``drill#`` and ``cut#`` theirs, anything else a backup."""
    if key == ARCHIVE_KEY:
        return ArchiveTotals
    if key.startswith("#"):
        return LockItem
    if key.startswith(RESTORE_PREFIX):
        return RestoreItem
    if key.startswith(DRILL_PREFIX):
        return DrillItem
    if key.startswith(CUT_PREFIX):
        return CutItem
    return BackupItem


def restore_key(restore_id: str) -> str:
    return f"{RESTORE_PREFIX}{restore_id}"


# --- drills ----------------------------------------------------------------------------------
class DrillItem(CatalogItem):
    """A restore drill, under the drilled cluster (key ``drill#<drill id>``)."""

    drill_id: str
    status: DrillStatus
    started_at: float
    requested_by: str = ""
    execution_id: str = ""
    target_cluster: str | None = None
    source_backup_id: str | None = None
    source_kind: BackupKind | None = None
    restore_execution: str | None = None
    keep_seconds: int | None = None
    rto_target_seconds: float | None = None
    # The verdict (``shardvault.assurance.drills.record``).
    validated_at: float | None = None
    rto_seconds: float | None = None
    restore_seconds: float | None = None
    bytes: int | None = None
    shards: int | None = None
    checks_passed: int | None = None
    failed_at: float | None = None
    error: str | None = None
    cause: str | None = None
    restore_id: str | None = None
    nodes: list[str] = Field(default_factory=list)
    torn_down_at: float | None = None


def drill_key(drill_id: str) -> str:
    return f"{DRILL_PREFIX}{drill_id}"


# --- scheduled cuts ----------------------------------------------------------------------------
class CutShardPoint(BaseModel):
    """Where one shard's restore point of a cut is: its node, its LSN, the WAL segment that
    holds it (archived: the cut can be restored to), when its server made it."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    node_id: str
    lsn: str
    wal: str
    at: float
    late_seconds: float = 0.0


class CutItem(CatalogItem):
    """A scheduled cut (``shardvault.wal.cuts``), under the cut cluster (key ``cut#<cut id>``):
    written once, when every node answered (complete) or one failed (failed)."""

    cut_id: str
    status: CutStatus
    requested_by: str = ""
    execution_id: str = ""
    instant: float  # the cut instant every node aimed at (epoch seconds)
    commit_lock: int | None = None
    database: str | None = None
    nodes: list[str] = Field(default_factory=list)
    shards: dict[str, CutShardPoint] = Field(default_factory=dict)
    cut_skew_seconds: float | None = None
    cut_late_seconds: float | None = None
    cut_paused: bool | None = None
    cut_pause_seconds: float | None = None
    completed_at: float | None = None
    error: str | None = None
    cause: str | None = None

    @property
    def best_effort(self) -> bool:
        """Asked to pause the commits and did not get the pause on every node."""
        return self.commit_lock is not None and not self.cut_paused


def cut_key(cut_id: str) -> str:
    return f"{CUT_PREFIX}{cut_id}"


# --- the cluster's lock and archive ------------------------------------------------------------
class LockItem(CatalogItem):
    """Who holds a cluster's lock (the backup lock, or a drill target's)."""

    holder: str
    execution_id: str
    locked_at: float = 0.0


class ArchiveTotals(CatalogItem):
    """A cluster's WAL archive, counted as batches are recorded (the cost model's input)."""

    stored_bytes: int = 0
    wal_bytes: int = 0
    batches: int = 0
    first_at: float | None = None
    last_at: float | None = None
