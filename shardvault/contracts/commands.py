"""The agent commands: one model per command's arguments, and per command's result.

The control plane checks a command's arguments where it posts them
(``shardvault.workflow.dispatch``), and the agent again where it runs them
(``shardvault_agent.commands.Commands.run``). A field one side sends and the other does not
read is refused by name at once, not ignored on a node.

Terms:
- *command*: what the control plane posts to one node's inbox: a name (``ARGUMENTS``' keys,
  ``dispatch.COMMANDS``) and its *arguments*. Every command's arguments carry ``backup_id``:
  the backup's id, or, for a restore's commands, the restore's; a probe's, the probe's.
- *producer*: who builds the arguments: the state machine's dispatch task (its ``args``), the
  dispatcher (it adds ``backup_id``, the work objects ``args_key`` and ``scan_args`` name, and
  ``answer_url``), and the cleanups that post without a task token (``post_untracked``).
- *arguments by URL*: an inbox item holds at most 400 KB, so larger arguments travel as a
  presigned URL of their work object (``ArgsByUrl``: ``args_url``, ``args_size``). That is
  transport: the agent fetches them (``shardvault_agent.transfer.inlined``) before the
  models here apply, and ``parse_args`` refuses arguments still by URL. A prepare's
  ``prefetch`` may be by URL itself, and is fetched by the prepare.
- *answer by URL*: the listing commands (checkpoint, scan, stop) put their answer in the work
  bucket through ``answer_url`` and answer their task token with a receipt
  (``AnswerReceipt``; ``shardvault.backup.answers``).
- *layout*: what a restoring node is told of one shard before any byte arrives: its streams'
  files, its objects, its chain (``ShardLayout``). The node keeps it for the restore's later
  commands and hands it to its engine to finish.

Results are read more loosely than arguments: the agents are upgraded first, so a control
plane may read the result of a newer agent; a field it does not know is ignored, as in a
node's record (``models.Registered``).

Protocol 4 (``models.AGENT_PROTOCOL``) dropped what the agent kept for control planes older
than itself: a listing command always has its ``answer_url`` (no answer inline), a parent's
block map names its node and marker, and a chain is always layered (its newer members'
objects download first). Protocol 5: a point-in-time restore's WAL comes with finish
(``FinishRestoreArgs.wal``). A default here stands for "not this time" (no encryption, no
parents: a backup that scans in a Scan step apart), never for an older sender.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from shardvault.contracts.cut import CutRequest
from shardvault.contracts.models import (
    Compression,
    DownloadItem,
    Encryption,
    Frozen,
    ObjectChecksums,
    ObjectPlan,
    ObjectResult,
    Phase,
    UploadedPart,
    UploadLimits,
)
from shardvault.errors import AnswerMismatch, InvalidRequest

ShardIds = list[str]  # the node's shards a command is about, as its registry record names them
Marker = dict[str, str]  # an engine's marker of a capture (e.g. {"start_lsn": "0/2000028"})


# --- Transport ----------------------------------------------------------------------------------
class ArgsByUrl(Frozen):
    """Arguments too large for an inbox item: a presigned GET of their work object
    (``shardvault.workflow.dispatch.work_args``), merged into the rest once fetched."""

    args_url: str
    args_size: Annotated[int, Field(ge=0)]


# --- Arguments ----------------------------------------------------------------------------------
class CommandArgs(Frozen):
    """What every command carries; frozen, and a field no model names is refused."""

    backup_id: str


class ShardArgs(CommandArgs):
    # Every producer sends them; the agent reads none as no shard (``Commands._shards``).
    shard_ids: ShardIds = Field(default_factory=list)


class ListingArgs(ShardArgs):
    """A listing command's: where it puts its answer (``dispatch.ANSWERED``); a listing is
    too long for a task result."""

    answer_url: str


class PackSpec(Frozen):
    """How a node cuts and packs the objects it listed, as the plan step will plan them:
    ``planning.plan_objects``' arguments but the listings (``backup.planner.pack_arguments``)."""

    cluster: str
    prefix: str
    part_size: Annotated[int, Field(gt=0)]
    compression: Compression


class ParentMap(Frozen):
    """An incremental's parent's block map for one shard, as the agent fetches it
    (``backup.scanning.parent_maps``)."""

    backup_id: str
    object: ObjectResult  # the manifest's blockmap object
    place: str  # its frames' place (``models.object_place``)
    url: str  # presigned GET
    # Where the parent began and on which node: an engine's block screen proves blocks
    # unchanged against it, on that node only.
    marker: Marker
    node_id: str
    encryption: Encryption | None = None  # the chain's wrapped data key; None: not sealed


class StopCut(Frozen):
    """The cut of a lone node's checkpoint, which stops as it scans: a ``CutRequest`` but its
    instant, which the agent takes as it stops (``entered_at``)."""

    name: str
    margin_seconds: float = 0.0
    commit_lock: int | None = Field(None, ge=-(2**63), lt=2**63)  # None: no commit pause
    database: str | None = None

    @model_validator(mode="after")
    def _a_cut(self) -> StopCut:
        self.entered_at("1970-01-01T00:00:00+00:00")  # CutRequest's own checks, once
        return self

    def entered_at(self, entered: str) -> CutRequest:
        return CutRequest(**self.model_dump(), entered=entered)


class StopOrder(Frozen):
    """A lone node's incremental ends in its checkpoint (``backup.scanning.stop_args``)."""

    cut: StopCut


class ScanArgs(ListingArgs):
    """Scan each shard's capture against its parent (``backup.scanning``): the separate Scan
    step of a backup of more nodes than a Map runs at once."""

    parents: dict[str, ParentMap] = Field(default_factory=dict)  # by shard; none: a full
    pack: PackSpec | None = None  # an incremental packs its changes at the scan


class CheckpointArgs(ListingArgs):
    """Take each shard's checkpoint; with ``parents``, scan it too (one round trip)."""

    upload: UploadLimits | None = None  # the policy's; None: the agent's own
    encryption: Encryption | None = None  # the backup's wrapped data key; None: not sealed
    flush: bool = False  # a lone node flushes in its checkpoint
    archived_tails: bool = False  # the tail refers to the WAL archive instead of holding it
    # None (not sent): a backup that scans in a Scan step apart; the checkpoint lists only.
    parents: dict[str, ParentMap] | None = None
    pack: PackSpec | None = None
    stop: StopOrder | None = None

    @model_validator(mode="after")
    def _stop_after_a_scan(self) -> CheckpointArgs:
        # The agent stops only after it scanned and packed every change: a stop without
        # them would be dropped, or fail on the node.
        if self.stop is not None and (self.parents is None or self.pack is None):
            raise ValueError("stop needs parents and pack (a lone node stops after its scan)")
        return self


class StopArgs(ListingArgs):
    """End each shard's backup at the cut, list the tails and pack them."""

    cut: CutRequest | None = None  # None: no cut (an engine without one: SQLite)
    pack: PackSpec | None = None  # None: the tails are packed in the Upload map


class CutArgs(ShardArgs):
    """A scheduled cut (``shardvault.wal.cuts``): the cluster's restore point on each shard at
    the cut's instant, with no backup (``backup_id`` is the cut's id)."""

    cut: CutRequest

    @model_validator(mode="after")
    def _named_after_itself(self) -> CutArgs:
        if self.cut.name != self.backup_id:
            raise ValueError(f"the cut is named {self.cut.name}, not {self.backup_id}")
        return self


class FlushArgs(ShardArgs):
    pass


class ReleaseArgs(ShardArgs):
    # Sent by the failure path (state machine and cleanup); no agent reads it.
    failed: bool = False


class ObjectArgs(CommandArgs):
    """A command about one object of the backup ``backup_id`` names."""

    object: ObjectPlan

    @model_validator(mode="after")
    def _of_this_backup(self) -> ObjectArgs:
        if self.object.backup_id != self.backup_id:
            raise ValueError(f"object is of backup {self.object.backup_id}, not {self.backup_id}")
        return self


class PackArgs(ObjectArgs):
    pass


class PartUrl(Frozen):
    part_number: Annotated[int, Field(ge=1, le=10_000)]
    url: str  # presigned, bound to the part's checksum


class UploadArgs(ObjectArgs):
    """Send the packed copy's parts that have a URL (``backup.upload.sign``)."""

    checksums: ObjectChecksums  # what the pack answered
    upload_id: str | None  # None: a single PUT
    parts: list[PartUrl]

    @model_validator(mode="after")
    def _checksums_of_the_object(self) -> UploadArgs:
        if self.checksums.key != self.object.key:
            raise ValueError(f"checksums are of {self.checksums.key}, not {self.object.key}")
        return self


class StreamObject(Frozen):
    key: str
    stream_offset: int
    length: int


class ChainObject(StreamObject):
    frame_size: int


class LayoutStream(Frozen):
    phase: Phase
    files: str  # packed (``models.pack_files``)
    objects: list[StreamObject]  # the agent reads only the keys (finish: all arrived)


class ChainMember(Frozen):
    """One backup of a shard's chain, root first (``data.chains.chain_args``)."""

    backup_id: str
    files: str  # its data stream's, packed
    extents: str | None  # None: the root (its whole stream); "": nothing changed in the shard
    objects: list[ChainObject]


class Recovery(Frozen):
    """Where a point-in-time restore's recovery stops (``wal.pitr.recovery``); all None:
    the archive's end."""

    target_time: str | None = None  # ISO 8601 with its offset
    target_lsn: str | None = None
    target_name: str | None = None
    target_position: str | None = None  # MariaDB: FILE:OFFSET in its binary logs
    wal_dir: bool = True  # the WAL is placed beside the data; no agent reads it
    # Linked directories (PostgreSQL tablespaces) created after the base: path -> the
    # location their creation, if replayed, writes into (``wal.pitr.created_after``).
    created_links: dict[str, str] = Field(default_factory=dict)


class ShardLayout(Frozen):
    """What a node lays out of one shard (``restore.planner.prepare_args``)."""

    shard_id: str
    streams: list[LayoutStream]
    marker: Marker = Field(default_factory=dict)  # the backup's (PostgreSQL: its cut)
    encryption: Encryption | None = None  # the wrapped data key, for the target cluster
    # An incremental's. The newer members' objects download before the root's (two waves):
    # the node lays the root down whole, their changed blocks laid into its frames
    # (``shardvault_agent.restore.chain_placement``: layered).
    chain: list[ChainMember] | None = None
    recovery: Recovery | None = None  # a point-in-time restore's
    # The request's remapped linked directories (``shardvault.contracts.links``): link path
    # -> directory on the node; the others go to the node's default placement.
    links: dict[str, str] = Field(default_factory=dict)


class SignedDownload(Frozen):
    object: DownloadItem
    url: str  # presigned GET


class Prefetch(Frozen):
    """The chain's newer objects a node fetches as it prepares, with their URLs
    (``restore.planner.sign_prefetch``)."""

    downloads: list[SignedDownload]


def _by_url_or_inline(value: Any) -> str:
    by_url = isinstance(value, ArgsByUrl) or (isinstance(value, Mapping) and "args_url" in value)
    return "by_url" if by_url else "inline"


# A prepare's prefetch is by URL when it is too large for the inbox item, like any arguments.
PrefetchArgs = Annotated[
    Annotated[Prefetch, Tag("inline")] | Annotated[ArgsByUrl, Tag("by_url")],
    Discriminator(_by_url_or_inline),
]


class PrepareRestoreArgs(CommandArgs):
    shards: list[ShardLayout]
    replace: bool = False  # restore over what the target directories hold
    prefetch: PrefetchArgs | None = None


class DownloadArgs(CommandArgs):
    object: DownloadItem
    url: str  # presigned GET (``restore.download.sign_download``)

    @model_validator(mode="after")
    def _of_this_restore(self) -> DownloadArgs:
        if self.object.restore_id != self.backup_id:
            raise ValueError(f"object is of restore {self.object.restore_id}, not {self.backup_id}")
        return self


class FinishRestoreArgs(CommandArgs):
    shard_ids: ShardIds  # read as they are (``Restorer.finish``)
    validation_queries: list[str] = Field(default_factory=list)  # checked at the request
    heapallindexed: bool = False
    # A point-in-time restore's archive batches, fed to recovery as it replays
    # (``shardvault_agent.restore.walfeed``), with their URLs (``restore.planner.plan``).
    wal: PrefetchArgs | None = None


class AbortRestoreArgs(CommandArgs):
    pass


class ProbeArgs(CommandArgs):
    """``shardvault check``'s round trip (``assurance.probe.plan``)."""

    body: str  # base64 of the bytes to put and read back
    crc64nvme: str  # of the body: the PUT URL is bound to it
    put_url: str
    get_url: str

    @field_validator("body")
    @classmethod
    def _base64(cls, value: str) -> str:
        try:
            base64.b64decode(value, validate=True)
        except binascii.Error:
            raise ValueError("body is not base64") from None
        return value


ARGUMENTS: dict[str, type[CommandArgs]] = {
    "flush": FlushArgs,
    "checkpoint": CheckpointArgs,
    "scan": ScanArgs,
    "pack": PackArgs,
    "upload": UploadArgs,
    "stop": StopArgs,
    "release": ReleaseArgs,
    "prepare_restore": PrepareRestoreArgs,
    "download": DownloadArgs,
    "finish_restore": FinishRestoreArgs,
    "abort_restore": AbortRestoreArgs,
    "probe": ProbeArgs,
    "cut": CutArgs,
}

FIX = (
    "the control plane and the agent disagree on a command's arguments or answer: run one "
    "ShardVault version on both (shardvault nodes shows each agent's)."
)


def parse_args(command: str, args: Mapping[str, Any]) -> CommandArgs:
    """``args`` as ``command``'s model; InvalidRequest naming the command and each field."""
    model = ARGUMENTS.get(command)
    if model is None:
        raise InvalidRequest(
            f"unknown agent command {command!r}.",
            fix=f"use one of {', '.join(sorted(ARGUMENTS))}.",
        )
    if isinstance(args, Mapping) and "args_url" in args:
        raise InvalidRequest(
            f"the arguments of agent command {command!r} are still by URL (args_url).",
            fix="fetch them first (shardvault_agent.transfer.inlined), then check them.",
        )
    try:
        return model.model_validate(dict(args) if isinstance(args, Mapping) else args)
    except ValidationError as error:
        problems = problems_of(error, "(arguments)")
        raise InvalidRequest(
            f"the arguments of agent command {command!r} are invalid: {problems}.", fix=FIX
        ) from None
    except InvalidRequest as error:  # a field's own check (a cut's name, its database)
        raise InvalidRequest(
            f"the arguments of agent command {command!r} are invalid: {error.message}",
            fix=error.fix,
        ) from None


# --- Results ------------------------------------------------------------------------------------
Result = TypeVar("Result", bound=BaseModel)


class CommandResult(BaseModel):
    """What an agent answers. A field this release does not know (a newer agent's) is
    ignored: upgrading the agents first must not stop every backup."""

    model_config = ConfigDict(frozen=True, extra="ignore")


class NodeResult(CommandResult):
    node_id: str


class Flushed(NodeResult):
    flushed: ShardIds


class PackedObject(Frozen):
    """An object a node packed as it listed it, at the scan or the stop
    (``shardvault_agent.backup.commands``)."""

    object: ObjectPlan
    checksums: ObjectChecksums


class ScanFields(BaseModel):
    """What a shard's scan against its parent found, as its listing answers it (checkpoint
    with parents, scan): the changed extents, packed, and what it read. A full has no parent:
    ``delta_bytes`` is None. The agent saves the same fields between commands
    (``shardvault_agent.backup.captures.ShardScan``), so a retried scan answers the same."""

    extents: str = ""
    delta_bytes: int | None = None
    scan_seconds: float | None = None
    unchanged_bytes: int = 0
    screened_bytes: int = 0
    parent_id: str | None = None
    blockmap_bytes: int | None = None  # the map goes with this answer's objects
    map_with_tail: bool = False  # scanned by a Scan command: the map goes with the tail


class ListedShard(ScanFields, CommandResult):
    """One shard's listing (``data.planning.listings_from_results`` reads it): what its
    engine captured, and what its scan found when it had one."""

    shard_id: str
    files: str  # packed
    marker: Marker
    checkpoint_at: float
    mutable: bool
    bytes: int
    packed: list[PackedObject] | None = None  # packed as listed; None: in the Upload map


class Listing(NodeResult):
    """The answer of checkpoint, scan and stop, put through ``answer_url``."""

    shards: list[ListedShard]
    stopped: Listing | None = None  # a checkpoint that also stopped: the tails' listing


class AnswerReceipt(NodeResult):
    """What a listing command's task token carries once its answer is in the work bucket."""

    answer_bytes: int
    answer_crc64nvme: str


class Released(NodeResult):
    released: bool


class Uploaded(CommandResult):
    parts: list[UploadedPart]


class Prefetched(CommandResult):
    objects: int
    bytes: int | None = None  # counted by finish, once they landed


class Prepared(NodeResult):
    prepared: ShardIds
    bytes: int
    # None: an agent from before prefetching (``restore.planner.check_prepared`` refuses it
    # when it had objects to prefetch).
    prefetched: Prefetched | None = None


class Downloaded(CommandResult):
    key: str
    bytes: int  # of the restored streams it supplied
    resumed: bool


class WalFed(CommandResult):
    """What a node's WAL feeds fetched of the archive batches planned for it: recovery that
    stops early leaves the rest in the store."""

    planned: int
    fetched: int
    bytes: int  # of WAL
    stored_bytes: int


class RestoredShard(CommandResult):
    """One shard as its engine finished it: where it is, its server, what its checks found."""

    shard_id: str
    node_id: str
    path: str
    checks: dict[str, str]  # check -> "ok" or what it found
    checks_passed: bool
    # The server the restore started on it (PostgreSQL: port and socket directory; MariaDB:
    # its socket); none for an embedded store.
    port: int | None = None
    socket_dir: str | None = None
    socket: str | None = None
    # Where recovery stopped (a time, a position, the archive's end, the cluster's restore
    # point) and the kind of target it was given; MariaDB: the binary log position reached.
    recovered_to: str | None = None
    recovery_target: str | None = None
    replayed_to: str | None = None
    wal: WalFed | None = None  # a point-in-time restore's feed: the batches it fetched


class Finished(NodeResult):
    shards: list[RestoredShard]
    prefetched: Prefetched | None = None


class Aborted(NodeResult):
    aborted: bool


class Probed(NodeResult):
    put_seconds: float
    get_seconds: float


class CutShard(CommandResult):
    """One shard's restore point, as its engine made it (``shardvault.contracts.cut``'s
    marker fields, and ``cut_wal``: the WAL segment that holds it, which a restore needs
    archived)."""

    shard_id: str
    marker: Marker


class CutAnswer(NodeResult):
    shards: list[CutShard]


def problems_of(error: ValidationError, whole: str) -> str:
    """A validation error's problems, each with its field's path (``whole`` for the root)."""
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or whole}: {e['msg']}" for e in error.errors()
    )


def parse_result(model: type[Result], node_id: str, result: object) -> Result:
    """A node's answer as ``model``; AnswerMismatch naming the node and each field otherwise."""
    try:
        return model.model_validate(result)
    except ValidationError as error:
        raise AnswerMismatch(
            f"node {node_id} answered with what this control plane cannot read as "
            f"{model.__name__}: {problems_of(error, '(answer)')}.",
            fix=FIX,
        ) from None


RESULTS: dict[str, type[BaseModel]] = {
    "flush": Flushed,
    "checkpoint": Listing,  # the answer in the work bucket; the task result: AnswerReceipt
    "scan": Listing,
    "pack": ObjectChecksums,
    "upload": Uploaded,
    "stop": Listing,
    "release": Released,
    "prepare_restore": Prepared,
    "download": Downloaded,
    "finish_restore": Finished,
    "abort_restore": Aborted,
    "probe": Probed,
    "cut": CutAnswer,
}
