"""Upload: the control plane's side of each planned object, and the check after the Map.

Per object: the agent packs it (``shardvault.data.pipeline``: its stream range read once into
compressed, optionally sealed frames, checksummed per part of the stored bytes) -> ``sign``
signs a URL per part, bound to that part's checksum, into the work bucket -> the agent uploads
its packed copy -> ``complete`` completes the upload and ``verify_object`` checks the stored
object against the agent's checksum. After the Upload map, ``check_uploads`` confirms every
planned object of the phase has a verified result.

Terms:
- a *single-PUT object* is one whose stored bytes fit one part (``single_put``): its URL is a
  presigned ``PutObject`` bound to the whole object's CRC64NVME, with no multipart upload to
  create, complete or abort (an incremental's changes, a tail, a block map: most objects of
  an incremental backup are this small). S3 stores all of it or nothing.
- *signed at plan*: a single-PUT object its node packed as it listed it comes with its
  checksums, so the plan step signs its URL at once (signing is local: no S3 call); its Map
  item is then just the agent's transfer (``TransferSigned``), and ``check_uploads`` verifies
  it and records its result with the others of its phase. Every other object is verified by
  ``complete``, as its Map item ends.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from botocore.exceptions import ClientError

from shardvault.aws.services import Services
from shardvault.aws.store import is_missing
from shardvault.contracts.models import (
    BackupContext,
    ObjectChecksums,
    ObjectPlan,
    ObjectResult,
    Phase,
    UploadedPart,
)
from shardvault.errors import ChecksumMismatch, UploadIncomplete
from shardvault.workflow.causes import agent_note, named_failure

VERIFY_THREADS = 16  # CheckUploads' requests in flight: each asks S3 for one object's checksum


def single_put(sums: ObjectChecksums) -> bool:
    """Whether the object's stored bytes fit one part: one presigned PutObject sends them."""
    return len(sums.parts) == 1


def sign(item: ObjectPlan, sums: ObjectChecksums, upload_id: str | None, svc: Services) -> dict:
    """Signs a URL per part still missing, each bound to that part's checksum, so the URL
    accepts those bytes and no others: a PutObject for a single-PUT object, else the parts of
    a multipart upload (created once). The URLs go to the work bucket (``urls_key``) for the
    dispatcher: execution history never holds one."""
    bucket = svc.store_bucket
    ttl = svc.settings.url_ttl_seconds
    if single_put(sums):
        url = bucket.presign_put(item.key, ttl, sums.crc64nvme)
        upload_id, parts = None, [{"part_number": 1, "url": url}]
    else:
        if upload_id:
            done = bucket.uploaded_parts(item.key, upload_id)
        else:
            upload_id, done = bucket.create_upload(item.key), {}
        parts = [
            {
                "part_number": p.part_number,
                "url": bucket.presign_part(item.key, upload_id, p.part_number, p.crc64nvme, ttl),
            }
            for p in sums.parts
            if p.part_number not in done
        ]
    return {
        "upload_id": upload_id,
        "urls_key": svc.put_urls(item.backup_id, item.key, {"parts": parts}),
        "checksums": sums.model_dump(mode="json"),
        "expires_at": time.time() + ttl,
    }


def sign_at_plan(item: ObjectPlan, sums: ObjectChecksums, svc: Services) -> dict[str, Any] | None:
    """A plan item's ``signed``: the URL of a single-PUT object packed as it was listed, for
    the Map's Transfer; None for any other object (the Map signs it)."""
    if not single_put(sums):
        return None
    signed = sign(item, sums, None, svc)
    return {"upload_id": None, "urls_key": signed["urls_key"], "checksums": signed["checksums"]}


def complete(
    item: ObjectPlan,
    sums: ObjectChecksums,
    upload_id: str | None,
    uploaded: list[UploadedPart],
    svc: Services,
) -> ObjectResult:
    """Completes a multipart upload (``upload_id``; None: a single PUT, stored whole) with the
    agent's full-object checksum, then verifies the stored object against it and records the
    result."""
    if upload_id is not None:
        complete_multipart(item, sums, upload_id, uploaded, svc)
    verified_by = verify_object(svc, item.key, sums.crc64nvme, sums.stored_length)
    result = write_result(item, sums, verified_by, svc)
    count_progress([(item, sums)], svc)
    return result


def complete_multipart(
    item: ObjectPlan,
    sums: ObjectChecksums,
    upload_id: str,
    uploaded: list[UploadedPart],
    svc: Services,
) -> None:
    bucket = svc.store_bucket
    known = {p.part_number: p for p in uploaded}
    missing = [p for p in sums.parts if p.part_number not in known]
    if missing:
        etags = bucket.uploaded_parts(item.key, upload_id)
        known |= {
            p.part_number: UploadedPart(
                part_number=p.part_number, etag=etags[p.part_number], crc64nvme=p.crc64nvme
            )
            for p in missing
            if p.part_number in etags
        }
    # A retry after S3 completed the upload finds no upload: verification decides.
    bucket.complete_upload(item.key, upload_id, list(known.values()), sums.crc64nvme)


def write_result(
    item: ObjectPlan, sums: ObjectChecksums, verified_by: str, svc: Services
) -> ObjectResult:
    """Writes a verified object's result, for Finalize's manifest."""
    result = ObjectResult(
        key=item.key,
        node_id=item.node_id,
        shard_id=item.shard_id,
        phase=item.phase,
        index=item.index,
        stream_offset=item.stream_offset,
        length=item.length,
        part_size=item.part_size,
        part_count=len(sums.parts),
        crc64nvme=sums.crc64nvme,
        verified_by=verified_by,
        part_crc64nvme=[p.crc64nvme for p in sorted(sums.parts, key=lambda p: p.part_number)],
        stored_length=sums.stored_length,
        frame_size=item.frame_size,
        frames=sums.frames,
        key_check=sums.key_check,
        pack_cpu_seconds=sums.pack_cpu_seconds,
        frame_levels=sums.frame_levels,
    )
    key = svc.work_key(
        item.backup_id, "results", item.phase, item.shard_id, f"{item.index:05d}.json"
    )
    svc.put_work(key, result.model_dump(mode="json"))
    return result


def count_progress(done: list[tuple[ObjectPlan, ObjectChecksums]], svc: Services) -> None:
    """Counts verified objects of one backup on its catalog item, in one update: their bytes,
    their number, the latest adaptive throttle their packs reported and the most log held."""
    if not done:
        return
    item = done[0][0]
    throttles = [sums.throttle for _, sums in done if sums.throttle is not None]
    held = [sums.held_log_bytes for _, sums in done if sums.held_log_bytes is not None]
    svc.catalog.add_progress(
        item.cluster,
        item.backup_id,
        bytes_done=sum(obj.length for obj, _ in done),
        objects_done=len(done),
        throttle=throttles[-1] if throttles else None,
        held_log_bytes=max(held) if held else None,
    )


def verify_object(svc: Services, key: str, expected: str, size: int) -> str:
    """Verifies a stored object by its checksum attribute (no download); reads it back when
    the store cannot report one or reports another (some S3 servers compute it wrongly)."""
    bucket = svc.store_bucket
    if svc.settings.verify_mode == "attributes":
        crc, stored_size = bucket.stored_checksum(key)
        if crc == expected and stored_size == size:
            return "attributes"
    crc, stored_size = bucket.readback_checksum(key)
    if crc != expected or stored_size != size:
        raise ChecksumMismatch(
            f"object {key} holds {stored_size} bytes with CRC64NVME {crc}; the agent read "
            f"{size} bytes with CRC64NVME {expected}.",
            fix="the backup is failed and its objects removed; retry it. If this repeats, check "
            "the store and the network path between the agent and the store.",
        )
    return "readback"


def check_uploads(context: BackupContext, phase: Phase, svc: Services) -> dict[str, Any]:
    """CheckUploads, after the data phase's Upload map: ``verified_results``. The tail's
    objects are checked by Finalize, which needs the results anyway (one Lambda fewer)."""
    _, planned = verified_results(context, phase, svc)
    return {"phase": phase.value, "objects": planned}


def verified_results(
    context: BackupContext, phase: Phase, svc: Services
) -> tuple[list[ObjectResult], int]:
    """Verifies and records the objects of the phase signed at plan, then checks that every
    planned object of the phase has a verified result; returns every result of the backup
    (either plan may also hold block maps: results/blockmap/) and the phase's planned count.
    The Distributed Map fails when an object's task fails; this also holds where a Map does
    not (moto's), and names what is missing."""
    items = svc.get_work(svc.work_key(context.backup_id, "plans", f"{phase}.json"))
    planned = [item["object"]["key"] for item in items]
    results = [
        ObjectResult.model_validate(value)
        for value in svc.get_works(svc.list_work(svc.work_key(context.backup_id, "results") + "/"))
    ]
    recorded = {result.key for result in results}
    results += verify_after_map(
        [item for item in items if item["object"]["key"] not in recorded and verified_here(item)],
        svc,
    )
    done = {result.key for result in results}
    missing = [key for key in planned if key not in done]
    if missing:
        nodes = [source.node_id for source in context.sources]
        if named := named_failure(svc, context.backup_id, nodes):
            raise named  # the operator's to act on by name (shardvault.workflow.causes.NAMED)
        note = agent_note(svc, context.backup_id, nodes, "")
        raise UploadIncomplete(
            f"{len(missing)} of {len(planned)} {phase} objects were not uploaded and verified "
            f"(first: {missing[0]})" + (f"; the agent reported: {note}" if note else "") + ".",
            fix="see the failed object's task in the execution (Upload map run) for its cause; "
            "the backup was cleaned up and can be retried.",
        )
    return results, len(planned)


def verified_here(item: dict[str, Any]) -> bool:
    """Whether a plan item was signed at plan: its Map item ends at the agent's transfer
    (unless its URL expired: then Sign, Transfer and Complete, which records it)."""
    return item.get("signed") is not None


def verify_after_map(items: list[dict[str, Any]], svc: Services) -> list[ObjectResult]:
    """Verifies each object signed at plan against its packed checksum, records its result
    and counts them all in one progress update; returns the results of those the store
    holds. One it does not hold (its transfer failed) is left out, for the caller to name."""

    def one(item: dict[str, Any]) -> tuple[ObjectPlan, ObjectChecksums, ObjectResult] | None:
        obj = ObjectPlan.model_validate(item["object"])
        sums = ObjectChecksums.model_validate(item["signed"]["checksums"])
        try:
            verified_by = verify_object(svc, obj.key, sums.crc64nvme, sums.stored_length)
        except ClientError as error:
            if is_missing(error):
                return None
            raise
        return obj, sums, write_result(obj, sums, verified_by, svc)

    if not items:
        return []
    _ = svc.store_bucket, svc.work_bucket  # built once, before the threads share them
    with ThreadPoolExecutor(min(VERIFY_THREADS, len(items))) as pool:
        verified = [done for done in pool.map(one, items) if done]
    count_progress([(obj, sums) for obj, sums, _ in verified], svc)
    return [result for _, _, result in verified]
