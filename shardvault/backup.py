"""The steps of the backup workflow, each called by one Lambda handler.

validate -> (agents flush, checkpoint) -> plan(data) -> per object: (agent checksums) -> sign ->
(agent uploads) -> complete+verify -> (agents stop) -> plan(tail) -> ... -> (agents release) ->
finalize. On failure: cleanup. Steps in parentheses run on the agents, dispatched through
their inboxes; everything here runs in the control plane and never touches backup data,
except to read an object back when the store cannot report its checksum.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections import defaultdict
from typing import Any

from pydantic import ValidationError

from shardvault.causes import agent_note, failure_cause
from shardvault.checksums import combine
from shardvault.errors import (
    AgentUnavailable,
    BackupAlreadyRunning,
    ChecksumMismatch,
    InvalidRequest,
    MixedEngines,
    NoShards,
    ShardDataMissing,
    ShardWithManyLeaders,
    ShardWithoutLeader,
    UnknownCluster,
    UploadIncomplete,
)
from shardvault.models import (
    BackupContext,
    BackupRequest,
    BackupStatus,
    Manifest,
    ManifestShard,
    ManifestStream,
    NodeRecord,
    ObjectChecksums,
    ObjectPlan,
    ObjectResult,
    PartChecksum,
    Phase,
    Role,
    ShardListing,
    Source,
    UploadedPart,
    UploadLimits,
    VaultRequest,
    VaultTarget,
    lock_strength,
    unpack_files,
)
from shardvault.planning import (
    MiB,
    backup_prefix,
    check_part_size,
    choose_part_size,
    plan_objects,
)
from shardvault.policy import ClusterPolicy
from shardvault.services import Services
from shardvault.store import (
    abort_uploads,
    complete_upload,
    create_upload,
    delete_prefix,
    presign_part,
    readback_checksum,
    stored_checksum,
    uploaded_parts,
)

RUNNING_EXECUTION = "RUNNING"


def new_backup_id(now: float) -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + "-" + secrets.token_hex(3)


# --- validate ----------------------------------------------------------------------------------
def validate(request: BackupRequest, svc: Services, now: float) -> BackupContext:
    """Checks the request against the registry and takes the cluster's lock, or raises a named
    error before any side effect."""
    if request.part_size is not None:
        check_part_size(request.part_size)
    nodes = svc.nodes.in_cluster(request.cluster)
    if not nodes:
        known = ", ".join(svc.nodes.clusters()) or "none"
        raise UnknownCluster(
            f"no agent has registered for cluster {request.cluster!r} (registered clusters: "
            f"{known}).",
            fix="check the cluster name, or start the agents with 'cluster: "
            f"{request.cluster}' in their configuration.",
        )
    check_nodes_available(nodes, now, svc.settings.heartbeat_max_age_seconds)
    engines = {n.engine for n in nodes}
    if len(engines) > 1:
        raise MixedEngines(
            f"nodes of cluster {request.cluster!r} report different engines: "
            + ", ".join(f"{n.node_id}={n.engine}" for n in nodes)
            + ".",
            fix="give each engine its own cluster name in the agents' configuration.",
        )
    sources = choose_sources(nodes)
    check_sources_readable(nodes, sources)
    if not sources:
        raise NoShards(
            f"the agents of cluster {request.cluster!r} ("
            + ", ".join(n.node_id for n in nodes)
            + ") hold no shards: a backup would hold nothing.",
            fix="list the node's databases under 'shards' in each agent's configuration (a "
            "restore target holds the shards it restored once the restore has finished).",
        )
    policy = cluster_policy(request.cluster, svc)  # read once: it is parsed at each read
    vault = vault_target(request, svc, policy)
    backup_id = take_lock(svc, request, new_backup_id(now))
    context = BackupContext(
        backup_id=backup_id,
        cluster=request.cluster,
        engine=engines.pop(),
        sources=sources,
        store_url=svc.settings.store_url,
        started_at=now,
        part_size=request.part_size or policy_part_size(policy),
        execution_id=request.execution_id,
        vault=vault,
        upload=upload_limits(policy),
    )
    svc.catalog.put(
        {
            "cluster": context.cluster,
            "backup_id": backup_id,
            "status": BackupStatus.RUNNING.value,
            "engine": context.engine.value,
            "started_at": now,
            "execution_id": request.execution_id,
            "requested_by": request.requested_by,
            "nodes": [s.node_id for s in sources],
            "shards": sorted(sh for s in sources for sh in s.shard_ids),
            "bytes_done": 0,
            "objects_done": 0,
            # What the reaper needs to clean up after an execution that never reached Cleanup.
            "context": context.model_dump_json(),
        }
    )
    return context


def cluster_policy(cluster: str, svc: Services) -> ClusterPolicy | None:
    """The cluster's entry in the deployment's policy file (None: no file, or no entry)."""
    policy = svc.policy()
    return policy.clusters.get(cluster) if policy else None


def policy_part_size(cluster: ClusterPolicy | None) -> int | None:
    """The cluster's ``upload.part_size_mib`` from the policy file, in bytes (checked there)."""
    mib = cluster.upload.part_size_mib if cluster else None
    return mib * MiB if mib else None


def upload_limits(cluster: ClusterPolicy | None) -> UploadLimits:
    """The cluster's ``upload`` rate limit and parallelism, for its agents."""
    if cluster is None:
        return UploadLimits()
    rate = cluster.upload.rate_limit_mib_per_second
    return UploadLimits(
        rate_limit_bytes_per_second=max(1, round(rate * MiB)) if rate else None,
        parallelism=cluster.upload.parallelism,
    )


def vault_target(
    request: BackupRequest, svc: Services, cluster: ClusterPolicy | None
) -> VaultTarget | None:
    """Where the backup is promoted once verified; None: it stays in the store.

    - The deployment has no vault bucket: None, and a request naming a vault is refused.
    - The policy names the cluster: its vault, which the request's ``vault`` may make stricter
      but never weaker: a lock mode at least as strict (COMPLIANCE over GOVERNANCE), at least
      as many days, and the same storage class. The class is not protection (every vault class
      keeps the same durability) but cost and restore time, which the cluster's budget and
      forecasts assume, so a request may only repeat it. A weaker field is refused by name,
      never silently raised to the policy's.
    - The policy does not name the cluster: a request may opt in with its own target (fields
      it leaves out take ``VaultTarget``'s defaults). It is still locked: ``VaultRequest``
      admits only GOVERNANCE or COMPLIANCE and at least one day.
    """
    if svc.vault is None:
        if request.vault is not None:
            raise InvalidRequest(
                "the request names a vault, but this deployment has none.",
                fix="remove 'vault' from the request, or deploy with a vault bucket.",
            )
        return None
    policy = policy_vault(cluster)
    if request.vault is None:
        return policy
    asked = request.vault.model_dump(exclude_none=True)
    if policy is None:
        return VaultTarget(**asked)
    check_not_weaker(request.vault, policy, request.cluster)
    return policy.model_copy(update=asked)


def policy_vault(cluster: ClusterPolicy | None) -> VaultTarget | None:
    """The cluster's vault in the policy file (None: the policy does not name the cluster)."""
    if cluster is None:
        return None
    return VaultTarget(
        storage_class=cluster.vault.storage_class,
        lock_mode=cluster.vault.object_lock.mode,
        lock_days=cluster.vault.object_lock.days,
    )


def check_not_weaker(asked: VaultRequest, policy: VaultTarget, cluster: str) -> None:
    """Refuses, by field, a request that would weaken the policy's vault for ``cluster``."""
    where = f"the policy's vault for cluster {cluster!r}"
    if asked.storage_class is not None and asked.storage_class != policy.storage_class:
        raise InvalidRequest(
            f"vault.storage_class {asked.storage_class} differs from {where}, which "
            f"requires {policy.storage_class}.",
            fix=f"write {policy.storage_class} or leave storage_class out (a request cannot "
            "change the vault's class), or change the cluster's class in the policy file.",
        )
    if asked.lock_mode is not None and lock_strength(asked.lock_mode) < lock_strength(
        policy.lock_mode
    ):
        raise InvalidRequest(
            f"vault.lock_mode {asked.lock_mode} is weaker than {where}, which requires "
            f"{policy.lock_mode}.",
            fix=f"ask for {policy.lock_mode} or leave lock_mode out.",
        )
    if asked.lock_days is not None and asked.lock_days < policy.lock_days:
        raise InvalidRequest(
            f"vault.lock_days {asked.lock_days} is shorter than {where}, which requires "
            f"at least {policy.lock_days} days.",
            fix=f"ask for {policy.lock_days} days or more, or leave lock_days out.",
        )


def check_nodes_available(nodes: list[NodeRecord], now: float, max_age: float) -> None:
    """Every registered node must be up: a silent node's leadership claims may be stale."""
    problems = []
    for node in nodes:
        age = now - node.heartbeat_at
        if node.status != "up":
            problems.append(f"{node.node_id} (agent {node.status} {age:.0f} s ago)")
        elif age > max_age:
            problems.append(f"{node.node_id} (silent for {age:.0f} s)")
    if problems:
        raise AgentUnavailable(
            "agents unavailable: " + ", ".join(problems) + ".",
            fix="start or restart the agent on each node listed (shardvault-agent run), or "
            "forget a decommissioned node with 'shardvault nodes --remove NODE_ID'.",
        )


def check_sources_readable(nodes: list[NodeRecord], sources: list[Source]) -> None:
    """Every shard a backup would read has its data where its agent's configuration says:
    a missing database must fail by name, never back up as an empty one."""
    chosen = {(s.node_id, shard) for s in sources for shard in s.shard_ids}
    problems = [
        f"{node.node_id}/{shard.shard_id}: {shard.problem}"
        for node in nodes
        for shard in node.shards
        if shard.problem and (node.node_id, shard.shard_id) in chosen
    ]
    if problems:
        raise ShardDataMissing(
            "the agents report shards whose data they cannot read: " + "; ".join(problems),
            fix="correct each shard's path or data_dir in its agent's configuration (or bring "
            "the data back), then start the backup again.",
        )


def choose_sources(nodes: list[NodeRecord]) -> list[Source]:
    """One source per shard: its leader. Raises if a shard has no leader or several."""
    leaders: dict[str, list[str]] = defaultdict(list)
    holders: dict[str, list[str]] = defaultdict(list)
    for node in nodes:
        for shard in node.shards:
            holders[shard.shard_id].append(node.node_id)
            if shard.role == Role.LEADER:
                leaders[shard.shard_id].append(node.node_id)
    for shard_id in sorted(holders):
        if not leaders[shard_id]:
            raise ShardWithoutLeader(
                f"shard {shard_id!r} has replicas on {', '.join(holders[shard_id])} but no leader.",
                fix="wait for the shard to elect a leader (or promote one), then retry.",
            )
        if len(leaders[shard_id]) > 1:
            raise ShardWithManyLeaders(
                f"shard {shard_id!r} is claimed as leader by {', '.join(leaders[shard_id])}.",
                fix="resolve the split brain (demote all but one leader), then retry.",
            )
    by_node: dict[str, list[str]] = defaultdict(list)
    for shard_id, (node_id,) in sorted(leaders.items()):
        by_node[node_id].append(shard_id)
    return [Source(node_id=n, shard_ids=s) for n, s in sorted(by_node.items())]


def take_lock(svc: Services, request: BackupRequest, backup_id: str) -> str:
    """Takes the cluster's lock for ``backup_id``; returns the backup id that holds it for
    this execution (an earlier attempt's, when Validate itself was retried)."""
    holder = svc.catalog.try_lock(request.cluster, backup_id, request.execution_id)
    if holder == {}:  # released between our attempt and our look: try once more
        holder = svc.catalog.try_lock(request.cluster, backup_id, request.execution_id)
    if holder is None:
        return backup_id
    if request.execution_id and holder.get("execution_id") == request.execution_id:
        return holder["holder"]  # our own lock, taken by an attempt whose answer was lost
    if holder and not execution_running(svc, holder.get("execution_id", "")):
        # The holder's execution ended without its failure path (stopped by hand, timed out,
        # and this backup came before the reaper): clean up what it left, which releases the
        # lock, then take it over.
        clean_up_abandoned(request.cluster, holder["holder"], TAKEN_OVER, svc, time.time())
        if svc.catalog.try_lock(request.cluster, backup_id, request.execution_id) is None:
            return backup_id
    raise BackupAlreadyRunning(
        f"backup {holder.get('holder')} of cluster {request.cluster!r} is still running "
        f"(execution {holder.get('execution_id') or 'unknown'}).",
        fix="wait for it to finish ('shardvault show' follows it), or stop that execution.",
    )


def execution_running(svc: Services, execution_id: str) -> bool:
    if not execution_id.startswith("arn:"):
        return True  # cannot tell: assume it runs
    try:
        status = svc.sfn.describe_execution(executionArn=execution_id)["status"]
    except svc.sfn.exceptions.ExecutionDoesNotExist:
        return False
    return status == RUNNING_EXECUTION


# --- plan --------------------------------------------------------------------------------------
def listings_from_results(results: list[dict[str, Any]], phase: Phase) -> list[ShardListing]:
    """Agents' checkpoint/stop results (one per node) to shard listings."""
    listings = []
    for result in results:
        for shard in result["shards"]:
            listings.append(
                ShardListing(
                    shard_id=shard["shard_id"],
                    node_id=result["node_id"],
                    phase=phase,
                    files=unpack_files(shard["files"]),
                    marker=shard.get("marker", {}),
                    checkpoint_at=shard.get("checkpoint_at", 0.0),
                    mutable=shard.get("mutable", False),
                )
            )
    return listings


def plan(
    context: BackupContext, results: list[dict[str, Any]], phase: Phase, svc: Services
) -> dict:
    """Writes the phase's listings and object plan to the work bucket; returns a summary."""
    listings = listings_from_results(results, phase)
    check_listings_match_sources(context, listings)
    total = sum(listing.bytes for listing in listings)
    record = svc.catalog.get(context.cluster, context.backup_id) or {}
    vault_class = context.vault.storage_class if context.vault else None
    part_size = record.get("part_size") or context.part_size or choose_part_size(total, vault_class)
    objects = plan_objects(
        backup_id=context.backup_id,
        cluster=context.cluster,
        prefix=svc.store.prefix,
        listings=listings,
        part_size=part_size,
    )
    for listing in listings:
        key = svc.work_key(context.backup_id, "listings", phase, f"{listing.shard_id}.json")
        svc.put_work(key, listing.model_dump(mode="json"))
    plan_key = svc.work_key(context.backup_id, "plans", f"{phase}.json")
    svc.put_work(plan_key, [{"object": o.model_dump(mode="json")} for o in objects])
    update: dict[str, Any] = {
        "part_size": part_size,
        f"{phase}_bytes": total,
        f"{phase}_objects": len(objects),
    }
    if phase == Phase.DATA:
        skew = skew_seconds(listings)
        update |= {
            "checkpoint_skew_seconds": skew,
            "bytes_total": total,
            "objects_total": len(objects),
        }
    else:
        update |= {
            "bytes_total": record.get("data_bytes", 0) + total,
            "objects_total": record.get("data_objects", 0) + len(objects),
        }
    svc.catalog.update(context.cluster, context.backup_id, **update)
    return {
        "phase": phase.value,
        "plan_key": plan_key,
        "objects": len(objects),
        "bytes": total,
        "part_size": part_size,
    }


def check_uploads(context: BackupContext, phase: Phase, svc: Services) -> dict[str, Any]:
    """Every planned object of the phase has a verified result. The Distributed Map fails when
    an object's task fails; this also holds where a Map does not (moto's), and names what is
    missing."""
    plan_key = svc.work_key(context.backup_id, "plans", f"{phase}.json")
    planned = [item["object"]["key"] for item in svc.get_work(plan_key)]
    results = svc.list_work(svc.work_key(context.backup_id, "results", phase) + "/")
    done = {ObjectResult.model_validate(svc.get_work(key)).key for key in results}
    missing = [key for key in planned if key not in done]
    if missing:
        nodes = [source.node_id for source in context.sources]
        note = agent_note(svc, context.backup_id, nodes, "")
        raise UploadIncomplete(
            f"{len(missing)} of {len(planned)} {phase} objects were not uploaded and verified "
            f"(first: {missing[0]})" + (f"; the agent reported: {note}" if note else "") + ".",
            fix="see the failed object's task in the execution (Upload map run) for its cause; "
            "the backup was cleaned up and can be retried.",
        )
    return {"phase": phase.value, "objects": len(planned)}


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


def skew_seconds(listings: list[ShardListing]) -> float:
    """Spread of the nodes' checkpoint times: how far apart the per-node cuts were taken."""
    times = [listing.checkpoint_at for listing in listings if listing.checkpoint_at]
    return round(max(times) - min(times), 6) if times else 0.0


# --- sign --------------------------------------------------------------------------------------
def sign(
    item: ObjectPlan,
    sums: ObjectChecksums,
    upload_id: str | None,
    svc: Services,
    changed: list[PartChecksum] | None = None,
) -> dict:
    """Creates the multipart upload (once) and signs a URL per part still missing, each bound
    to that part's checksum, so the URL accepts those bytes and no others. ``changed`` parts
    (a live file rewritten since it was checksummed) take their new checksums, and the
    object's checksum is recomputed from its parts'."""
    sums = merge_changed(sums, changed or [])
    s3, bucket = svc.store_s3, svc.store.bucket
    if upload_id:
        done = uploaded_parts(s3, bucket, item.key, upload_id)
    else:
        upload_id, done = create_upload(s3, bucket, item.key), {}
    ttl = svc.settings.url_ttl_seconds
    parts = [
        {
            "part_number": p.part_number,
            "url": presign_part(s3, bucket, item.key, upload_id, p.part_number, p.crc64nvme, ttl),
        }
        for p in sums.parts
        if p.part_number not in done
    ]
    return {
        "upload_id": upload_id,
        "parts": parts,
        "checksums": sums.model_dump(mode="json"),
        "expires_at": time.time() + ttl,
    }


def merge_changed(sums: ObjectChecksums, changed: list[PartChecksum]) -> ObjectChecksums:
    if not changed:
        return sums
    new = {p.part_number: p for p in changed}
    parts = [new.get(p.part_number, p) for p in sums.parts]
    whole = combine((p.crc64nvme, p.size) for p in parts)
    return ObjectChecksums(key=sums.key, parts=parts, crc64nvme=whole)


# --- complete ----------------------------------------------------------------------------------
def complete(
    item: ObjectPlan,
    sums: ObjectChecksums,
    upload_id: str,
    uploaded: list[UploadedPart],
    svc: Services,
) -> ObjectResult:
    """Completes the upload with the agent's full-object checksum, then verifies the stored
    object against it and records the result."""
    s3, bucket = svc.store_s3, svc.store.bucket
    known = {p.part_number: p for p in uploaded}
    missing = [p for p in sums.parts if p.part_number not in known]
    if missing:
        etags = uploaded_parts(s3, bucket, item.key, upload_id)
        known |= {
            p.part_number: UploadedPart(
                part_number=p.part_number, etag=etags[p.part_number], crc64nvme=p.crc64nvme
            )
            for p in missing
            if p.part_number in etags
        }
    # A retry after S3 completed the upload finds no upload: verification below decides.
    with contextlib.suppress(s3.exceptions.NoSuchUpload):
        complete_upload(s3, bucket, item.key, upload_id, list(known.values()), sums.crc64nvme)
    verified_by = verify_object(svc, item.key, sums.crc64nvme, item.length)
    result = ObjectResult(
        key=item.key,
        node_id=item.node_id,
        shard_id=item.shard_id,
        phase=item.phase,
        index=item.index,
        stream_offset=item.stream_offset,
        length=item.length,
        part_size=item.part_size,
        part_count=item.part_count,
        crc64nvme=sums.crc64nvme,
        verified_by=verified_by,
        part_crc64nvme=[p.crc64nvme for p in sorted(sums.parts, key=lambda p: p.part_number)],
    )
    key = svc.work_key(
        item.backup_id, "results", item.phase, item.shard_id, f"{item.index:05d}.json"
    )
    svc.put_work(key, result.model_dump(mode="json"))
    svc.catalog.add_progress(item.cluster, item.backup_id, bytes_done=item.length, objects_done=1)
    return result


def verify_object(svc: Services, key: str, expected: str, size: int) -> str:
    """Verifies a stored object by its checksum attribute (no download); reads it back when
    the store cannot report one or reports another (some S3 servers compute it wrongly)."""
    s3, bucket = svc.store_s3, svc.store.bucket
    if svc.settings.verify_mode == "attributes":
        crc, stored_size = stored_checksum(s3, bucket, key)
        if crc == expected and stored_size == size:
            return "attributes"
    crc, stored_size = readback_checksum(s3, bucket, key)
    if crc != expected or stored_size != size:
        raise ChecksumMismatch(
            f"object {key} holds {stored_size} bytes with CRC64NVME {crc}; the agent read "
            f"{size} bytes with CRC64NVME {expected}.",
            fix="the backup is failed and its objects removed; retry it. If this repeats, check "
            "the store and the network path between the agent and the store.",
        )
    return "readback"


# --- finalize ----------------------------------------------------------------------------------
def finalize(context: BackupContext, svc: Services, now: float) -> dict[str, Any]:
    """Builds the manifest from the listings and verified objects, stores it beside the
    objects, records the backup as complete and releases the cluster's lock."""
    manifest = build_manifest(context, svc, now)
    prefix = backup_prefix(svc.store.prefix, context.cluster, context.backup_id)
    manifest_key = f"{prefix}manifest.json"
    svc.store_s3.put_object(
        Bucket=svc.store.bucket,
        Key=manifest_key,
        Body=manifest.model_dump_json(indent=1).encode(),
        ContentType="application/json",
        ChecksumAlgorithm="CRC64NVME",
    )
    summary = manifest_summary(manifest, manifest_key) | cost_estimate(manifest, context.vault)
    svc.catalog.update(context.cluster, context.backup_id, **summary)
    svc.catalog.unlock(context.cluster, context.backup_id)
    svc.notify(f"ShardVault backup {context.backup_id} complete", summary)
    return summary


def build_manifest(context: BackupContext, svc: Services, now: float) -> Manifest:
    listings = [
        ShardListing.model_validate(svc.get_work(key))
        for key in svc.list_work(svc.work_key(context.backup_id, "listings") + "/")
    ]
    results = [
        ObjectResult.model_validate(svc.get_work(key))
        for key in svc.list_work(svc.work_key(context.backup_id, "results") + "/")
    ]
    by_stream: dict[tuple[str, Phase], list[ObjectResult]] = defaultdict(list)
    for result in results:
        by_stream[(result.shard_id, result.phase)].append(result)
    shards: dict[str, ManifestShard] = {}
    for listing in sorted(listings, key=lambda item: (item.shard_id, item.phase != Phase.DATA)):
        objects = sorted(by_stream[(listing.shard_id, listing.phase)], key=lambda r: r.index)
        check_stream_complete(listing, objects)
        stream = ManifestStream(phase=listing.phase, files=listing.files, objects=objects)
        if listing.shard_id in shards:
            shard = shards[listing.shard_id]
            marker = {**shard.marker, **listing.marker}
            shards[listing.shard_id] = shard.model_copy(
                update={"streams": [*shard.streams, stream], "marker": marker}
            )
        else:
            shards[listing.shard_id] = ManifestShard(
                shard_id=listing.shard_id,
                node_id=listing.node_id,
                marker=listing.marker,
                checkpoint_at=listing.checkpoint_at,
                streams=[stream],
            )
    data_listings = [listing for listing in listings if listing.phase == Phase.DATA]
    return Manifest(
        backup_id=context.backup_id,
        cluster=context.cluster,
        engine=context.engine,
        started_at=context.started_at,
        completed_at=now,
        checkpoint_skew_seconds=skew_seconds(data_listings),
        part_size=results[0].part_size if results else 0,
        shards=list(shards.values()),
        bytes=sum(r.length for r in results),
        objects=len(results),
        parts=sum(r.part_count for r in results),
        verification=verification_summary(results),
    )


def check_stream_complete(listing: ShardListing, objects: list[ObjectResult]) -> None:
    """A manifest must never point at a stream with a gap: every byte is in some object."""
    offset = 0
    for obj in objects:
        if obj.stream_offset != offset:
            raise UploadIncomplete(
                f"stream {listing.shard_id}/{listing.phase} has a gap at byte {offset}."
            )
        offset += obj.length
    if offset != listing.bytes:
        raise UploadIncomplete(
            f"stream {listing.shard_id}/{listing.phase} covers {offset} of {listing.bytes} bytes."
        )


def verification_summary(results: list[ObjectResult]) -> str:
    by = defaultdict(int)
    for result in results:
        by[result.verified_by] += 1
    detail = ", ".join(f"{n} by {how}" for how, n in sorted(by.items()))
    return f"all {len(results)} objects verified (CRC64NVME{': ' + detail if detail else ''})"


def cost_estimate(manifest: Manifest, vault: VaultTarget | None) -> dict[str, Any]:
    """What the backup costs to make and, a month, to keep (``shardvault.costs``)."""
    from shardvault.costs import price_backup
    from shardvault.prices import StorageClass

    # A class the price table lacks (a non-AWS store's own) is priced as STANDARD.
    known = {c.value for c in StorageClass}
    name = vault.storage_class if vault and vault.storage_class in known else "STANDARD"
    storage_class = StorageClass(name)
    cost = price_backup(manifest.bytes, storage_class, part_size=manifest.part_size)
    return {
        "estimated_storage_usd_per_month": round(cost.storage_usd_per_month, 6),
        "estimated_overhead_usd": round(cost.overhead_usd, 6),
    }


def manifest_summary(manifest: Manifest, manifest_key: str) -> dict[str, Any]:
    duration = manifest.completed_at - manifest.started_at
    return {
        "status": BackupStatus.COMPLETE.value,
        "completed_at": manifest.completed_at,
        "duration_seconds": round(duration, 3),
        "bytes": manifest.bytes,
        "objects": manifest.objects,
        "parts": manifest.parts,
        "nodes": sorted({s.node_id for s in manifest.shards}),
        "shards": [s.shard_id for s in manifest.shards],
        "checkpoint_skew_seconds": manifest.checkpoint_skew_seconds,
        "verification": manifest.verification,
        "manifest_key": manifest_key,
        "throughput_mib_s": round(manifest.bytes / max(duration, 1e-9) / 2**20, 2),
    }


# --- cleanup -----------------------------------------------------------------------------------
def explain(context: BackupContext, error: dict[str, Any], svc: Services, now: float) -> str:
    """The failure's cause (``shardvault.causes``), plus the nodes whose agents went silent: a
    timeout or a missing object is most often a dead agent, and the operator needs to know
    where to look."""
    nodes = [source.node_id for source in context.sources]
    cause = failure_cause(error, svc, context.backup_id, nodes)
    silent = []
    for source in context.sources:
        node = svc.nodes.get(source.node_id)
        if node is None or node.status != "up":
            silent.append(f"{source.node_id} (agent stopped)")
        elif now - node.heartbeat_at > svc.settings.heartbeat_max_age_seconds:
            silent.append(f"{source.node_id} (silent for {now - node.heartbeat_at:.0f} s)")
    if not silent:
        return cause
    return (
        f"{cause} The agent of {', '.join(silent)} stopped answering. Fix: restart the agent on "
        "that node (shardvault-agent run), then start the backup again."
    )


def cleanup(
    context: BackupContext, error: dict[str, Any], svc: Services, now: float
) -> dict[str, Any]:
    """The failure path: no open multipart upload, no partial object, every source node told
    to release, the backup marked failed with its cause, the lock released, and a
    notification sent."""
    prefix = backup_prefix(svc.store.prefix, context.cluster, context.backup_id)
    aborted = abort_uploads(svc.store_s3, svc.store.bucket, prefix)
    deleted = delete_prefix(svc.store_s3, svc.store.bucket, prefix)
    post_releases(context, svc)
    outcome = {
        "status": BackupStatus.FAILED.value,
        "failed_at": now,
        "error": error.get("Error", "States.Runtime"),
        "cause": explain(context, error, svc, now)[:2000],
        "aborted_uploads": aborted,
        "deleted_objects": deleted,
    }
    svc.catalog.update(context.cluster, context.backup_id, **outcome)
    svc.catalog.unlock(context.cluster, context.backup_id)
    svc.notify(
        f"ShardVault backup {context.backup_id} FAILED", {"backup_id": context.backup_id, **outcome}
    )
    return outcome


def post_releases(context: BackupContext, svc: Services) -> None:
    """A ``release`` in every source node's inbox *without* a task token: the agent runs it
    whenever it next reads its inbox and answers nobody. The workflow's own release skips a
    silent node (its dispatch is refused), whose snapshot would otherwise outlive the backup
    once it comes back; an agent that already released finds nothing to do."""
    for source in context.sources:
        svc.inbox.post(
            source.node_id,
            f"release:{context.backup_id}:cleanup",
            "release",
            {"shard_ids": source.shard_ids, "backup_id": context.backup_id, "failed": True},
            "",
        )


TAKEN_OVER = {
    "Error": "ExecutionEnded",
    "Cause": "its execution ended without finishing or cleaning up (stopped, timed out or "
    "lost); the next backup of the cluster cleaned up after it. Fix: nothing to do; see the "
    "execution's history for why it ended.",
}


def clean_up_abandoned(
    cluster: str, backup_id: str, error: dict[str, str], svc: Services, now: float
) -> dict:
    """Cleans up after a backup whose execution ended without running its failure path."""
    record = svc.catalog.get(cluster, backup_id)
    if record and record.get("status") == BackupStatus.RUNNING:
        context = recorded_context(record)
        if context is not None:
            return cleanup(context, error, svc, now)
        # An older version's record without a usable context: what needs none.
        prefix = backup_prefix(svc.store.prefix, cluster, backup_id)
        abort_uploads(svc.store_s3, svc.store.bucket, prefix)
        delete_prefix(svc.store_s3, svc.store.bucket, prefix)
        svc.catalog.update(
            cluster,
            backup_id,
            status=BackupStatus.FAILED.value,
            error=error["Error"],
            cause=error["Cause"],
        )
    svc.catalog.unlock(cluster, backup_id)
    return {"status": BackupStatus.FAILED.value}


def recorded_context(record: dict[str, Any]) -> BackupContext | None:
    """The context validation stored with a backup's record; None when there is none or it no
    longer parses (written by an older version): cleanup must not stop at it."""
    try:
        return BackupContext.model_validate_json(record.get("context") or "")
    except (ValidationError, InvalidRequest):  # the models' own checks raise InvalidRequest
        return None


# --- reaping -----------------------------------------------------------------------------------
REAPED_STATUSES = frozenset({"ABORTED", "TIMED_OUT"})


def reap(execution_arn: str, status: str, cluster: str, svc: Services, now: float) -> dict:
    """After an execution was aborted or timed out (it skipped the failure path): the same
    cleanup (which also posts the releases). A backup that already ended is left alone."""
    if status not in REAPED_STATUSES:
        return {"reaped": False, "why": f"status {status}"}
    record = next(
        (r for r in svc.catalog.backups(cluster) if r.get("execution_id") == execution_arn), None
    )
    if record is None or record.get("status") != BackupStatus.RUNNING:
        return {"reaped": False, "why": "no running backup of that execution"}
    error = reaped_error(status, "its backup was cleaned up by the reaper", "backup")
    return {"reaped": True, **clean_up_abandoned(cluster, record["backup_id"], error, svc, now)}


def reaped_error(status: str, what_was_done: str, workflow: str) -> dict[str, str]:
    """The error a reaped execution is recorded with, as its failure path would have it."""
    return {
        "Error": f"States.{status.title().replace('_', '')}",
        "Cause": f"the execution was {status.lower().replace('_', ' ')}; {what_was_done}. Fix: "
        f"start the {workflow} again (and raise the state machine's timeout if it timed out).",
    }
