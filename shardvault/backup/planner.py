"""Plan: what the agents' checkpoint (phase ``data``) or stop (phase ``tail``) answers become.

The answers are read from the work bucket when the agents handed them there
(``shardvault.backup.answers``).

Each answer is checked against the backup's sources, turned into shard listings, and cut into
an object plan (``shardvault.data.planning``); both are written to the work bucket, where the
Upload map reads the plan and Finalize the listings.

An item of a plan is ``{"object": ObjectPlan, "checksums": ObjectChecksums | None,
"signed": dict | None}``: the checksums of an object its node packed when it listed it, at its
scan (``shardvault.backup.scanning``: an incremental's changes) or at its stop (the tail, and a
full's block map, with the part size of the data plan's ``pack``), for exactly that plan, or
None (the Upload map packs it); and, for such an object that fits one part, its URL signed now
(``shardvault.backup.upload.sign_at_plan``: the Map item is then just the transfer), else None.
A data plan whose every object was packed is *packed*: the state machine goes straight to Stop,
and the tail's plan begins with the data plan's items, so that both upload in one Upload map,
after the stop. A lone node's incremental may have stopped already, in its Checkpoint command
(``stopped`` in its answer): its data plan is followed at once by its tail's, which the plan
step returns (phase ``tail``), and the state machine skips Stop.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from shardvault.aws.services import Services
from shardvault.backup.answers import read_answers
from shardvault.backup.upload import sign_at_plan
from shardvault.contracts.catalog import BackupItem
from shardvault.contracts.commands import Listing, PackedObject, parse_result
from shardvault.contracts.cut import summary
from shardvault.contracts.models import (
    BackupContext,
    BackupStatus,
    ObjectChecksums,
    ObjectPlan,
    Phase,
    ShardListing,
)
from shardvault.data.planning import (
    blockmap_listings,
    choose_part_size,
    interleave_by_node,
    listings_from_results,
    plan_objects,
    transfer_concurrency,
)
from shardvault.errors import AnswerMismatch, InvalidRequest, UnknownCommand
from shardvault.workflow import fanout

SIGN_THREADS = 8  # the work bucket's PUTs of signed URLs in flight (signing itself is local)


@dataclass(frozen=True)
class PhasePlan:
    """One phase's plan before it is written: its items (see the module docstring), its
    objects, and what it records in the backup's catalog record."""

    items: list[dict[str, Any]]
    objects: list[ObjectPlan]
    part_size: int
    packed: bool  # every object packed as it was listed (a data plan's ``DataPacked``)
    update: dict[str, Any]


def plan(
    context: BackupContext, results: list[dict[str, Any]], phase: Phase, svc: Services
) -> dict:
    """Writes the phase's listings and object plan to the work bucket; returns a summary.
    A node whose command failed fails it first, with that node's own error."""
    answers = phase_answers(context, results, phase, svc)
    record = svc.catalog.get(context.cluster, context.backup_id) or BackupItem(
        cluster=context.cluster, backup_id=context.backup_id, status=BackupStatus.RUNNING
    )
    planned = plan_phase(context, answers, phase, record, svc)
    if phase == Phase.DATA and any(answer.stopped for answer in answers):
        return plan_stopped_with_checkpoint(context, answers, planned, record, svc)
    items = planned.items
    if phase == Phase.TAIL and record.data_packed:  # the data goes with the tail
        items = svc.get_work(svc.work_key(context.backup_id, "plans", f"{Phase.DATA}.json")) + items
    return write_plan(context, phase, items, planned, planned.update, svc)


def phase_answers(
    context: BackupContext, results: list[dict[str, Any]], phase: Phase, svc: Services
) -> list[Listing]:
    """The nodes' answers of ``phase``, read back where they were handed over, each read as
    a listing (``parse_result``); a node whose command failed fails the plan first, with
    that node's own error."""
    fanout.raise_first_failure(results)
    return [
        parse_result(Listing, str(answer.get("node_id", "?")), answer)
        for answer in read_answers(svc, context.backup_id, phase, results)
    ]


def plan_phase(
    context: BackupContext,
    answers: list[Listing],
    phase: Phase,
    record: BackupItem,
    svc: Services,
) -> PhasePlan:
    """The phase's listings (written to the work bucket, for Finalize) and its object plan,
    its one-part packed objects signed; ``record`` is the backup's catalog record as the
    phase finds it."""
    if phase == Phase.DATA:
        check_scanned(answers)
    listings = listings_from_results(answers, phase)
    check_listings_match_sources(context, listings)
    # An incremental reads every block of the files its scan did not find unchanged, but the
    # blocks an engine's screen proved unchanged from their headers (whose bytes it reported).
    read = sum(
        listing.bytes - listing.unchanged_bytes - listing.screened_bytes for listing in listings
    )
    # Block maps go with the phase whose answer announces them: an incremental's scan wrote
    # its map (data), a full's map is joined from its packs' hashes at Stop (tail).
    maps = blockmap_listings(answers)
    streamed = sum(listing.sent_bytes for listing in listings)
    map_bytes = sum(listing.sent_bytes for listing in maps)
    listings += maps
    total = streamed + map_bytes
    vault_class = context.vault.storage_class if context.vault else None
    part_size = record.part_size or context.part_size or choose_part_size(total, vault_class)
    objects = interleave_by_node(
        plan_objects(
            backup_id=context.backup_id,
            cluster=context.cluster,
            prefix=svc.store.prefix,
            listings=listings,
            part_size=part_size,
            compression=context.compression,
        )
    )
    for listing in listings:
        key = svc.work_key(context.backup_id, "listings", listing.phase, f"{listing.shard_id}.json")
        svc.put_work(key, listing.model_dump(mode="json"))
    items = sign_items(plan_items(objects, packed_by_nodes(answers)), svc)
    packed = phase == Phase.DATA and all(item["checksums"] for item in items)
    update: dict[str, Any] = {
        "part_size": part_size,
        f"{phase}_bytes": streamed,  # the phase's own stream: what changed, for data
        f"{phase}_blockmap_bytes": map_bytes,
        f"{phase}_objects": len(objects),
        # What the agents read from the databases (the data and the tail; block maps are
        # written, not read), beside what they sent (``bytes``: an incremental's changes).
        f"{phase}_read_bytes": read,
        "read_bytes": read + ((record.data_read_bytes or 0) if phase == Phase.TAIL else 0),
    }
    if phase == Phase.DATA:
        skew = skew_seconds(listings)
        update |= {
            "data_packed": packed,
            "data_screened_bytes": sum(listing.screened_bytes for listing in listings),
            "checkpoint_skew_seconds": skew,
            "bytes_total": total,
            "objects_total": len(objects),
        }
    else:
        update |= cut_summary(listings, context.backup_id)
        update |= {
            "bytes_total": (record.data_bytes or 0) + (record.data_blockmap_bytes or 0) + total,
            "objects_total": (record.data_objects or 0) + len(objects),
        }
    return PhasePlan(items, objects, part_size, packed, update)


def write_plan(
    context: BackupContext,
    phase: Phase,
    items: list[dict[str, Any]],
    planned: PhasePlan,
    update: dict[str, Any],
    svc: Services,
) -> dict:
    """Writes ``items`` as the phase's plan (the Upload map's), records ``update`` and
    returns the summary the state machine reads (``planned`` is the phase's own plan)."""
    plan_key = svc.work_key(context.backup_id, "plans", f"{phase}.json")
    svc.put_work(plan_key, items)
    svc.catalog.update(context.cluster, context.backup_id, BackupItem.changes(**update))
    objects = [ObjectPlan.model_validate(item["object"]) for item in items]
    return {
        "phase": phase.value,
        "plan_key": plan_key,
        "objects": len(objects),
        "bytes": sum(o.length for o in objects),
        "part_size": planned.part_size,
        "upload_concurrency": transfer_concurrency(objects),
        "packed": planned.packed,  # upload after the stop, with the tail
        # How each node cuts and packs its tail's objects at its stop, as this plans them.
        "pack": pack_arguments(context, svc.store.prefix, planned.part_size),
    }


def plan_stopped_with_checkpoint(
    context: BackupContext,
    answers: list[Listing],
    data: PhasePlan,
    record: BackupItem,
    svc: Services,
) -> dict:
    """The tail's plan (with the data's items before it), for a node that ended its backup in
    its Checkpoint command (``stopped``: an incremental of that node alone, every change
    packed at its scan; ``shardvault.backup.scanning``): the Stop map is skipped. Data left to
    pack would be read after the stop, which a backup's data must never be: refused. Both
    phases are planned from one read of the record and written as one plan with one update:
    the data's plan has no reader of its own (no CheckUploads runs before the tail)."""
    stopped = [answer.stopped for answer in answers if answer.stopped]
    if not data.packed or len(stopped) != len(answers):
        nodes = [answer.node_id for answer in answers if answer.stopped]
        raise AnswerMismatch(
            f"node(s) {', '.join(nodes)} ended the backup in the Checkpoint command, but the "
            "plan holds objects they did not pack, or nodes that did not end it.",
            fix="check that each agent's version matches the control plane's (shardvault "
            "nodes), then retry the backup.",
        )
    tail = plan_phase(context, stopped, Phase.TAIL, record.model_copy(update=data.update), svc)
    items = data.items + tail.items
    return write_plan(context, Phase.TAIL, items, tail, data.update | tail.update, svc)


def pack_arguments(context: BackupContext, prefix: str, part_size: int) -> dict[str, Any]:
    """What a node needs to cut and pack its objects as the plan step will plan them
    (``planning.plan_objects``' arguments but the listings)."""
    return {
        "cluster": context.cluster,
        "prefix": prefix,
        "part_size": part_size,
        "compression": context.compression.model_dump(mode="json"),
    }


def packed_by_nodes(answers: list[Listing]) -> dict[str, PackedObject]:
    """Per object key, what a node packed as it listed it (its plan and checksums)."""
    return {
        packed.object.key: packed
        for answer in answers
        for shard in answer.shards
        for packed in shard.packed or []
    }


def plan_items(objects: list[ObjectPlan], packed: dict[str, PackedObject]) -> list[dict[str, Any]]:
    """The Upload map's items: each object with the checksums its node packed it with, when
    it packed this very plan (a node's answer is data from a database host: checked), or
    None."""
    items = []
    for obj in objects:
        found = packed.get(obj.key)
        sums = None
        if found and found.object == obj and found.checksums.key == obj.key:
            sums = found.checksums
        items.append(
            {
                "object": obj.model_dump(mode="json"),
                "checksums": sums.model_dump(mode="json") if sums else None,
            }
        )
    return items


def sign_items(items: list[dict[str, Any]], svc: Services) -> list[dict[str, Any]]:
    """Each plan item with its ``signed`` (``sign_at_plan``): an item packed as it was listed
    that fits one part gets its URL now (local signing, and one work object for its URL)."""

    def signed(item: dict[str, Any]) -> dict[str, Any]:
        sums = item["checksums"]
        at_plan = None
        if sums is not None:
            obj = ObjectPlan.model_validate(item["object"])
            at_plan = sign_at_plan(obj, ObjectChecksums.model_validate(sums), svc)
        return item | {"signed": at_plan}

    if not any(item["checksums"] for item in items):
        return [item | {"signed": None} for item in items]
    _ = svc.store_bucket, svc.work_bucket  # built once, before the threads share them
    with ThreadPoolExecutor(SIGN_THREADS) as pool:
        return list(pool.map(signed, items))


def check_listings_match_sources(context: BackupContext, listings: list[ShardListing]) -> None:
    """Each shard is listed once, by the node it was asked of: an agent's answer is data from
    a database host, and is checked before it shapes a plan."""
    expected = {(shard, s.node_id) for s in context.sources for shard in s.shard_ids}
    got = [(listing.shard_id, listing.node_id) for listing in listings]
    if sorted(got) != sorted(expected):
        raise InvalidRequest(
            f"agents answered for shards {sorted(got)}, expected {sorted(expected)}.",
            fix="check that each agent's configuration names the shards it registered with.",
        )


def check_scanned(answers: list[Listing]) -> None:
    """Every shard's data listing carries its scan's answer (``extents``, ``delta_bytes``:
    sent, even when None). A checkpoint without parents lists without scanning; planning
    such an answer would send an incremental's whole stream under extents that say nothing
    changed."""
    for answer in answers:
        for shard in answer.shards:
            if not {"extents", "delta_bytes"} <= shard.model_fields_set:
                raise UnknownCommand(
                    f"the agent of node {answer.node_id} checkpointed shard "
                    f"{shard.shard_id} without scanning it: it is older than the control "
                    "plane.",
                    fix="upgrade shardvault-agent on that node, then retry the backup.",
                )


def cut_summary(tails: list[ShardListing], backup_id: str) -> dict[str, Any]:
    """The cluster's cut as the shards' tails recorded it (``shardvault.contracts.cut.summary``);
    nothing when no shard cut (SQLite, an agent older than cuts)."""
    return summary([(listing.shard_id, listing.marker) for listing in tails], backup_id)


def skew_seconds(listings: list[ShardListing]) -> float:
    """Spread of the nodes' checkpoint times (``pg_backup_start``): when each node's copy
    began, not where its restored state ends (the cut does that)."""
    times = [listing.checkpoint_at for listing in listings if listing.checkpoint_at]
    return round(max(times) - min(times), 6) if times else 0.0
