"""The WAL archive: the WAL files a node's agent stores as PostgreSQL writes them (continuous
archiving, issue 11), and what the control plane checks before it signs or records their upload.

Terms:
- *WAL file*: what PostgreSQL's ``archive_command`` hands to the agent's spool
  (``shardvault_agent.wal.walspool``): a segment, a timeline history file, a backup history file
  or a partial segment.
- *batch*: WAL files of one shard, in name order, stored as one object: their bytes back to
  back, packed through the part pipeline (frames, zstd, sealed under the cluster's WAL data key
  when its policy says ``encryption: kms``). A batch holds at most ``BATCH_MAX_BYTES`` of
  plaintext, so it is one PUT; many segments share one object when they arrive faster than
  the policy's ``archive.max_delay_seconds`` (fewer requests, and the RPO stays bounded).
- *request*: what an agent asks about one batch. It writes the batch's description into its
  own inbox partition (item ``#archive:<batch id>``), where ``dynamodb:LeadingKeys`` proves
  which node wrote it, then invokes the archive function with its node id and the batch id.
  The function reads the description from that item, never from the invocation, so a node
  can ask only about batches it described itself; the batch id (128 random bits, readable by
  that node alone) keeps the answer's URL from anyone who did not write the item.
- *sign*: the function checks the request (the node is a member of its cluster by the policy
  and leads the shard; every name is a WAL file's; sizes and frames agree) and answers a PUT
  URL bound to the stored bytes' CRC64NVME.
- *record*: after the upload, the function reads the stored object's checksum and size from
  the store (never the agent's word) and writes the batch's *index* beside it: its files,
  frames and key. The store alone describes the archive: a restore lists it, no catalog needed.

Store layout: beside the cluster's backups, under ``_wal/<shard>/`` (the sweep leaves it
alone), one ``.wal`` object per batch and its ``.json`` index (``shardvault.contracts.layout``).
A shard's batches are read in log order (``log_order``: PostgreSQL's names sort so; a binary
log's by its ordinal).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError
from pydantic import ValidationError

from shardvault.aws.keys import new_data_key
from shardvault.aws.services import Services
from shardvault.aws.store import is_missing
from shardvault.aws.tables import completion_order
from shardvault.contracts.catalog import BackupItem
from shardvault.contracts.layout import archive_prefix, batch_key, index_key
from shardvault.contracts.models import (
    FileEntry,
    Manifest,
    NodeRecord,
    Role,
)
from shardvault.contracts.pgwal import (
    DEFAULT_SEGMENT_SIZE,
    HISTORY_NAME,
    SEGMENT_NAME,
    segment_holding,
    segment_number,
    timeline,
)
from shardvault.contracts.wal_archive import (
    BATCH_ID,
    BATCH_MAX_BYTES,
    BINLOG_FILE,
    ONE_FILE_MAX_BYTES,
    REQUEST_PREFIX,
    WAL_DIR,
    ArchiveCall,
    Batch,
    binlog_run,
    log_order,
)
from shardvault.data.frames import unpack_frames
from shardvault.errors import ChecksumMismatch, InvalidRequest, NotAMember, ShardNotReady
from shardvault.workflow.membership import claim_problem

log = logging.getLogger("shardvault.wal.archive")
URL_TTL_SECONDS = 900  # a batch is packed before it is signed: its upload starts at once
INDEX_FORMAT = 1
PARALLEL_READS = 8  # index objects read at once (a day at a batch a minute holds 1,440)


def batch_problems(batch: Batch) -> list[str]:
    """What makes a described batch one the function will not sign."""
    problems = []
    names = [f.name for f in batch.files]
    if names != sorted(names, key=log_order) or len(set(names)) != len(names):
        problems.append("its files are not in log order, each once")
    bound = ONE_FILE_MAX_BYTES if len(names) == 1 else BATCH_MAX_BYTES  # a file is never cut
    if batch.plain_length > bound:
        problems.append(f"it holds {batch.plain_length:,} bytes, over {bound:,}")
    try:
        frames = unpack_frames(batch.frames)
    except ValueError:
        return [*problems, "its frame table does not decode"]
    expected = -(-batch.plain_length // batch.frame_size)
    if len(frames) != expected:
        problems.append(f"it has {len(frames)} frames where its files make {expected}")
    if sum(f.stored_size for f in frames) != batch.stored_length:
        problems.append("its frames' stored sizes do not add up to its stored length")
    return problems


# --- the function's steps ---------------------------------------------------------------------
def member_node(svc: Services, node_id: str) -> NodeRecord:
    """The registered node, if the policy lets it take part in its cluster."""
    node = svc.nodes.get(node_id)
    if node is None:
        raise NotAMember(
            f"node {node_id!r} is not registered: only a running agent archives WAL.",
            fix="start the node's agent (shardvault-agent run) with its configuration.",
        )
    policy = svc.policy()
    problem = claim_problem(node.cluster, node_id, policy) if policy else ""
    if problem:
        raise NotAMember(
            f"node {node_id} may not archive WAL for cluster {node.cluster!r}: {problem}.",
            fix="list the node under its cluster's 'nodes' in the policy file, or correct the "
            "agent's 'cluster' (the policy decides membership).",
        )
    return node


def settings(svc: Services, node_id: str, new_key: bool = False) -> dict[str, Any]:
    """What the node's cluster policy says of archiving: its compression, the longest a WAL file
    waits in the spool for others to share its object, and whether batches are sealed; with
    ``new_key`` (the agent's key ran out after ``key_seconds``, or it has none) and
    ``encryption: kms``, a fresh data key, wrapped (one KMS request a day per agent, not one
    per batch)."""
    node = member_node(svc, node_id)
    policy = svc.policy()
    cluster = policy.clusters.get(node.cluster) if policy else None  # absent: the defaults
    encrypt = cluster is not None and cluster.encryption == "kms"
    encryption = None
    if encrypt and new_key:
        chain = f"wal/{node_id}/{int(time.time())}"
        encryption = new_data_key(svc, node.cluster, chain).model_dump()
    archive = cluster.archive if cluster is not None else None
    return {
        "cluster": node.cluster,
        "compression": cluster.compression.model_dump(mode="json") if cluster else None,
        "max_delay_seconds": archive.max_delay_seconds if archive else None,
        "key_seconds": archive.key_seconds if archive else None,
        "batch_max_bytes": BATCH_MAX_BYTES,
        "encrypt": encrypt,
        "encryption": encryption,
    }


def requested_batch(svc: Services, node_id: str, batch_id: str | None) -> Batch:
    """The batch the node described in its own inbox partition."""
    if batch_id is None or not BATCH_ID.fullmatch(batch_id):
        raise InvalidRequest(
            "an archive call names no batch, or not by its 32 hex digits.",
            fix="call sign and record with the batch id of a request item.",
        )
    item = svc.inbox.table.get_item(
        Key={"node_id": node_id, "command_id": f"{REQUEST_PREFIX}{batch_id}"},
        ConsistentRead=True,
    ).get("Item")
    if item is None or "batch" not in item:
        raise InvalidRequest(
            f"node {node_id} has no archive request {batch_id}.",
            fix="write the batch into the node's inbox item #archive:<batch id> before asking.",
        )
    try:
        batch = Batch.model_validate_json(item["batch"])
    except ValidationError as error:
        raise InvalidRequest(
            f"archive request {batch_id} of node {node_id} is malformed: "
            + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
            + ".",
            fix="this is an agent defect: upgrade the agent (its spool keeps the WAL meanwhile).",
        ) from None
    if batch.batch_id != batch_id:
        raise InvalidRequest(
            f"archive request {batch_id} describes batch {batch.batch_id}.",
            fix="write each batch under its own id.",
        )
    return batch


def checked_batch(svc: Services, node: NodeRecord, batch_id: str | None) -> Batch:
    batch = requested_batch(svc, node.node_id, batch_id)
    led = {s.shard_id for s in node.shards if s.role == Role.LEADER}
    if batch.shard_id not in led:
        raise ShardNotReady(
            f"node {node.node_id} asks to archive WAL of shard {batch.shard_id}, which it does "
            "not lead: only a shard's leader archives its WAL.",
            fix="set archive_command on the shard's primary only, or correct the agent's "
            "shard role.",
        )
    problems = batch_problems(batch)
    if problems:
        raise InvalidRequest(
            f"archive batch {batch.batch_id} of node {node.node_id} is malformed: "
            + "; ".join(problems)
            + ".",
            fix="this is an agent defect: upgrade the agent (its spool keeps the WAL meanwhile).",
        )
    return batch


def sign(svc: Services, node_id: str, batch_id: str | None) -> dict[str, Any]:
    """A PUT URL for the batch's object that takes only its bytes (their CRC64NVME)."""
    node = member_node(svc, node_id)
    batch = checked_batch(svc, node, batch_id)
    key = batch_key(svc.store.prefix, node.cluster, batch)
    url = svc.store_bucket.presign_put(key, URL_TTL_SECONDS, batch.crc64nvme)
    return {"key": key, "url": url}


def record(svc: Services, node_id: str, batch_id: str | None, now: float) -> dict[str, Any]:
    """Checks the stored object against the batch (from the store's own checksum and size)
    and writes its index; returns the index's key. Recording again writes the same index."""
    node = member_node(svc, node_id)
    batch = checked_batch(svc, node, batch_id)
    key = batch_key(svc.store.prefix, node.cluster, batch)
    bucket = svc.store_bucket
    try:
        crc, size = bucket.stored_checksum(key)
    except ClientError as error:
        if not is_missing(error):
            raise
        crc, size = None, -1  # not uploaded: refused below like any other object
    if crc != batch.crc64nvme or size != batch.stored_length:
        raise ChecksumMismatch(
            f"archive batch {key} is not stored as described: the store holds {size} bytes "
            f"with CRC64NVME {crc}, the agent packed {batch.stored_length} with "
            f"{batch.crc64nvme}.",
            fix="the agent uploads the batch again (its spool keeps the WAL until it is recorded).",
        )
    index = {
        "format": INDEX_FORMAT,
        "cluster": node.cluster,
        "node_id": node.node_id,
        "archived_at": now,
        "key": key,
        **batch.model_dump(mode="json"),
    }
    body = json.dumps(index, separators=(",", ":")).encode()
    bucket.put(index_key(key), body, ContentType="application/json")
    try:  # for the cost model only: a batch recorded again may count twice, none is lost
        svc.catalog.count_archived(
            node.cluster, stored_bytes=batch.stored_length, wal_bytes=batch.plain_length, now=now
        )
    except ClientError as error:
        log.warning("archive of %s not counted: %s", node.cluster, error)
    return {"key": key, "index": index_key(key), "files": len(batch.files)}


def call(svc: Services, event: ArchiveCall, now: float) -> dict[str, Any]:
    if event.action == "settings":
        return settings(svc, event.node_id, event.new_key)
    if event.action == "sign":
        return sign(svc, event.node_id, event.batch_id)
    return record(svc, event.node_id, event.batch_id, now)


def archived_batches(
    svc: Services, cluster: str, shard_id: str, since: str = ""
) -> list[dict[str, Any]]:
    """The recorded batches of a shard's archive, in WAL order (their indexes); with
    ``since``, only those whose last file is not before it (named in the key: no read)."""
    bucket = svc.store_bucket
    prefix = archive_prefix(svc.store.prefix, cluster, shard_id)
    named = {
        o["Key"]: names
        for o in bucket.objects(prefix)
        if o["Key"].endswith(".json") and (names := batch_names(o["Key"])) is not None
    }
    after = log_order(since) if since else None
    keys = [k for k, (_, last) in named.items() if after is None or log_order(last) >= after]
    keys.sort(key=lambda k: (log_order(named[k][0]), k))

    def read(key: str) -> dict[str, Any]:
        return json.loads(bucket.read(key))  # type: ignore[no-any-return]

    with ThreadPoolExecutor(PARALLEL_READS) as pool:  # each read waits on the store
        return list(pool.map(read, keys))


# --- what a point-in-time restore reads -------------------------------------------------------


@dataclass(frozen=True)
class ShardArchive:
    """What a shard's archive offers a restore from one backup: the batches that hold the WAL
    from ``first`` (the segment the backup's own WAL ends in) on, without a gap, to ``last``;
    ``reaches``: when the newest of those was pushed (nothing written later is archived);
    ``newest``: the newest segment the archive holds on the run's timelines (past ``last``
    when a gap stops the run)."""

    shard_id: str
    first: str
    last: str | None
    reaches: float
    batches: list[dict[str, Any]]
    indexes: list[dict[str, Any]]  # every batch read (the run's and any past a gap)
    newest: str | None = None

    def holds(self, segment: str) -> bool:
        """Whether the run reaches WAL ``segment`` without a gap (PostgreSQL's archive)."""
        return self.last is not None and segment_number(self.last) >= segment_number(segment)

    def holds_past_a_gap(self, segment: str) -> bool:
        """Whether the archive holds ``segment`` or later, with a gap before it."""
        newest = self.newest
        return newest is not None and segment_number(newest) >= segment_number(segment)


def wal_from(manifest: Manifest, shard_id: str) -> str | None:
    """The segment a backup's own WAL of the shard ends in (the cut's, or the stop's): where a
    point-in-time restore from it starts reading the archive, and what the archive must keep
    for it; None for a shard without WAL (SQLite) or a backup older than cuts and stops."""
    shard = next(s for s in manifest.shards if s.shard_id == shard_id)
    marker = shard.marker
    if binlog := marker.get("binlog_file"):  # MariaDB: the binary log its copy ends in
        return binlog
    start = marker.get("start_wal")
    if start and marker.get("cut_lsn"):
        return segment_holding(timeline(start), marker["cut_lsn"], DEFAULT_SEGMENT_SIZE)
    return marker.get("stop_wal") or None


def newer_timelines(on_timeline: int, names: set[str]) -> set[int]:
    """The timelines after ``on_timeline`` whose history files ``names`` hold: a promotion
    (a failover, a restore in place) starts one and archives its history file first."""
    return {timeline(n) for n in names if HISTORY_NAME.fullmatch(n) and timeline(n) > on_timeline}


def binlog_archive(shard_id: str, first: str, indexes: list[dict[str, Any]]) -> ShardArchive:
    """The run of archived binary logs from ``first`` on: consecutive ordinals of its
    basename (``binlog_run``), without a gap or a name reused, and the batches that hold it.
    ``reaches``: when the newest was closed (the file's modification time as the agent read
    it)."""
    pushed: dict[str, float] = {}
    sizes: dict[str, set[int]] = {}
    for index in indexes:
        for entry in index["files"]:
            name = entry["name"]
            pushed[name] = max(pushed.get(name, 0.0), entry.get("pushed_at", 0))
            sizes.setdefault(name, set()).add(entry["size"])
    # A name stored with two sizes is two files (a RESET MASTER, another server after a
    # failover): left out, it ends the run before it, so no replay splices two histories.
    run = binlog_run(first, (n for n, held in sizes.items() if len(held) == 1))
    base, start = log_order(first)
    later = [n for n in sizes if BINLOG_FILE.fullmatch(n) and log_order(n) >= (base, start)]
    newest = max((n for n in later if log_order(n)[0] == base), key=log_order, default=None)
    return archive_of(shard_id, first, run, set(run), indexes, pushed, newest)


def archive_of(
    shard_id: str,
    first: str,
    run: list[str],
    wanted: set[str],
    indexes: list[dict[str, Any]],
    pushed: dict[str, float],
    newest: str | None,
) -> ShardArchive:
    """The shard's archive for a ``run`` of files: the batches holding any ``wanted`` file."""
    batches = [i for i in indexes if wanted & {f["name"] for f in i["files"]}] if run else []
    return ShardArchive(
        shard_id=shard_id,
        first=first,
        last=run[-1] if run else None,
        reaches=max((pushed[n] for n in run), default=0.0),
        batches=batches,
        indexes=indexes,
        newest=newest,
    )


def shard_archive(shard_id: str, first: str, indexes: list[dict[str, Any]]) -> ShardArchive:
    """The run of archived segments from ``first`` on, without a gap, and the batches that
    hold it (in WAL order).

    The run crosses into newer timelines: a segment is found on ``first``'s timeline or any
    newer one whose history file is archived, the newest timeline's copy named. A promoted
    server goes on writing the segment its old timeline was in when it was promoted, under its
    new timeline's name, while its old timeline's copy of that segment stays unfinished (never
    archived, or archived as ``.partial``). Which copy recovery reads is PostgreSQL's choice
    (``recovery_target_timeline = 'latest'``: it follows the history files, which the run's
    batches include); this check only proves that no segment number is missing."""
    names = {entry["name"] for index in indexes for entry in index["files"]}
    lineage = {timeline(first)} | newer_timelines(timeline(first), names)
    held: dict[int, str] = {}  # segment number: the newest timeline's copy's name
    pushed: dict[str, float] = {}
    for index in indexes:
        for entry in index["files"]:
            name = entry["name"]
            pushed[name] = max(pushed.get(name, 0.0), entry.get("pushed_at", 0))
            if SEGMENT_NAME.fullmatch(name) and timeline(name) in lineage:
                number = segment_number(name)
                held[number] = max(held.get(number, name), name)
    run, number = [], segment_number(first)
    while number in held:
        run.append(held[number])
        number += 1
    numbers = set(range(segment_number(first), number))
    wanted = {
        n
        for n in names
        if (SEGMENT_NAME.fullmatch(n) and timeline(n) in lineage and segment_number(n) in numbers)
        or (HISTORY_NAME.fullmatch(n) and timeline(n) in lineage)
    }
    newest = held[max(held)] if held else None
    return archive_of(shard_id, first, run, wanted, indexes, pushed, newest)


def after_backup(svc: Services, manifest: Manifest, shard_id: str) -> ShardArchive | None:
    """The shard's archive from the segment the backup's own WAL ends in (``wal_from``) on;
    None for a shard without that position (SQLite, a backup older than cuts and stops)."""
    first = wal_from(manifest, shard_id)
    if first is None:
        return None
    indexes = archived_batches(svc, manifest.cluster, shard_id, since=first)
    run = binlog_archive if BINLOG_FILE.fullmatch(first) else shard_archive
    return run(shard_id, first, indexes)


def wal_stream(batches: list[dict[str, Any]]) -> tuple[list[FileEntry], list[int]]:
    """The restored shard's WAL stream: each batch's files under ``WAL_DIR`` (a file a later
    batch holds again goes under ``WAL_DIR/dup/<batch id>/``, never over the first copy), and
    each batch's offset in the stream."""

    def path_of(name: str, batch_id: str, again: bool) -> str:
        return f"{WAL_DIR}/dup/{batch_id}/{name}" if again else f"{WAL_DIR}/{name}"

    files, offsets = batch_files(batches, path_of)
    return [FileEntry(path=f"{WAL_DIR}/", size=0), *files], offsets


def batch_files(
    batches: list[dict[str, Any]], path_of: Callable[[str, str, bool], str]
) -> tuple[list[FileEntry], list[int]]:
    """Batches laid end to end as files: each file at ``path_of(name, batch id, again)``
    (``again``: an earlier batch holds that name too), and each batch's offset."""
    files: list[FileEntry] = []
    offsets, seen, offset = [], set(), 0
    for index in batches:
        offsets.append(offset)
        for entry in index["files"]:
            name = entry["name"]
            files.append(
                FileEntry(path=path_of(name, index["batch_id"], name in seen), size=entry["size"])
            )
            seen.add(name)
            offset += entry["size"]
    return files, offsets


# --- expiry -------------------------------------------------------------------------------------
def batch_names(key: str) -> tuple[str, str] | None:
    """The first and last file a batch's key names (its object's or its index's)."""
    parts = key.rsplit("/", 1)[-1].split("--")
    return (parts[0], parts[1]) if len(parts) == 3 else None


def expired_keys(keys: list[str], cutoffs: dict[str, str]) -> list[str]:
    """Of a cluster's archive keys, those of batches no kept backup needs: every file a
    segment of one timeline (or a backup history file, named after one), before the segment
    its shard's oldest kept backup starts from (``cutoffs``, by shard). Timeline history files
    (``<timeline>.history``: they sort between two timelines' segments, so a batch of one
    timeline holds none) are never expired: a few bytes each, and a recovery across timelines
    reads them. A shard without a cutoff keeps everything."""
    expired = []
    for key in keys:
        shard_id = key.rsplit("/", 2)[-2]
        names = batch_names(key)
        cutoff = cutoffs.get(shard_id)
        if names is None or cutoff is None:
            continue
        if BINLOG_FILE.fullmatch(names[1]):  # before the cutoff's ordinal, of its basename
            (base, last_ordinal), (cut_base, cut_ordinal) = map(log_order, (names[1], cutoff))
            if BINLOG_FILE.fullmatch(cutoff) and base == cut_base and last_ordinal < cut_ordinal:
                expired.append(key)
            continue
        first, last = (name[:24] for name in names)  # a backup history file: its segment's
        segments = SEGMENT_NAME.fullmatch(first) and SEGMENT_NAME.fullmatch(last)
        if segments and timeline(first) == timeline(last) and last < cutoff:
            expired.append(key)
    return expired


def cutoffs(
    backups: list[BackupItem], window_days: float | None = None, now: float = 0.0
) -> dict[str, str]:
    """Per shard, where the archive's oldest needed WAL begins: the ``wal_from`` of the base a
    restore to the window's start would use (the newest complete backup that completed
    before it), or, without a window, of the oldest complete backup. Nothing (everything kept)
    when that backup predates the record."""
    base = kept_base(backups, window_days, now)
    return dict(base.wal_from) if base is not None else {}


def kept_base(
    backups: list[BackupItem], window_days: float | None = None, now: float = 0.0
) -> BackupItem | None:
    """The backup the kept archive starts from (``cutoffs``): nothing before its completion
    can be restored to any more. None: no complete backup (everything is kept)."""
    complete = sorted((b for b in backups if b.status == "COMPLETE"), key=completion_order)
    if not complete:
        return None
    base = complete[0]
    if window_days is not None:
        start = now - window_days * 86400
        before = [b for b in complete if (b.completed_at or 0) <= start]
        base = before[-1] if before else base
    return base
