"""The data that crosses process boundaries: requests, node records, listings, plans, manifests.

Terms:
- *cluster*: a set of nodes backed up together; *node*: one database host running an agent.
- *shard*: a unit of data with one leader and optional followers; one source is read per shard.
- *listing*: the files of one shard at a checkpoint, in a fixed order, with their sizes.
- *stream*: the concatenation of a listing's files in that order. Objects are contiguous byte
  ranges of a stream, so many small files pack into one object and a large file may span
  objects. A shard has two streams: ``data`` (captured at the checkpoint) and ``tail`` (what
  the engine hands over when the checkpoint stops, e.g. PostgreSQL's backup label and WAL).
- *manifest*: the self-describing record of a verified backup, stored beside its objects. It
  is the source of truth; the catalog table is only an index of manifests.
"""

from __future__ import annotations

import base64
import difflib
import gzip
import json
import re
import secrets
import time
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    field_validator,
    model_validator,
)

from shardvault.contracts.lognames import BINLOG_FILE
from shardvault.contracts.pgwal import LSN, check_restore_point_name
from shardvault.contracts.sqlcheck import check_validation_queries
from shardvault.errors import InvalidRequest
from shardvault.pricing.prices import VAULT_CLASSES, StorageClass

NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
# 2: objects hold frames (``shardvault.data.pipeline``): compressed, checked per frame. Format 1
# objects hold the stream's bytes as they are; restores read both. 3: block maps per shard,
# kind and chain (incrementals). 4: synthesized fulls (``ManifestStream.layers``).
MANIFEST_FORMAT = 4
# A zstd level, or "auto": per stretch of frames, level 1 or 3 by measurement
# (``shardvault.data.levels``). bench/compression_levels.py: on pgbench data after updates
# level 3 stores 6 % less than level 1 for 30 % more CPU; on data nobody tuned for it stores
# 1.7 % more at a third of level 1's speed. No one fixed level fits both.
CompressionLevel = Annotated[int, Field(ge=-7, le=19, strict=True)] | Literal["auto"]
DEFAULT_COMPRESSION_LEVEL: CompressionLevel = "auto"
DEFAULT_UPLOAD_MIB_S = 120  # about a gigabit link's worth


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def check_name(kind: str, value: str) -> str:
    if not NAME_PATTERN.match(value):
        raise InvalidRequest(
            f"{kind} {value!r} is not a valid name.",
            fix=f"use 1-63 characters of a-z, 0-9, '.', '_' or '-' for the {kind}, "
            "starting with a letter or digit.",
        )
    return value


# A cluster's name in a request: refused as InvalidRequest (with its fix) when malformed.
ClusterName = Annotated[str, AfterValidator(lambda value: check_name("cluster", value))]


# --- Doorbells: one SQS queue per node (agents/shardvault_agent/doorbell.py) ------------------
DOORBELL_PREFIX = "shardvault-doorbell-"
SQS_QUEUE_NAME = re.compile(r"^[A-Za-z0-9_-]{1,80}$")  # SQS's rule for queue names


def doorbell_name(node_id: str) -> str | None:
    """The name of the node's doorbell queue: the prefix and the node id, which is unique in a
    deployment and is the tag that confines an agent's IAM access to its own queue. None
    when the node id cannot be part of a queue name (a '.' or more than 60 characters): that
    node's agent has no doorbell and polls its inbox."""
    name = DOORBELL_PREFIX + node_id
    return name if SQS_QUEUE_NAME.match(name) else None


class Role(StrEnum):
    LEADER = "leader"
    FOLLOWER = "follower"


class Phase(StrEnum):
    DATA = "data"
    TAIL = "tail"
    BLOCKMAP = "blockmap"  # the shard's block map file: one object, never placed by a restore
    # A point-in-time restore's WAL from the archive (shardvault.wal.archive): its batches, placed
    # beside the restored data for the recovery's restore_command. Never in a manifest.
    WAL = "wal"


class Engine(StrEnum):
    SQLITE = "sqlite"
    POSTGRES = "postgres"
    MARIADB = "mariadb"
    ROCKSDB = "rocksdb"
    HOOKS = "hooks"  # command hooks: any other store (shardvault_agent.engines.hooks)


class BackupKind(StrEnum):
    FULL = "full"
    INCREMENTAL = "incremental"


class BackupStatus(StrEnum):
    RUNNING = "RUNNING"
    COMPLETE = "COMPLETE"
    FAILED = "FAILED"
    REFUSED = "REFUSED"  # a scheduled run that validation refused: it never started
    EXPIRING = "EXPIRING"  # retention began deleting it: the next run finishes if this one stops
    EXPIRED = "EXPIRED"


def id_second(now: float) -> str:
    """The UTC second an id begins with (``20261129T061235Z``): ids sort by time."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))


def new_backup_id(now: float) -> str:
    """A backup's id: its start time in UTC (so ids sort by time) and a random suffix."""
    return id_second(now) + "-" + secrets.token_hex(3)


# A scheduled cut's id is its restore point's name: ``cut-<UTC second>-<random>``. It never
# looks like a backup's id (a digit first), so a restore to a name cannot take one for the
# other (``shardvault.backup.cuts``).
CUT_ID_PREFIX = "cut-"


def new_cut_id(now: float) -> str:
    return CUT_ID_PREFIX + new_backup_id(now)


def is_cut_id(name: str) -> bool:
    return name.startswith(CUT_ID_PREFIX)


class Registered(BaseModel):
    """What an agent writes to the node registry. Control planes older and newer than the
    agent read it, so a field this release does not know (from a newer agent) is ignored rather
    than refused: upgrading the agents first must not stop every backup."""

    model_config = ConfigDict(frozen=True, extra="ignore")


class ShardInfo(Registered):
    shard_id: str
    role: Role
    bytes: int = 0
    # Why the agent cannot back this shard up now (its engine's check), e.g. a database file
    # that disappeared after the agent started, or a server without a free replication slot:
    # validation refuses the backup by name. ``problem_error``: the check's error class
    # (ShardDataMissing, EngineError; None from an agent too old to say).
    problem: str | None = None
    problem_error: str | None = None
    # Continuous archiving (shardvault_agent.wal.archiver): the WAL waiting in the shard's spool
    # at the heartbeat, and how long its oldest file had waited (None: no spool).
    wal_spool_bytes: int | None = None
    wal_spool_oldest_seconds: float | None = None

    def spool_stalled_for(self, now: float, heartbeat_at: float) -> float:
        """How long the spool's oldest file has waited by ``now`` (0: an empty spool)."""
        if not self.wal_spool_bytes or self.wal_spool_oldest_seconds is None:
            return 0.0
        return self.wal_spool_oldest_seconds + max(0.0, now - heartbeat_at)


# A node is silent once its agent has missed this many of the heartbeats it promised.
HEARTBEAT_MISSES = 3

# The agent protocol this control plane needs: an agent registers the one it speaks
# (``NodeRecord.protocol``; shardvault_agent.PROTOCOL), and backups and restores refuse an
# agent that speaks an older one (``AgentOutdated``) before any side effect. Raise it when a
# command changes in a way an older agent would fail on. 1: an object of one part is sent by
# one presigned PUT (a transfer without an upload id). 2: the upload limits' throttle may be
# ``auto``. 3: a download item may name the vault version it reads (``version_id``), and a
# cut the database its commit lock lives in (``CutRequest.database``). 4: every listing
# answer goes through its answer URL, a parent map names its node, a chain is always layered
# (``contracts.commands``: the agent no longer reads what older control planes sent). 5: a
# point-in-time restore's archive batches come with finish, fed as recovery replays
# (``FinishRestoreArgs.wal``), not through the Download map. 6: a restore's layout may link
# a shard's directories elsewhere (tablespaces: ``ShardLayout.links``) and name what a replay
# may create (``Recovery.created_links``), a MariaDB recovery replays its binary logs
# (``Recovery.target_position``), and an archive batch says its log kind and links
# (``Batch.kind``, ``Batch.links``), which a control plane of protocol 5 refuses. 7: the
# ``cut`` command (scheduled cuts); only a cut needs it (``backup.cuts.CUT_PROTOCOL``), so
# backups and restores still take agents of 6.
AGENT_PROTOCOL = 6


class NodeRecord(Registered):
    """What an agent registers about its node, refreshed by each heartbeat.

    ``heartbeat_every``: the heartbeat period the agent promised with this heartbeat (short
    while busy, long while idle; 0 from an agent too old to say). ``doorbell``: the URL of the
    node's doorbell queue, None when the agent has none (it then polls its inbox).
    ``protocol``: the agent protocol the agent speaks (:data:`AGENT_PROTOCOL`; 0 from an agent
    too old to say)."""

    node_id: str
    cluster: str
    engine: Engine
    shards: list[ShardInfo]
    free_bytes: int
    version: str
    heartbeat_at: float
    status: str = "up"  # "up" while the agent runs, "stopped" after a clean shutdown
    # Restores: room for restored shards (None: this node accepts no restores), and the
    # shard directories its restore_dir already holds.
    restore_free_bytes: int | None = None
    restore_occupied: list[str] = Field(default_factory=list)
    heartbeat_every: Annotated[float, Field(ge=0)] = 0.0
    doorbell: str | None = None
    protocol: Annotated[int, Field(ge=0)] = 0

    def is_silent(self, now: float, max_age: float) -> bool:
        """Whether the agent has not heartbeated for longer than ``max_age`` seconds and than
        ``HEARTBEAT_MISSES`` of the periods it promised: an idle agent heartbeats rarely
        (``idle_heartbeat_seconds``) and is not silent for that. The one rule for silence."""
        return now - self.heartbeat_at > max(max_age, HEARTBEAT_MISSES * self.heartbeat_every)

    def is_unavailable(self, now: float, max_age: float) -> bool:
        """Stopped, or silent: a node a backup cannot use (validation refuses it, the watch
        counts it)."""
        return self.status != "up" or self.is_silent(now, max_age)

    @property
    def is_outdated(self) -> bool:
        """Whether the agent speaks an older protocol than this control plane needs."""
        return self.protocol < AGENT_PROTOCOL


class FileEntry(Frozen):
    path: str  # relative to the shard's root, '/'-separated; a trailing '/' is a directory
    size: Annotated[int, Field(ge=0)]

    @field_validator("path")
    @classmethod
    def _relative_inside_root(cls, value: str) -> str:
        """Paths come from agents: none may point outside the shard's root on restore."""
        parts = value.rstrip("/").split("/")
        if (
            not value
            or value.startswith("/")
            or "\\" in value
            or any(p in ("", ".", "..") for p in parts)
        ):
            raise ValueError(f"file path {value!r} is not a plain relative path")
        return value


class ShardListing(Frozen):
    """The files of one shard's stream, as the agent captured them."""

    shard_id: str
    node_id: str
    phase: Phase
    files: list[FileEntry]
    marker: dict[str, str] = Field(default_factory=dict)  # e.g. {"start_lsn": "0/2000028"}
    checkpoint_at: float = 0.0
    mutable: bool = False  # True when files may change while being read (a live data dir)
    # An incremental's data: the changed ranges the agent's scan found
    # (shardvault.contracts.extents), whose bytes (the *delta stream*) are what its objects hold.
    # "": the whole stream.
    extents: str = ""
    delta_bytes: int | None = None
    scan_seconds: float | None = None
    unchanged_bytes: int = 0  # of files the scan found unchanged by identity: not read
    screened_bytes: int = 0  # of blocks an engine's screen proved unchanged: headers read

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def sent_bytes(self) -> int:
        """The bytes its objects hold: the delta stream's, or the whole stream's."""
        return self.bytes if self.delta_bytes is None else self.delta_bytes


def pack_files(files: list[FileEntry]) -> str:
    """Compact wire form of a file list (gzip of JSON pairs, base64): task results are small.
    The same list always packs to the same text (``mtime=0``: gzip's header would otherwise
    hold the second it was made), so packed lists compare equal."""
    raw = json.dumps([[f.path, f.size] for f in files], separators=(",", ":")).encode()
    return base64.b64encode(gzip.compress(raw, compresslevel=6, mtime=0)).decode("ascii")


def unpack_files(packed: str) -> list[FileEntry]:
    return [FileEntry(path=p, size=s) for p, s in unpack_file_pairs(packed)]


def unpack_file_pairs(packed: str) -> list[tuple[str, int]]:
    """A packed file list as ``(path, size)`` pairs, unchecked: for matching files by path
    (a chain's placement), never for opening them (``FileEntry`` checks each path)."""
    return [(path, size) for path, size in json.loads(gzip.decompress(base64.b64decode(packed)))]


class LockMode(StrEnum):
    """S3 Object Lock modes, weakest first: ``GOVERNANCE`` (principals allowed to bypass
    governance retention may delete early), ``COMPLIANCE`` (nobody can, the root user
    included). A vault copy is always locked in one of them."""

    GOVERNANCE = "GOVERNANCE"
    COMPLIANCE = "COMPLIANCE"


LOCK_DAYS_MAX = 36_500  # a hundred years: the policy file and requests share the bound


def lock_strength(mode: LockMode) -> int:
    """Higher is stricter: a request may raise a lock mode, never lower it."""
    return list(LockMode).index(mode)


def vault_class_fix(value: object) -> str:
    """How to correct a storage class that is not a vault class (policy file and request)."""
    fix = f"use one of {', '.join(VAULT_CLASSES)}"
    if isinstance(value, str) and value.upper() in VAULT_CLASSES:
        fix = f"write it in capitals: {value.upper()}"
    elif value == StorageClass.STANDARD:
        fix += " (STANDARD is where backups are staged before they are promoted)"
    return fix


def _vault_class(value: object) -> object:
    if value is None or value in VAULT_CLASSES:
        return value
    raise InvalidRequest(
        f"vault.storage_class {value!r} is not a vault storage class.",
        fix=vault_class_fix(value) + ", or leave storage_class out to use the policy's.",
    )


def _lock_mode(value: object) -> object:
    if value is None or value in list(LockMode):
        return value
    modes = " or ".join(LockMode)
    fix = f"use {modes}, or leave lock_mode out to use the policy's"
    if isinstance(value, str) and value.upper() in list(LockMode):
        fix = f"write it in capitals: {value.upper()}"
    elif isinstance(value, str) and value.upper() in ("NONE", "OFF", "NO", "FALSE", "DISABLED", ""):
        fix = f"a copy in the vault is always locked: {fix}"
    raise InvalidRequest(f"vault.lock_mode {value!r} is not an Object Lock mode.", fix=fix + ".")


def _lock_days(value: object) -> object:
    if value is None or (
        isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= LOCK_DAYS_MAX
    ):
        return value
    raise InvalidRequest(
        f"vault.lock_days {value!r} is not a number of days from 1 to {LOCK_DAYS_MAX}.",
        fix=f"write a whole number from 1 to {LOCK_DAYS_MAX} without quotes, or leave "
        "lock_days out to use the policy's.",
    )


class VaultRequest(Frozen):
    """A backup request's ``vault``: how its cluster's vault copy should be made stricter.

    A field left out (or null) takes the cluster's value in the policy file, or, for a cluster
    the policy does not name, ``VaultTarget``'s default. Each field is checked here, when the
    request is parsed (before Validate takes a lock or writes a record): a vault class, a lock
    mode that locks, days in bounds, no unknown field. ``backup.vault_target`` then refuses a
    request weaker than the policy."""

    storage_class: Annotated[StorageClass | None, BeforeValidator(_vault_class)] = None
    lock_mode: Annotated[LockMode | None, BeforeValidator(_lock_mode)] = None
    lock_days: Annotated[int | None, BeforeValidator(_lock_days)] = None

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        """Named here rather than as pydantic's 'extra inputs': the fix lists the fields."""
        if isinstance(data, BaseModel):
            return data
        if not isinstance(data, dict):
            raise InvalidRequest(
                f"vault {data!r} is not a mapping of fields.",
                fix='write it as e.g. {"lock_mode": "COMPLIANCE", "lock_days": 90}, or leave '
                "vault out to use the policy's.",
            )
        known = list(cls.model_fields)
        for name in data:
            if name not in known:
                guess = difflib.get_close_matches(str(name), known, n=1)
                meant = f" (did you mean {guess[0]}?)" if guess else ""
                raise InvalidRequest(
                    f"vault has no field {name!r}{meant}.",
                    fix=f"remove it; the fields of vault are {', '.join(known)}.",
                )
        return data


class VaultTarget(VaultRequest):
    """Where a verified backup is promoted: the vault's storage class and Object Lock, every
    field decided (``backup.vault_target``). A request may give one: it asks for each field."""

    storage_class: Annotated[StorageClass, BeforeValidator(_vault_class)] = (
        StorageClass.DEEP_ARCHIVE
    )
    lock_mode: Annotated[LockMode, BeforeValidator(_lock_mode)] = LockMode.GOVERNANCE
    lock_days: Annotated[int, BeforeValidator(_lock_days)] = 30


class BackupRequest(Frozen):
    """The input of the backup state machine (what the CLI, console or a schedule sends).
    ``vault`` makes the policy file's vault for this backup stricter (``VaultRequest``)."""

    cluster: ClusterName
    vault: VaultRequest | None = None
    part_size: int | None = None  # bytes; None chooses it from the data size
    # Send only the blocks changed since the cluster's newest backup (its chain's policy
    # decides when a full is due instead). Strict: "yes" from a console is not a boolean.
    incremental: StrictBool = False
    # A full read from the database even where the policy synthesizes fulls from the chain
    # (``incremental.synthesized_fulls``).
    read_full: StrictBool = False
    requested_by: str = "cli"
    execution_id: str = ""

    @model_validator(mode="after")
    def _a_full_or_an_incremental(self) -> BackupRequest:
        if self.incremental and self.read_full:
            raise ValueError("read_full asks for a full, incremental for an incremental: not both")
        return self


class Source(Frozen):
    """The node a backup reads, and the shards it reads there (it leads them)."""

    node_id: str
    shard_ids: list[str]
    engine: Engine | None = None  # the node's (None in a context from before mixed clusters)


# The policy's defaults, and what an agent applies when a control plane sends none.
DEFAULT_THROTTLE_WINDOW_SECONDS = 6 * 3600
DEFAULT_MIN_SOURCE_FREE_PERCENT = 5.0
# How long a thawed copy of an archived object stays readable (S3 RestoreObject's Days): the
# restore must finish in time, and the cost model prices that copy for as long.
THAW_DAYS = 2


class UploadLimits(Frozen):
    """The policy's upload settings for one backup, sent to its agents with the checkpoint
    command: each agent applies the stricter of these and its own configuration (None: the
    agent's own)."""

    rate_limit_bytes_per_second: Annotated[int, Field(gt=0)] | None = None
    parallelism: Annotated[int, Field(ge=1)] | None = None
    # adaptive: the agent steers its read rate by the source's health
    # (shardvault_agent.backup.throttle), under the rate limit, above the floor; auto: adaptive
    # when the source is in use as the backup starts reading (other clients), else static
    throttle: Literal["static", "adaptive", "auto"] = "auto"
    throttle_window_seconds: Annotated[int, Field(gt=0)] = DEFAULT_THROTTLE_WINDOW_SECONDS
    throttle_floor_bytes_per_second: Annotated[int, Field(gt=0)] | None = None
    # what the backup may hold of the source's log (shardvault_agent.backup.sourceguard)
    max_held_log_bytes: Annotated[int, Field(gt=0)] | None = None
    min_source_free_percent: Annotated[float, Field(ge=0, lt=100)] = DEFAULT_MIN_SOURCE_FREE_PERCENT


class Encryption(Frozen):
    """How a backup's frames are sealed: AES-256-GCM under a *data key*, one per chain.

    Only the key wrapped by KMS (``wrapped_key``, base64 of KMS's ciphertext blob) is ever
    written down (task inputs, the manifest, the catalog's context); it opens only through
    ``kms:Decrypt`` with exactly ``context``, which names the cluster, and which the agents of
    that cluster alone are allowed. The plaintext key lives in an agent's memory while it
    packs or restores, nowhere else."""

    key_id: str  # the KMS key that wrapped it
    wrapped_key: str
    context: dict[str, str]  # the KMS encryption context: {"shardvault:cluster": ..., ...}
    key_check: str | None = (
        None  # shardvault.data.pipeline.key_check, recorded once a frame is sealed
    )


class ChainLink(Frozen):
    """Where an incremental sits: its parent, the full its chain starts with, its depth (the
    full is 0), and the backups a restore reads, root first (this one excluded)."""

    parent_id: str
    root_id: str
    depth: int
    ancestors: list[str]


class Compression(Frozen):
    """How the agents compress the frames they pack (the policy's ``compression``)."""

    level: CompressionLevel = Field(
        DEFAULT_COMPRESSION_LEVEL,
        description="zstd level of every frame the agents pack, -7 (fastest) to 19 "
        "(smallest), or `auto` (the default): level 1 or 3 per stretch of 32 frames, "
        "whichever makes the backup faster given the cores and `upload_mib_s` "
        "(docs/guide/compression-encryption.md). Frames zstd cannot shrink are stored raw "
        "whatever the level.",
        json_schema_extra={"shown_type": "int >= -7, <= 19 | auto"},
    )
    upload_mib_s: int = Field(
        DEFAULT_UPLOAD_MIB_S,
        gt=0,
        strict=True,
        description="`auto`: what a node can send the store, in MiB/s; level 3 is chosen "
        "only where the bytes it saves would take longer to send than the CPU it costs. "
        "Lower it for nodes behind a slow link.",
    )


class BackupContext(Frozen):
    """What validation decided; passed along the state machine as ``$.backup``."""

    backup_id: str
    cluster: str
    engine: Engine | None  # None: the policy lets the cluster mix engines; each source's own
    sources: list[Source]
    store_url: str
    started_at: float
    part_size: int | None = None
    execution_id: str = ""
    vault: VaultTarget | None = None  # None: the backup stays in the store
    upload: UploadLimits = Field(default_factory=UploadLimits)
    compression: Compression = Field(default_factory=Compression)  # the policy's
    encryption: Encryption | None = None  # None: frames are not sealed (policy: none)
    kind: BackupKind = BackupKind.FULL
    chain: ChainLink | None = None  # incrementals, and the chain a synthesized full continues
    # A synthesized full (``shardvault.backup.synthesis``): the node sends the changes since
    # ``chain.parent_id`` as an incremental's, and the backup becomes a full whose data stream
    # holds copies of the chain's objects beneath them.
    synthesized: bool = False
    cut_margin_seconds: float = (
        0.0  # from the Stop step's start to the cut (shardvault.contracts.cut)
    )
    cut_commit_lock: int | None = None  # the policy's cut.commit_lock: None, no commit pause
    cut_commit_database: str | None = None  # the policy's cut.database: where the lock is taken


class ObjectPlan(Frozen):
    """One object to upload: a byte range of one shard's stream, cut into parts."""

    backup_id: str
    cluster: str
    node_id: str
    shard_id: str
    phase: Phase
    index: int
    key: str
    stream_offset: int
    length: int
    part_size: int
    part_count: int  # of the stream's bytes; the stored object's count follows its packing
    mutable: bool = False
    frame_size: int = 1024 * 1024  # plaintext per frame (shardvault.data.pipeline.frame_size_for)
    compression: Compression = Field(default_factory=Compression)

    @property
    def place(self) -> str:
        return object_place(self.cluster, self.backup_id, self.shard_id, self.phase, self.index)


def object_place(cluster: str, backup_id: str, shard_id: str, phase: Phase, index: int) -> str:
    """An object's identity inside its backup, bound into each sealed frame (its key changes
    when it is promoted into the vault; this does not)."""
    return f"{cluster}/{backup_id}/{shard_id}/{phase}/{index:05d}"


class PartChecksum(Frozen):
    part_number: Annotated[int, Field(ge=1, le=10_000)]
    size: int
    crc64nvme: str


class ThrottleReport(BaseModel):
    """An adaptive throttle as its agent last reported it (``shardvault_agent.backup.throttle``):
    how often the source's health held the read rate back, for how long, and its lowest rate.
    A field this release does not know (a newer agent's) is ignored."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    mode: Literal["adaptive"] = "adaptive"
    rate_bytes_per_second: int | None = None  # None: nothing holds it back
    limited_by: str | None = None  # the pressure that cut the rate last
    cuts: int = 0
    throttled_seconds: float = 0.0
    lowest_rate_bytes_per_second: int | None = None
    floor_bytes_per_second: int = 0
    rebases: int = 0
    pressures: dict[str, float] = Field(default_factory=dict)


class ObjectChecksums(Frozen):
    """What the agent packed for an object before any byte was uploaded: the stored bytes'
    checksums per part and whole, their length and the frame table."""

    key: str
    parts: list[PartChecksum]
    crc64nvme: str  # full-object
    stored_length: int
    frames: str  # shardvault.data.pipeline.pack_frames
    key_check: str | None = None  # of the data key that sealed the frames (None: not sealed)
    throttle: ThrottleReport | None = None  # an adaptive backup's throttle as the pack ended
    held_log_bytes: int | None = None  # the most log the backup held on its source so far
    pack_cpu_seconds: float | None = None  # what packing it cost the agent's threads
    frame_levels: dict[int, int] | None = None  # its frames per zstd level


class UploadedPart(Frozen):
    part_number: int
    etag: str
    crc64nvme: str


class ObjectResult(Frozen):
    """A completed and verified object, as recorded for the manifest."""

    key: str
    node_id: str
    shard_id: str
    phase: Phase
    index: int
    stream_offset: int
    length: int
    part_size: int
    part_count: int
    crc64nvme: str
    verified_by: str  # "attributes" (no download) or "readback"
    # Each part's CRC64NVME, in order. Empty in manifests written before it was recorded; the
    # whole-object checksum still holds.
    part_crc64nvme: list[str] = Field(default_factory=list)
    # Format 2: the stored object is frames (``frames`` packed, ``frame_size`` plaintext
    # each) of ``stored_length`` bytes; ``length`` stays the stream bytes it holds. Format 1
    # objects (no frames) store the stream's bytes as they are.
    stored_length: int | None = None
    frame_size: int = 0
    frames: str = ""
    key_check: str | None = None  # sealed frames: the data key's check value
    # A copy of a WAL archive batch in an archived tail (shardvault.backup.archived) keeps the
    # batch's own frames: they were sealed with the batch's place and its own data key.
    place: str | None = None
    encryption: Encryption | None = None
    # A synthesized full's copy of an object of its chain: the index of its layer
    # (``ManifestStream.layers``); None, the backup's own object.
    layer: int | None = None
    # What packing it cost the agent (``ObjectChecksums``); None: not packed by an agent (a
    # copy), or by one that did not report it.
    pack_cpu_seconds: float | None = None
    frame_levels: dict[int, int] | None = None
    # In a vault manifest: the version of the copy promotion locked (shardvault.lifecycle.promote).
    # Reads name it, so neither a delete marker nor a newer version put over the key (both
    # allowed in a locked bucket) can hide the locked copy from a restore or a verify.
    version_id: str | None = None

    @property
    def stored_bytes(self) -> int:
        return self.length if self.stored_length is None else self.stored_length


class Layer(Frozen):
    """One backup of the chain a synthesized full was made from, as its data stream holds it:
    the files and changed ranges (None: the chain's root, whose objects hold the whole stream)
    of that backup's data stream; its objects are the stream's with this layer's index."""

    backup_id: str
    files: list[FileEntry]
    extents: str | None


class ManifestStream(Frozen):
    phase: Phase
    files: list[FileEntry]
    objects: list[ObjectResult]
    # An incremental's data: the changed ranges its objects hold (shardvault.contracts.extents); "":
    # its objects hold the whole stream.
    extents: str = ""
    # A synthesized full's data (``shardvault.backup.synthesis``): the chain it was made from,
    # root first, whose objects it holds copies of (``ObjectResult.layer``); its own objects
    # then hold its changes since the last layer (``extents``), as an incremental's.
    layers: list[Layer] = Field(default_factory=list)

    @property
    def own_objects(self) -> list[ObjectResult]:
        """The objects this backup's agents sent (a synthesized full's copies excluded)."""
        return [o for o in self.objects if o.layer is None]


class ManifestShard(Frozen):
    shard_id: str
    node_id: str
    marker: dict[str, str]
    checkpoint_at: float
    streams: list[ManifestStream]
    # The shard's block map at this backup (an object of phase "blockmap"), which the next
    # incremental compares with; never placed by a restore. None before format 3.
    blockmap: ObjectResult | None = None
    engine: Engine | None = None  # None in manifests from before mixed clusters: the backup's

    @property
    def objects(self) -> list[ObjectResult]:
        """Every object the store holds for the shard: its streams' and its block map."""
        streamed = [o for stream in self.streams for o in stream.objects]
        return streamed + ([self.blockmap] if self.blockmap else [])


class Manifest(Frozen):
    format: int = MANIFEST_FORMAT
    backup_id: str
    cluster: str
    engine: Engine | None  # None: the shards' engines differ (a mixed cluster); each names its own
    started_at: float
    completed_at: float
    checkpoint_skew_seconds: float
    part_size: int
    shards: list[ManifestShard]
    bytes: int  # of the shards' streams
    objects: int
    parts: int
    verification: str
    stored_bytes: int | None = None  # what the store holds (compressed); None in format 1
    encryption: Encryption | None = None  # sealed frames: the wrapped data key
    kind: BackupKind = BackupKind.FULL
    chain: ChainLink | None = None  # an incremental's parent, root, depth and ancestors
    synthesized_from: str | None = None  # a synthesized full: the backup whose chain it copied
    # What its agents spent packing its objects (``ObjectResult.pack_cpu_seconds``), and its
    # frames per zstd level; None: no agent reported them.
    pack_cpu_seconds: float | None = None
    frame_levels: dict[int, int] | None = None
    # The cluster's cut (shardvault.contracts.cut): the restore point every shard's tail reaches (a
    # restore recovers to it) and the spread of its creation times; None: no shard cut.
    cut_name: str | None = None
    cut_skew_seconds: float | None = None
    cut_late_seconds: float | None = None  # how late the latest node came to the instant
    # The commit pause (policy cut.commit_lock): None, none asked; True, every node held
    # the commit lock at one shared moment around its restore point; False, best-effort.
    cut_paused: bool | None = None
    cut_pause_seconds: float | None = None  # the longest node's pause

    @model_validator(mode="after")
    def _engine_known(self) -> Manifest:
        if self.engine is None and (unnamed := [s.shard_id for s in self.shards if not s.engine]):
            raise ValueError(f"a mixed backup's shards {', '.join(unnamed)} name no engine")
        return self

    def engine_of(self, shard: ManifestShard) -> Engine:
        return shard.engine or self.engine  # type: ignore[return-value]  # one is set: above

    @property
    def engines(self) -> list[Engine]:
        """The engines of the backup's shards (one, unless the cluster mixes them)."""
        return sorted({self.engine_of(shard) for shard in self.shards})


# --- Restore -----------------------------------------------------------------------------------
class RetrievalTier(StrEnum):
    """How fast archived objects are thawed (S3 RestoreObject tiers)."""

    EXPEDITED = "Expedited"
    STANDARD = "Standard"
    BULK = "Bulk"


class RestoreTarget(Frozen):
    """Where a point-in-time restore stops (PostgreSQL, from the WAL archive), exactly one of:
    ``time``, an instant with its offset (e.g. ``2026-11-23T14:02:59+00:00``: every node
    replays its WAL to it); ``lsn``, a position in the WAL (``X/Y`` as PostgreSQL writes it:
    one shard's WAL, so a cluster of one shard only); ``name``, a restore point
    (``pg_create_restore_point``: every backup's cut is one, named after the backup, and an
    operator's own marks are others); ``position``, MariaDB: ``FILE:OFFSET`` in one shard's
    binary logs (a transaction's boundary, as ``SHOW MASTER STATUS`` or ``mariadb-binlog``
    shows it); ``latest``, the end of each shard's archived log; ``cut``, one of the cluster's
    scheduled cuts by its id (every node to that cut's restore point); ``cut_before``, the
    newest scheduled cut at or before an instant that paused the commits it was asked to
    (``shardvault.backup.cuts``)."""

    time: AwareDatetime | None = None
    lsn: str | None = None
    name: str | None = None
    position: str | None = None
    latest: StrictBool = False
    cut: str | None = None
    cut_before: AwareDatetime | None = None

    @field_validator("time", "cut_before", mode="before")
    @classmethod
    def _a_time_with_its_offset(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        try:
            parsed = datetime.fromisoformat(value.strip())
        except ValueError:
            parsed = None
        if parsed is None or parsed.tzinfo is None:
            raise InvalidRequest(
                f"target time {value!r} is not an instant: it needs a date, a time and an "
                "offset from UTC.",
                fix="write it as ISO 8601 with its offset, e.g. '2026-11-23 14:02:59+00'.",
            )
        return parsed

    @field_validator("lsn")
    @classmethod
    def _an_lsn(cls, value: str | None) -> str | None:
        if value is not None and not LSN.fullmatch(value):
            raise InvalidRequest(
                f"target LSN {value!r} is not a WAL position.",
                fix="write it as PostgreSQL does, two hex numbers: e.g. '0/3000060' (from "
                "pg_current_wal_lsn(), or a server log).",
            )
        return value.upper() if value else value

    @field_validator("name")
    @classmethod
    def _a_restore_point(cls, value: str | None) -> str | None:
        return check_restore_point_name(value) if value is not None else value

    @field_validator("cut")
    @classmethod
    def _a_cut(cls, value: str | None) -> str | None:
        if value is not None and not is_cut_id(check_restore_point_name(value)):
            raise InvalidRequest(
                f"target cut {value!r} is not a scheduled cut's name.",
                fix="name one as shardvault cuts CLUSTER lists it (cut-<time>-<hex>), or give "
                "a restore point of your own with --target-name.",
            )
        return value

    @field_validator("position")
    @classmethod
    def _a_binlog_position(cls, value: str | None) -> str | None:
        if value is None:
            return value
        file, _, offset = value.strip().rpartition(":")
        if not BINLOG_FILE.fullmatch(file) or not offset.isdigit() or int(offset) < 4:
            raise InvalidRequest(
                f"target position {value!r} is not a binary log position.",
                fix="write it as FILE:OFFSET, e.g. 'mysql-bin.000012:1234' (SHOW MASTER STATUS "
                "answers the current one).",
            )
        return f"{file}:{int(offset)}"

    @model_validator(mode="after")
    def _one_target(self) -> RestoreTarget:
        named = [
            self.time is not None,
            self.lsn is not None,
            self.name is not None,
            self.position is not None,
            self.latest,
            self.cut is not None,
            self.cut_before is not None,
        ]
        if sum(named) != 1:
            raise InvalidRequest(
                "a restore target names a time, an LSN, a restore point, a binary log "
                "position, the latest log or a scheduled cut, exactly one.",
                fix='set target to {"time": "<ISO 8601 with offset>"}, {"lsn": "X/Y"}, '
                '{"name": "<restore point>"}, {"position": "FILE:OFFSET"}, {"latest": true}, '
                '{"cut": "<cut id>"} or {"cut_before": "<ISO 8601 with offset>"}.',
            )
        return self

    @property
    def epoch(self) -> float | None:
        return self.time.timestamp() if self.time is not None else None

    @property
    def kind(self) -> str:
        """``time``, ``lsn``, ``name``, ``position``, ``latest`` or ``cut``."""
        if self.cut is not None or self.cut_before is not None:
            return "cut"
        if self.time is not None:
            return "time"
        if self.position is not None:
            return "position"
        return "lsn" if self.lsn else "name" if self.name else "latest"

    def describe(self) -> str:
        if self.cut is not None:
            return f"cut {self.cut}"
        if self.cut_before is not None:
            return f"the newest cut at or before {self.cut_before.isoformat()}"
        if self.time is not None:
            return self.time.isoformat()
        if self.lsn is not None:
            return f"LSN {self.lsn}"
        if self.position is not None:
            return f"position {self.position}"
        return f"restore point {self.name!r}" if self.name else "the end of the archive"


class RestoreRequest(Frozen):
    """The input of the restore state machine (from the console, the CLI or a test).

    ``backup_id`` may be ``latest`` (the newest verified backup of ``cluster``; with a
    ``target``, the newest that completed before it). ``placement`` pins shards to target nodes
    (``{"shard-a": "node-2"}``); unpinned shards are placed by size.
    """

    cluster: ClusterName
    target_cluster: ClusterName
    backup_id: str = "latest"
    tier: RetrievalTier = RetrievalTier.STANDARD
    placement: dict[str, str] = Field(default_factory=dict)
    # Strict: pydantic would read "yes", "no", "off" or 1 from a console as booleans.
    replace: StrictBool = False  # restore over shard directories the target already holds
    plan_only: StrictBool = False  # validate and place, show the plan, move nothing
    validation_queries: list[str] = Field(default_factory=list)  # see shardvault.contracts.sqlcheck
    heapallindexed: StrictBool = False  # PostgreSQL: pg_amcheck --heapallindexed (deeper)
    # A backup that verify recorded damaged is refused unless the request accepts it (what
    # is intact may still be worth having when nothing better is left)
    accept_damaged: StrictBool = False
    target: RestoreTarget | None = None  # point-in-time recovery from the WAL archive
    # A vault target of the policy to read the backup from (the stack vault's name, or a
    # copy's: vault.copies); None: the stack vault once promoted, else the store.
    from_vault: str | None = Field(None, pattern=r"^[a-z][a-z0-9-]{0,39}$")
    # PostgreSQL tablespaces placed elsewhere than the target node's restore_dir:
    # "[SHARD:]NAME" -> an absolute directory (``shardvault.contracts.links``).
    tablespaces: dict[str, str] = Field(default_factory=dict)
    requested_by: str = "cli"
    execution_id: str = ""

    @field_validator("validation_queries")
    @classmethod
    def _read_only_queries(cls, value: list[str]) -> list[str]:
        return check_validation_queries(value)


class ShardPlacement(Frozen):
    shard_id: str
    node_id: str
    bytes: int


class NodeAssignment(Frozen):
    """The shards one target node restores."""

    node_id: str
    shard_ids: list[str]
    bytes: int


class ChainSource(Frozen):
    """Where a restore reads one backup of the chain it restores (the newest's ancestors)."""

    backup_id: str
    manifest_key: str
    source: str  # "store" or "vault"
    manifest_version: str | None = None  # the vault manifest's locked version (see ObjectResult)


class RestoreContext(Frozen):
    """What restore validation decided; passed along the state machine as ``$.restore``."""

    restore_id: str
    cluster: str
    backup_id: str
    manifest_key: str
    target_cluster: str
    placements: list[ShardPlacement]
    assignments: list[NodeAssignment]
    bytes: int
    objects: int
    tier: RetrievalTier
    replace: bool
    plan_only: bool
    validation_queries: list[str] = Field(default_factory=list)
    heapallindexed: bool = False
    started_at: float
    execution_id: str = ""
    # Where the backup's objects are read: "store", "vault" or "copy:NAME" (a copy target,
    # staged into the store: shardvault.restore.sources).
    source: str = "store"
    manifest_version: str | None = None  # the vault manifest's locked version (see ObjectResult)
    chain: list[ChainSource] = Field(default_factory=list)  # an incremental's ancestors, root first
    target: RestoreTarget | None = None  # a point-in-time restore's target (validated)
    wal_batches: int = 0  # a point-in-time restore's archive batches, all shards'
    wal_bytes: int = 0  # and the WAL they hold
    # The request's tablespaces, checked, by shard: link path -> directory
    # (``shardvault.contracts.links.remaps``).
    links: dict[str, dict[str, str]] = Field(default_factory=dict)


class DownloadItem(Frozen):
    """One object for one target node to fetch into a restored shard."""

    restore_id: str
    target_cluster: str
    node_id: str
    shard_id: str
    phase: Phase
    key: str
    stream_offset: int
    length: int
    part_size: int
    part_count: int
    crc64nvme: str
    part_crc64nvme: list[str] = Field(default_factory=list)
    source: str = "store"
    version_id: str | None = None  # the vault's locked version (see ObjectResult)
    stored_length: int | None = None  # see ObjectResult
    frame_size: int = 0
    frames: str = ""
    place: str = ""  # the backup object's identity (ObjectPlan.place), bound into its frames
    key_check: str | None = None  # sealed frames (the wrapped key travels in the layout)
    # A WAL batch's own data key (wrapped), which is not its shard's backup's.
    encryption: Encryption | None = None
    # A chain member's object: the node placed its bytes when it prepared the shard
    # (shardvault_agent.restore.chain_placement, over the chain the prepare step names);
    # only the frames it contributes are fetched.
    from_chain: bool = False
