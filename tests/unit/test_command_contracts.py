"""The agent commands' contract (``shardvault.contracts.commands``): each command's arguments
as their producers really post them are accepted, and each model refuses by name what its
consumer would not read.

The arguments come from the producers themselves, not from copies of their shapes: each
dispatch task of the state machines is resolved (its Map's ItemSelector, then its Payload)
against state the control plane's own steps made (``prepare_scan``, the backup's ``plan`` and
``sign``, the restore's ``plan``, ``sign_prefetch`` and ``sign_download``, the probe's
``plan``), handed to ``dispatch``, and read back from the node's inbox as its agent reads it;
the cleanups post theirs themselves. An SQLite agent then runs what it can run without a
store (flush, checkpoint, pack, stop, release, probe, prepare and abort of a restore), and its
results are checked against their models."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import BaseModel
from shardvault_agent.commands import Commands
from shardvault_agent.engines.sqlite.adapter import SqliteAdapter
from shardvault_agent.ratelimit import RateLimiter

from shardvault.assurance import probe
from shardvault.aws.services import Services
from shardvault.backup import planner as backup_planner
from shardvault.backup.failure import post_releases
from shardvault.backup.scanning import prepare_scan
from shardvault.backup.upload import sign
from shardvault.contracts import deployment
from shardvault.contracts.commands import (
    ARGUMENTS,
    RESULTS,
    AnswerReceipt,
    ArgsByUrl,
    CheckpointArgs,
    DownloadArgs,
    FinishRestoreArgs,
    Listing,
    ParentMap,
    Prefetch,
    PrepareRestoreArgs,
    ScanArgs,
    StopArgs,
    UploadArgs,
    parse_args,
)
from shardvault.contracts.models import (
    BackupKind,
    ChainLink,
    ChainSource,
    DownloadItem,
    Encryption,
    FileEntry,
    Manifest,
    ManifestShard,
    ManifestStream,
    NodeAssignment,
    ObjectChecksums,
    ObjectPlan,
    ObjectResult,
    Phase,
    RestoreContext,
    RestoreTarget,
    RetrievalTier,
    ShardPlacement,
    Source,
    UploadLimits,
)
from shardvault.errors import InvalidRequest
from shardvault.restore import planner as restore_planner
from shardvault.restore.download import sign_download
from shardvault.restore.failure import reap
from shardvault.workflow.dispatch import COMMANDS, DispatchRequest, dispatch
from tests.unit.support import catalog_item

from .support import (
    leader_node,
    lone_node_context,
    moto_services,
    restore_target,
    sqlite_agent,
    with_buckets,
)

STATEMACHINES = Path(__file__).parents[2] / "statemachines"
ENTERED = "2026-11-23T14:02:59.123Z"  # the Stop step's start ($$.State.EnteredTime)
ENCRYPTION = Encryption(
    key_id="arn:aws:kms:us-east-1:111122223333:key/k",
    wrapped_key=base64.b64encode(b"wrapped").decode(),
    context={"shardvault:cluster": "c"},
    key_check="check",
)
# The dispatcher's keys that bring other arguments: a work object's (inlined, or by URL), a
# prepare's prefetch, a finish's WAL feed, a backup's scan arguments (parents, pack, stop).
TRANSPORT = {"args_key", "prefetch_urls_key", "wal_urls_key", "scan_args"}


# --- The state machines' dispatch tasks ---------------------------------------------------------
def dispatch_tasks() -> dict[tuple[str, str], tuple[dict[str, Any], dict[str, Any] | None]]:
    """Every dispatch task, by (state machine, state name): the task and its Map (None: not in
    one)."""
    found: dict[tuple[str, str], tuple[dict[str, Any], dict[str, Any] | None]] = {}

    def walk(machine: str, states: dict[str, Any], in_map: dict[str, Any] | None) -> None:
        for name, state in states.items():
            payload = state.get("Parameters", {}).get("Payload", {})
            if "command" in payload:
                found[(machine, name)] = (state, in_map)
            for branch in state.get("Branches", []):
                walk(machine, branch["States"], in_map)
            if processor := state.get("ItemProcessor") or state.get("Iterator"):
                walk(machine, processor["States"], state)

    for path in sorted(STATEMACHINES.glob("*.asl.json")):
        walk(path.name.removesuffix(".asl.json"), json.loads(path.read_text())["States"], None)
    return found


TASKS = dispatch_tasks()


def resolve(template: dict[str, Any], data: Any, context: dict[str, Any]) -> dict[str, Any]:
    """A Step Functions template (``"key.$": "$.path"``) resolved as the service does; a path
    that is not there raises, as it fails the execution."""

    def lookup(path: str) -> Any:
        value, rest = (context, path[3:]) if path.startswith("$$.") else (data, path[2:])
        for part in rest.split("."):
            value = value[part]
        return value

    out: dict[str, Any] = {}
    for key, value in template.items():
        if key.endswith(".$"):
            out[key[:-2]] = lookup(value)
        else:
            out[key] = resolve(value, data, context) if isinstance(value, dict) else value
    return out


def posted(
    svc: Services,
    task: tuple[str, str],
    state: dict[str, Any],
    item: dict[str, Any] | None = None,
    inner: dict[str, Any] | None = None,
) -> tuple[str, dict[str, Any]]:
    """The command and arguments the node's inbox holds once ``task`` dispatched: ``state`` is
    the execution's, ``item`` the Map's item, ``inner`` what the Map's earlier states added."""
    definition, in_map = TASKS[task]
    context = {
        "Task": {"Token": f"token-{task[1]}"},
        "State": {"EnteredTime": ENTERED},
        "Map": {"Item": {"Value": item}},
    }
    data = state
    if in_map is not None and "ItemSelector" in in_map:
        data = resolve(in_map["ItemSelector"], state, context)
    payload = resolve(definition["Parameters"]["Payload"], data | (inner or {}), context)
    sent = dispatch(DispatchRequest(**payload), svc, time.time())
    return inboxed(svc, sent["node_id"], sent["command_id"])


def inboxed(svc: Services, node_id: str, command_id: str) -> tuple[str, dict[str, Any]]:
    """A command as the node's agent reads it from its inbox (``daemon``: ``item["args"]``)."""
    item = next(i for i in svc.inbox.pending(node_id) if i["command_id"] == command_id)
    return item["command"], item["args"]


# --- Backups and restores made by the control plane's own steps ---------------------------------
def stored_object(backup_id: str, phase: Phase, length: int) -> ObjectResult:
    return ObjectResult(
        key=f"backups/c/{backup_id}/s1/{phase}-00000",
        node_id="n1",
        shard_id="s1",
        phase=phase,
        index=0,
        stream_offset=0,
        length=length,
        part_size=8 << 20,
        part_count=1,
        crc64nvme="AAAAAAAAAAA=",
        verified_by="attributes",
        stored_length=length + 64,
        frame_size=1 << 20,
        frames="",
        key_check="check",
    )


def stored_manifest(backup_id: str, chain: ChainLink | None) -> Manifest:
    files = [FileEntry(path="s1.db", size=8192)]
    shard = ManifestShard(
        shard_id="s1",
        node_id="n1",
        marker={"snapshot_at": "1.000000", "schema_version": "1"},
        checkpoint_at=1.0,
        streams=[
            ManifestStream(
                phase=Phase.DATA,
                files=files,
                objects=[stored_object(backup_id, Phase.DATA, 8192)],
                extents="",  # an incremental that changed nothing in s1
            ),
            ManifestStream(
                phase=Phase.TAIL,
                files=[FileEntry(path="s1.db-wal", size=100)],
                objects=[stored_object(backup_id, Phase.TAIL, 100)],
            ),
        ],
        blockmap=stored_object(backup_id, Phase.BLOCKMAP, 64),
    )
    return Manifest(
        backup_id=backup_id,
        cluster="c",
        engine="sqlite",
        started_at=0.0,
        completed_at=1.0,
        checkpoint_skew_seconds=0.0,
        part_size=8 << 20,
        shards=[shard],
        bytes=8292,
        objects=3,
        parts=3,
        verification="attributes",
        encryption=ENCRYPTION,
        kind=BackupKind.INCREMENTAL if chain else BackupKind.FULL,
        chain=chain,
    )


def store_chain(svc: Services) -> dict[str, str]:
    """A full and an incremental of cluster c in the store and the catalog; their manifest
    keys by backup id."""
    keys = {}
    link = ChainLink(parent_id="full", root_id="full", depth=1, ancestors=["full"])
    for backup_id, chain in (("full", None), ("incr", link)):
        key = keys[backup_id] = f"backups/c/{backup_id}/manifest.json"
        body = stored_manifest(backup_id, chain).model_dump_json().encode()
        svc.store_s3.put_object(Bucket="store", Key=key, Body=body)
        svc.catalog.put(
            catalog_item(
                {
                    "cluster": "c",
                    "backup_id": backup_id,
                    "status": "COMPLETE",
                    "manifest_key": key,
                    "bytes_total": 8292,
                }
            )
        )
    return keys


def restore_context(restore_id: str, backup_id: str, keys: dict[str, str]) -> RestoreContext:
    chain = [ChainSource(backup_id="full", manifest_key=keys["full"], source="store")]
    return RestoreContext(
        restore_id=restore_id,
        cluster="c",
        backup_id=backup_id,
        manifest_key=keys[backup_id],
        target_cluster="c",  # into its own cluster: the data keys open as they are
        placements=[ShardPlacement(shard_id="s1", node_id="n1", bytes=8292)],
        assignments=[NodeAssignment(node_id="n1", shard_ids=["s1"], bytes=8292)],
        bytes=8292,
        objects=3,
        tier=RetrievalTier.STANDARD,
        replace=False,
        plan_only=False,
        validation_queries=["SELECT count(*) FROM t"],
        heapallindexed=True,
        started_at=0.0,
        execution_id=f"arn:aws:states:us-east-1:1:execution:restore:{restore_id}",
        chain=chain if backup_id == "incr" else [],
    )


class Sender:
    """The agent's sender, as far as the commands run here use it: answers and the probe's
    PUT are kept, and read back by the probe's GET."""

    http = None

    def __init__(self) -> None:
        self.answers: list[bytes] = []
        self.probe = b""

    def send_answer(self, url: str, body: bytes, what: str) -> None:
        self.answers.append(body)

    def send_probe(self, url: str, body: bytes, crc64nvme: str) -> None:
        self.probe = body

    def fetch(self, url: str, what: str, offset: int, size: int, write: Any) -> str:
        write(0, self.probe[offset : offset + size])
        return ""


Posted = dict[str, tuple[str, dict[str, Any]]]
Results = dict[str, tuple[type[BaseModel], dict[str, Any]]]


def backup_flow(svc: Services, tmp: Path, posts: Posted, results: Results) -> None:
    """A full backup of node n1 (one SQLite shard) as its state machine runs it, each command
    dispatched and run by the node's agent; its upload and failure path dispatched only."""
    sender = Sender()
    config = sqlite_agent(tmp, rows=20)
    agent = Commands(config, SqliteAdapter(config), RateLimiter(None), sender=sender)
    agent.__dict__["restorer"] = SimpleNamespace(downloader=sender)  # the probe's GET

    def run(label: str, command: str, args: dict[str, Any]) -> dict[str, Any]:
        result = agent.run(command, args)
        results[label] = (RESULTS[command], result)
        return result

    def answered(label: str, command: str, args: dict[str, Any], phase: Phase) -> dict:
        receipt = agent.run(command, args)
        answer = json.loads(sender.answers[-1])
        results[label] = (AnswerReceipt, receipt)
        results[f"{label} answer"] = (RESULTS[command], answer)
        key = svc.answer_key(args["backup_id"], phase, "n1")
        svc.work_s3.put_object(Bucket="work", Key=key, Body=sender.answers[-1])
        return receipt

    limits = UploadLimits(parallelism=2, throttle="static", max_held_log_bytes=1 << 30)
    context = lone_node_context("b1", upload=limits, cut_commit_lock=7, cut_commit_database="app")
    svc.catalog.put(catalog_item({"cluster": "c", "backup_id": "b1", "status": "RUNNING"}))
    state: dict[str, Any] = {"backup": context.model_dump(mode="json")}
    state["scan"] = prepare_scan(context, svc)
    source = state["backup"]["sources"][0]

    posts["flush"] = posted(svc, ("backup", "FlushNode"), state, source)
    run("flush", *posts["flush"])
    posts["checkpoint"] = posted(svc, ("backup", "CheckpointNode"), state, source)
    receipt = answered("checkpoint", *posts["checkpoint"], Phase.DATA)

    state["plan"] = backup_planner.plan(context, [receipt], Phase.DATA, svc)
    item = svc.get_work(state["plan"]["plan_key"])[0]
    not_signed = {"signed": {"upload_id": None}}  # the Map's NotSignedYet
    posts["pack"] = posted(svc, ("backup", "Pack"), state, item, not_signed)
    sums = run("pack", *posts["pack"])
    plan, checksums = ObjectPlan(**item["object"]), ObjectChecksums(**sums)
    signed = sign(plan, checksums, None, svc)
    picked = {k: signed[k] for k in ("upload_id", "urls_key", "checksums")}  # ResultSelector
    posts["upload"] = posted(svc, ("backup", "Transfer"), state, item, {"signed": picked})

    posts["stop"] = posted(svc, ("backup", "StopNode"), state, source)
    receipt = answered("stop", *posts["stop"], Phase.TAIL)
    tail = backup_planner.plan(context, [receipt], Phase.TAIL, svc)
    items = svc.get_work(tail["plan_key"])
    signed_at_plan = next(i for i in items if i.get("signed"))  # packed at the stop
    posts["upload signed at plan"] = posted(
        svc, ("backup", "TransferSigned"), state, signed_at_plan
    )

    posts["release after failure"] = posted(
        svc, ("backup", "ReleaseAfterFailureNode"), state, source
    )
    post_releases(context, svc)
    posts["release by the cleanup"] = inboxed(svc, "n1", "release:b1:cleanup")
    posts["release"] = posted(svc, ("backup", "ReleaseNode"), state, source)
    run("release", *posts["release"])

    checked = probe.plan(probe.ProbeRequest(cluster="c"), svc, time.time())
    posts["probe"] = posted(svc, ("probe", "ProbeNode"), {"plan": checked}, checked["nodes"][0])
    run("probe", *posts["probe"])


def incremental_flows(svc: Services, posts: Posted) -> None:
    """An incremental of a lone node (it scans, packs and stops in its checkpoint), and one of
    more nodes than a Map runs at once (it scans in a Scan step apart): dispatched only."""
    link = ChainLink(parent_id="incr", root_id="full", depth=2, ancestors=["full", "incr"])
    context = lone_node_context(
        "b2",
        kind=BackupKind.INCREMENTAL,
        chain=link,
        encryption=ENCRYPTION,
        cut_commit_lock=7,
        cut_commit_database="app",
    )
    state = {"backup": context.model_dump(mode="json"), "scan": prepare_scan(context, svc)}
    source = state["backup"]["sources"][0]
    posts["checkpoint of a lone incremental"] = posted(
        svc, ("backup", "CheckpointNode"), state, source
    )

    more = context.model_copy(update={"backup_id": "b3"})
    more = more.model_copy(
        update={"sources": [*more.sources, Source(node_id="n2", shard_ids=["s2"])]}
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(deployment, "NODE_MAP_CONCURRENCY", 1)
        state = {"backup": more.model_dump(mode="json"), "scan": prepare_scan(more, svc)}
    posts["checkpoint before a scan"] = posted(svc, ("backup", "CheckpointNode"), state, source)
    posts["scan"] = posted(svc, ("backup", "ScanNode"), state, source)


def restore_flows(svc: Services, tmp: Path, keys: dict[str, str], posts: Posted, results: Results):
    """A restore of the full (its prepare and abort run by a target node's agent), and of the
    incremental (its chain prefetched) dispatched only; a point-in-time restore's prepare, a
    reaped restore's and a drill's aborts."""
    config = restore_target(tmp)
    agent = Commands(config, SqliteAdapter(config), RateLimiter(None), SimpleNamespace(http=None))
    for restore_id, backup_id in (("r1", "full"), ("r2", "incr")):
        context = restore_context(restore_id, backup_id, keys)
        state = {"restore": context.model_dump(mode="json")}
        state["plan"] = restore_planner.plan(context, svc)
        node = state["plan"]["nodes"][0]
        prefetch = node["prefetch_key"]
        url_key = restore_planner.sign_prefetch(prefetch, svc)["url_key"] if prefetch else None
        label = f"prepare_restore of the {backup_id}"
        posts[label] = posted(
            svc, ("restore", "PrepareNode"), state, node, {"signed": {"url_key": url_key}}
        )
        for item in svc.get_work(state["plan"]["plan_key"]):
            download = DownloadItem(**item["object"])
            label = (
                f"download of the {backup_id}'s {download.phase}{' (chain)' * download.from_chain}"
            )
            signed = {"signed": sign_download(download, svc)}
            posts[label] = posted(svc, ("restore", "Fetch"), state, item, signed)
        posts[f"finish_restore of the {backup_id}"] = posted(
            svc, ("restore", "FinishNode"), state, node, {"signed": {"url_key": None}}
        )
        posts[f"abort_restore of the {backup_id}"] = posted(
            svc, ("restore", "AbortNode"), state, state["restore"]["assignments"][0]
        )
    for label in ("prepare_restore of the full", "abort_restore of the full"):
        command, args = posts[label]
        results[label] = (RESULTS[command], agent.run(command, args))

    manifest = stored_manifest("full", None)
    wal = DownloadItem(
        restore_id="r3",
        target_cluster="c",
        node_id="n1",
        shard_id="s1",
        phase=Phase.WAL,
        key="backups/c/_wal/s1/a--b--x.wal",
        stream_offset=0,
        length=16 << 20,
        part_size=8 << 20,
        part_count=2,
        crc64nvme="AAAAAAAAAAA=",
        encryption=ENCRYPTION,
    )
    wal_files = [FileEntry(path="pg_wal_restore/000000010000000000000003", size=16 << 20)]
    args = restore_planner.prepare_args(
        manifest.shards,
        ENCRYPTION,
        [],
        {"s1": (wal_files, [wal])},
        RestoreTarget(time="2026-11-23T14:02:59+00:00"),
    )
    args_key = svc.work_key("r3", "prepare", "n1.json")
    svc.put_work(args_key, args)
    state = {"restore": restore_context("r3", "full", keys).model_dump(mode="json")}
    node = {"node_id": "n1", "args_key": args_key, "prefetch_key": None}
    posts["prepare_restore to a point in time"] = posted(
        svc, ("restore", "PrepareNode"), state, node, {"signed": {"url_key": None}}
    )
    # Its finish feeds recovery the archive's batches, signed as it starts (``SignWal``).
    wal_key = restore_planner.put_items(
        svc, restore_context("r3", "full", keys), "wal/n1.json", [wal]
    )
    signed = restore_planner.sign_prefetch(wal_key, svc)
    finish = {"node_id": "n1", "shard_ids": ["s1"], "wal_key": wal_key}
    posts["finish_restore to a point in time"] = posted(
        svc, ("restore", "FinishNode"), state, finish, {"signed": signed}
    )

    record = next(r for r in svc.catalog.restores("c") if r.restore_id == "r2")
    reap(record.execution_id, "ABORTED", "c", svc, time.time())
    posts["abort_restore by the reaper"] = inboxed(svc, "n1", "abort_restore:r2:reaped")
    teardown = {"node_id": "n1", "restore_id": "r1", "drill_id": "d1"}
    posts["abort_restore of a drill"] = posted(svc, ("drill", "TeardownNode"), {}, teardown)


@pytest.fixture(scope="module")
def produced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Posted, Results]]:
    """Every command as its producers posted it, and what the agents answered, by label."""
    posts: Posted = {}
    results: Results = {}
    with pytest.MonkeyPatch.context() as patch, moto_services(patch, work_bucket="work") as svc:
        with_buckets(svc, "work", "store")
        svc.nodes.put(leader_node("c", time.time()).model_copy(update={"node_id": "n1"}))
        keys = store_chain(svc)
        backup_flow(svc, tmp_path_factory.mktemp("backup"), posts, results)
        incremental_flows(svc, posts)
        restore_flows(svc, tmp_path_factory.mktemp("restore"), keys, posts, results)
    return posts, results


POSTED = [
    "flush",
    "checkpoint",
    "pack",
    "upload",
    "stop",
    "upload signed at plan",
    "release",
    "release after failure",
    "release by the cleanup",
    "probe",
    "checkpoint of a lone incremental",
    "checkpoint before a scan",
    "scan",
    "prepare_restore of the full",
    "prepare_restore of the incr",
    "prepare_restore to a point in time",
    "download of the full's data",
    "download of the full's tail",
    "download of the incr's data (chain)",
    "download of the incr's tail",
    "finish_restore of the full",
    "finish_restore of the incr",
    "finish_restore to a point in time",
    "abort_restore of the full",
    "abort_restore of the incr",
    "abort_restore by the reaper",
    "abort_restore of a drill",
]
ANSWERED = [
    "flush",
    "checkpoint",
    "checkpoint answer",
    "pack",
    "stop",
    "stop answer",
    "release",
    "probe",
    "prepare_restore of the full",
    "abort_restore of the full",
]


# --- The tests ----------------------------------------------------------------------------------
def test_every_command_has_a_model_and_a_state_machine_that_dispatches_it():
    assert set(ARGUMENTS) == set(RESULTS) == set(COMMANDS)
    dispatched = {task["Parameters"]["Payload"]["command"] for task, _ in TASKS.values()}
    assert dispatched == set(COMMANDS)


@pytest.mark.parametrize("task", sorted(TASKS), ids=lambda t: f"{t[0]}-{t[1]}")
def test_every_argument_a_state_machine_sends_is_a_field_of_its_command(task):
    payload = TASKS[task][0]["Parameters"]["Payload"]
    fields = set(ARGUMENTS[payload["command"]].model_fields)
    sent = {key.removesuffix(".$") for key in payload["args"]}
    assert sent - fields - TRANSPORT == set()


def test_every_producer_was_heard(produced):
    posts, results = produced
    assert sorted(posts) == sorted(POSTED)
    assert sorted(results) == sorted(ANSWERED)


@pytest.mark.parametrize("label", POSTED)
def test_the_arguments_as_posted_are_accepted(produced, label):
    command, args = produced[0][label]
    parsed = parse_args(command, args)
    assert isinstance(parsed, ARGUMENTS[command])
    assert parsed.backup_id == args["backup_id"]
    # Nothing posted is dropped or changed by the model on its way to the handler.
    assert parsed.model_dump(mode="json", exclude_unset=True) == args


def test_the_typed_backup_arguments_carry_what_their_consumers_read(produced):
    posts = produced[0]
    full = parse_args(*posts["checkpoint"])
    assert isinstance(full, CheckpointArgs)
    assert full.parents == {}
    assert full.stop is None
    assert full.answer_url
    assert full.upload == UploadLimits(parallelism=2, throttle="static", max_held_log_bytes=1 << 30)
    assert full.archived_tails
    assert full.flush

    lone = parse_args(*posts["checkpoint of a lone incremental"])
    assert isinstance(lone, CheckpointArgs)
    assert lone.parents
    assert lone.pack
    assert lone.stop
    parent = lone.parents["s1"]
    assert isinstance(parent, ParentMap)
    assert (parent.backup_id, parent.node_id, parent.object.phase) == ("incr", "n1", "blockmap")
    assert parent.marker == {"snapshot_at": "1.000000", "schema_version": "1"}
    assert lone.encryption == parent.encryption == ENCRYPTION
    cut = lone.stop.cut.entered_at(ENTERED)
    assert (cut.name, cut.commit_lock, cut.database, cut.margin_seconds) == ("b2", 7, "app", 0.0)

    before = parse_args(*posts["checkpoint before a scan"])
    assert isinstance(before, CheckpointArgs)
    assert before.parents is None
    scan = parse_args(*posts["scan"])
    assert isinstance(scan, ScanArgs)
    assert set(scan.parents) == {"s1"}
    assert scan.pack

    stop = parse_args(*posts["stop"])
    assert isinstance(stop, StopArgs)
    assert stop.cut
    assert stop.pack
    assert (stop.cut.entered, stop.cut.name, stop.cut.commit_lock) == (ENTERED, "b1", 7)

    upload = parse_args(*posts["upload"])
    assert isinstance(upload, UploadArgs)
    assert upload.upload_id is None
    assert [p.part_number for p in upload.parts] == [1]


def test_the_typed_restore_arguments_carry_what_their_consumers_read(produced):
    posts = produced[0]
    chain = parse_args(*posts["prepare_restore of the incr"])
    assert isinstance(chain, PrepareRestoreArgs)
    assert isinstance(chain.prefetch, Prefetch)
    shard = chain.shards[0]
    assert [m.backup_id for m in shard.chain or []] == ["full", "incr"]
    assert [m.extents for m in shard.chain or []] == [None, ""]
    assert [d.object.from_chain for d in chain.prefetch.downloads] == [True]
    assert shard.encryption == ENCRYPTION
    assert shard.marker["schema_version"] == "1"
    full_restore = parse_args(*posts["prepare_restore of the full"])
    assert isinstance(full_restore, PrepareRestoreArgs)
    assert full_restore.prefetch is None
    pitr = parse_args(*posts["prepare_restore to a point in time"])
    assert isinstance(pitr, PrepareRestoreArgs)
    assert pitr.shards[0].recovery
    assert pitr.shards[0].recovery.target_time == "2026-11-23T14:02:59+00:00"
    assert [s.phase for s in pitr.shards[0].streams] == ["data", "tail", "wal"]

    download = parse_args(*posts["download of the incr's data (chain)"])
    assert isinstance(download, DownloadArgs)
    assert download.object.from_chain
    assert download.url
    finish = parse_args(*posts["finish_restore of the full"])
    assert isinstance(finish, FinishRestoreArgs)
    assert finish.heapallindexed
    assert finish.validation_queries == ["SELECT count(*) FROM t"]


@pytest.mark.parametrize("label", POSTED)
def test_a_field_nobody_reads_is_refused_by_name(produced, label):
    command, args = produced[0][label]
    with pytest.raises(InvalidRequest, match=rf"'{command}'.*\bshard_idz: Extra inputs"):
        parse_args(command, args | {"shard_idz": ["s1"]})


@pytest.mark.parametrize("label", POSTED)
def test_each_required_field_left_out_is_refused_by_name(produced, label):
    command, args = produced[0][label]
    model = ARGUMENTS[command]
    required = [name for name, field in model.model_fields.items() if field.is_required()]
    assert "backup_id" in required
    for name in required:
        with pytest.raises(InvalidRequest, match=rf"'{command}'.*\b{name}: Field required"):
            parse_args(command, {k: v for k, v in args.items() if k != name})


@pytest.mark.parametrize(
    ("label", "path", "named"),
    [
        ("checkpoint of a lone incremental", ("parents", "s1"), "parents.s1.url_key"),
        ("checkpoint of a lone incremental", ("pack",), "pack.url_key"),
        ("checkpoint of a lone incremental", ("stop", "cut"), "stop.cut.url_key"),
        ("stop", ("cut",), "cut.url_key"),
        ("upload", ("parts", 0), "parts.0.url_key"),
        ("prepare_restore of the incr", ("shards", 0), "shards.0.url_key"),
        ("prepare_restore of the incr", ("shards", 0, "chain", 1), "shards.0.chain.1.url_key"),
        ("prepare_restore of the incr", ("prefetch",), "prefetch.inline.url_key"),
        ("finish_restore to a point in time", ("wal",), "wal.inline.url_key"),
        ("prepare_restore to a point in time", ("shards", 0, "recovery"), "recovery.url_key"),
        ("prepare_restore of the full", ("shards", 0, "streams", 0), "streams.0.url_key"),
    ],
)
def test_a_nested_field_nobody_reads_is_refused_by_its_path(produced, label, path, named):
    command, args = produced[0][label]
    args = json.loads(json.dumps(args))
    place = args
    for step in path:
        place = place[step]
    place["url_key"] = "k"
    with pytest.raises(InvalidRequest, match=rf"'{command}'.*{named}: Extra inputs"):
        parse_args(command, args)


def test_an_unknown_command_is_refused_by_name():
    with pytest.raises(InvalidRequest, match="unknown agent command 'snapshot'") as refused:
        parse_args("snapshot", {"backup_id": "b1"})
    assert "checkpoint" in refused.value.fix


def test_arguments_still_by_url_are_refused_and_a_prefetch_by_url_is_not(produced):
    by_url = {"backup_id": "r1", "args_url": "https://w.invalid/a", "args_size": 200_000}
    with pytest.raises(InvalidRequest, match=r"'prepare_restore'.*by URL.*") as refused:
        parse_args("prepare_restore", by_url | {"replace": False})
    assert "inlined" in refused.value.fix
    command, args = produced[0]["prepare_restore of the incr"]
    prefetch = {"args_url": "https://w.invalid/p", "args_size": 200_000}
    parsed = parse_args(command, args | {"prefetch": prefetch})
    assert isinstance(parsed, PrepareRestoreArgs)
    assert parsed.prefetch == ArgsByUrl(**prefetch)
    with pytest.raises(InvalidRequest, match=r"prefetch.by_url.args_size: Field required"):
        parse_args(command, args | {"prefetch": {"args_url": "https://w.invalid/p"}})


def test_a_checkpoint_that_would_stop_without_its_scan_is_refused(produced):
    command, args = produced[0]["checkpoint of a lone incremental"]
    for left_out in ("parents", "pack"):
        with pytest.raises(InvalidRequest, match=r"'checkpoint'.*stop needs parents and pack"):
            parse_args(command, {k: v for k, v in args.items() if k != left_out})


@pytest.mark.parametrize("label", ["pack", "upload", "download of the full's tail"])
def test_an_object_of_another_operation_is_refused(produced, label):
    command, args = produced[0][label]
    with pytest.raises(InvalidRequest, match=rf"'{command}'.*object is of .* not b-other"):
        parse_args(command, args | {"backup_id": "b-other"})


def test_checksums_of_another_object_are_refused(produced):
    command, args = produced[0]["upload"]
    checksums = args["checksums"] | {"key": "backups/c/b1/s9/data-00000"}
    with pytest.raises(InvalidRequest, match=r"'upload'.*checksums are of .*s9"):
        parse_args(command, args | {"checksums": checksums})


def test_a_cut_the_agent_would_refuse_is_refused_naming_the_command(produced):
    command, args = produced[0]["checkpoint of a lone incremental"]
    stop = {"cut": args["stop"]["cut"] | {"name": "b2; DROP"}}
    with pytest.raises(InvalidRequest, match=r"'checkpoint'.*cannot name a restore point"):
        parse_args(command, args | {"stop": stop})
    command, args = produced[0]["stop"]
    cut = args["cut"] | {"database": "   "}
    with pytest.raises(InvalidRequest, match=r"'stop'.*cut.database .* is empty"):
        parse_args(command, args | {"cut": cut})


def test_a_probe_body_that_is_not_base64_is_refused(produced):
    command, args = produced[0]["probe"]
    with pytest.raises(InvalidRequest, match=r"'probe'.*body: Value error, body is not base64"):
        parse_args(command, args | {"body": "not base64!"})


def test_what_a_control_plane_before_protocol_4_sends_is_refused_by_name(produced):
    """Protocol 4 dropped the agent's branches for older control planes: what only they sent,
    or left out, is refused by field before any handler runs (the control plane is upgraded
    first, so an agent of this release never meets one)."""
    posts = produced[0]
    command, args = posts["checkpoint of a lone incremental"]
    inline = {k: v for k, v in args.items() if k != "answer_url"}
    with pytest.raises(InvalidRequest, match=r"'checkpoint'.*answer_url: Field required"):
        parse_args(command, inline)
    parent = {k: v for k, v in args["parents"]["s1"].items() if k != "node_id"}
    with pytest.raises(InvalidRequest, match=r"parents.s1.node_id: Field required"):
        parse_args(command, args | {"parents": {"s1": parent}})
    command, args = posts["prepare_restore of the incr"]
    shard = args["shards"][0] | {"chain_layered": False}
    with pytest.raises(InvalidRequest, match=r"shards.0.chain_layered: Extra inputs"):
        parse_args(command, args | {"shards": [shard]})


@pytest.mark.parametrize("label", ANSWERED)
def test_what_the_agent_answers_is_its_commands_result(produced, label):
    model, result = produced[1][label]
    # Every field the agent answered is one its model knows, with the value it sent.
    as_json = json.loads(json.dumps(result))
    assert model.model_validate(result).model_dump(mode="json", exclude_unset=True) == as_json


def test_the_answers_hold_what_the_plan_step_reads(produced):
    results = produced[1]
    data = Listing.model_validate(results["checkpoint answer"][1])
    assert [s.shard_id for s in data.shards] == ["s1"]
    assert data.shards[0].delta_bytes is None
    tail = Listing.model_validate(results["stop answer"][1])
    assert tail.shards[0].blockmap_bytes
    assert tail.shards[0].packed
