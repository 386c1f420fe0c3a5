"""Synthesized fulls: a full made inside the store from the cluster's chain and the node's
changes since its newest backup, so that a big database pays a full's read once.

Terms:
- *synthesized full*: admission (``backup.admission.synthesis_for``) gives the backup the
  chain of the cluster's newest backup (``BackupContext.chain``), so its nodes scan and send
  only the changes since that backup, exactly as for an incremental. *Synthesize* then copies
  every data object of that chain into the backup's prefix, and Finalize records the copies
  beneath the node's own objects, as the stream's *layers* (``ManifestStream.layers``;
  ``shardvault.data.chains``). The backup is a full: its own chain's root, restored,
  verified, promoted, locked and expired alone, while the chain it copied may expire.
- *copy*: one CopyObject inside the store (no byte through a node or a Lambda), with the
  store's own full-object CRC64NVME of the copy, checked with its size against the chain's
  manifest before the copy counts (``upload.verify_object``). A copy keeps its frames, so its
  manifest entry keeps the place they were sealed for and their data key: the chain's key,
  which the synthesized full continues (``admission.chain_key``), as an incremental does.
- *budget*: a call copies for at most ``promote_budget_seconds`` and records in the work
  bucket what it verified; the state machine calls again while copies remain, and a call
  that dies only loses what it had not recorded, which the next copies again (a copy to the
  same key is idempotent). The base, once complete, is one work object Finalize reads.

What it costs: one CopyObject (a PUT request) per object of the chain and one
GetObjectAttributes per copy; S3 charges no transfer inside a bucket. The chain's staging copy
stays in the store until the next full (``lifecycle.promote``: ``staging_kept``). A restore
reads every change since the last read full, which ``incremental.synthesized_fulls`` bounds.
"""

from __future__ import annotations

import time
from collections import defaultdict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

from shardvault.aws.readback import load_manifest
from shardvault.aws.services import Services
from shardvault.aws.store import is_missing
from shardvault.backup.upload import verify_object
from shardvault.contracts.catalog import BackupItem
from shardvault.contracts.layout import backup_prefix
from shardvault.contracts.models import (
    BackupContext,
    Layer,
    Manifest,
    ObjectResult,
    Phase,
    object_place,
)
from shardvault.data.chains import ShardLayer, chain_layers
from shardvault.errors import InvalidRequest, ParentUnavailable

PARALLEL_COPIES = 8  # each copy waits on the store, not on this function


@dataclass(frozen=True)
class PlannedCopy:
    """One object of the chain and the key of its copy in the synthesized full."""

    shard_id: str
    layer: int
    source: ObjectResult
    source_manifest: Manifest
    key: str

    def result(self, verified_by: str) -> ObjectResult:
        """The copy as the synthesized full's manifest records it (module docstring)."""
        src, manifest = self.source, self.source_manifest
        place = src.place or object_place(
            manifest.cluster, manifest.backup_id, self.shard_id, Phase.DATA, src.index
        )
        return src.model_copy(
            update={
                "key": self.key,
                "layer": self.layer,
                "verified_by": verified_by,
                "version_id": None,
                "place": place,
                "encryption": src.encryption or manifest.encryption,
                "part_count": 1,  # CopyObject stores one part; reads go by frames
                "part_crc64nvme": [],
            }
        )


def progress_key(svc: Services, backup_id: str) -> str:
    return svc.work_key(backup_id, "synthesis", "verified.json")


def base_key(svc: Services, backup_id: str) -> str:
    return svc.work_key(backup_id, "synthesis", "base.json")


def synthesize(context: BackupContext, svc: Services) -> dict[str, Any]:
    """Copies what the synthesized full still lacks of its chain, for at most the budget;
    returns ``remaining`` (copies still to make: call again) and ``copied``."""
    layers = chain_of_each_shard(context, chain_manifests(context, svc))
    prefix = backup_prefix(svc.store.prefix, context.cluster, context.backup_id)
    planned = planned_copies(prefix, layers)
    verified = previously_verified(svc, context.backup_id)
    pending = [c for c in planned if c.key not in verified]
    deadline = time.monotonic() + svc.settings.promote_budget_seconds
    try:
        copy_until(svc, pending, deadline, verified)
    finally:  # what was verified stays so, whatever failed beside it
        svc.put_work(progress_key(svc, context.backup_id), verified)
    remaining = sum(1 for c in planned if c.key not in verified)
    progress = {"synthesis_objects": len(planned), "synthesis_copied": len(planned) - remaining}
    svc.catalog.update(context.cluster, context.backup_id, BackupItem.changes(**progress))
    if not remaining:
        svc.put_work(base_key(svc, context.backup_id), base_of(layers, planned, verified))
    return {"remaining": remaining, "copied": len(planned) - remaining}


def chain_manifests(context: BackupContext, svc: Services) -> list[Manifest]:
    """The manifests of the chain the full is synthesized from, root first, as the store's
    staging copies hold them."""
    link = context.chain
    if link is None:
        raise InvalidRequest(f"backup {context.backup_id} is not synthesized from a chain.")
    manifests = []
    for backup_id in link.ancestors:  # the parent last
        record = svc.catalog.get(context.cluster, backup_id)
        try:
            if record is None or not record.manifest_key:
                raise InvalidRequest(f"backup {backup_id} has no manifest on record")
            manifests.append(load_manifest(svc.store_bucket, record.manifest_key))
        except InvalidRequest as error:
            raise ParentUnavailable(
                f"the full is synthesized from backup {backup_id}, whose staging copy in the "
                f"store cannot be read ({error.message}).",
                fix="start the backup again with --read-full: it reads the database.",
            ) from error
    return manifests


def chain_of_each_shard(
    context: BackupContext, chain: list[Manifest]
) -> dict[str, list[ShardLayer]]:
    """Each shard's layers in the chain (``shard_chain``), by shard id, in order."""
    shard_ids = sorted(s for source in context.sources for s in source.shard_ids)
    return {shard_id: shard_chain(chain, shard_id) for shard_id in shard_ids}


def planned_copies(prefix: str, layers: dict[str, list[ShardLayer]]) -> list[PlannedCopy]:
    """Every data object of the chain, per shard and layer, with the key of its copy under
    the backup's ``prefix``."""
    copies = []
    for shard_id, shard_layers in layers.items():
        for i, layer in enumerate(shard_layers):
            copies += [
                PlannedCopy(
                    shard_id, i, obj, layer.manifest, f"{prefix}{shard_id}/base-{i:03d}-{n:05d}"
                )
                for n, obj in enumerate(layer.objects)
            ]
    return copies


def shard_chain(chain: list[Manifest], shard_id: str) -> list[ShardLayer]:
    """A shard's layers in the chain; a shard the chain lacks is refused (its node would have
    sent the whole shard as changes to nothing)."""
    if any(shard_id not in {s.shard_id for s in m.shards} for m in chain):
        raise ParentUnavailable(
            f"shard {shard_id} is not in every backup of the chain a full would be "
            "synthesized from.",
            fix="start the backup again with --read-full.",
        )
    return chain_layers(chain, shard_id)


def previously_verified(svc: Services, backup_id: str) -> dict[str, str]:
    """The copies earlier calls verified (key: how); none before the first call."""
    return dict(svc.find_work(progress_key(svc, backup_id)) or {})


def copy_until(
    svc: Services, pending: list[PlannedCopy], deadline: float, verified: dict[str, str]
) -> None:
    """Copies and verifies ``pending`` side by side, starting none after ``deadline`` but the
    first (every call makes progress), adding each verified copy to ``verified`` (key: how)."""
    queue, started = list(reversed(pending)), 0
    with ThreadPoolExecutor(PARALLEL_COPIES) as pool:
        running: dict[Future[str], PlannedCopy] = {}
        while queue or running:
            while (
                queue
                and len(running) < PARALLEL_COPIES
                and (time.monotonic() < deadline or not started)
            ):
                copy = queue.pop()
                running[pool.submit(copied, svc, copy)] = copy
                started += 1
            if not running:
                break
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                verified[running.pop(future).key] = future.result()


def copied(svc: Services, copy: PlannedCopy) -> str:
    """One copy, checked by the store's checksum and size; how it was verified."""
    try:
        svc.store_bucket.copy_within(copy.source.key, copy.key)
    except ClientError as error:
        if not is_missing(error):
            raise
        raise ParentUnavailable(
            f"object {copy.source.key} of backup {copy.source_manifest.backup_id}, which the "
            "full is synthesized from, is gone from the store.",
            fix="start the backup again with --read-full: it reads the database.",
        ) from error
    return verify_object(svc, copy.key, copy.source.crc64nvme, copy.source.stored_bytes)


def base_of(
    layers: dict[str, list[ShardLayer]], planned: list[PlannedCopy], verified: dict[str, str]
) -> dict[str, Any]:
    """Per shard, its layers and their copies, as Finalize puts them in the manifest."""
    copies: dict[str, list[ObjectResult]] = defaultdict(list)
    for copy in planned:
        copies[copy.shard_id].append(copy.result(verified[copy.key]))

    def recorded(layer: ShardLayer) -> dict[str, Any]:
        kept = Layer(backup_id=layer.backup_id, files=layer.files, extents=layer.extents)
        return kept.model_dump(mode="json")

    return {
        shard_id: {
            "layers": [recorded(layer) for layer in shard_layers],
            "objects": [o.model_dump(mode="json") for o in copies[shard_id]],
        }
        for shard_id, shard_layers in layers.items()
    }


def read_base(svc: Services, backup_id: str) -> dict[str, tuple[list[Layer], list[ObjectResult]]]:
    """The complete base Synthesize recorded, per shard (Finalize)."""
    base = svc.get_work(base_key(svc, backup_id))
    return {
        shard_id: (
            [Layer.model_validate(v) for v in entry["layers"]],
            [ObjectResult.model_validate(v) for v in entry["objects"]],
        )
        for shard_id, entry in base.items()
    }
