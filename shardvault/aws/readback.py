"""Find and read a backup's manifest in the store (``shardvault.aws.materialize`` reads its
data)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from botocore.exceptions import ClientError
from pydantic import ValidationError

from shardvault.aws.store import Bucket
from shardvault.contracts.catalog import BackupItem
from shardvault.contracts.models import Manifest
from shardvault.errors import InvalidRequest, ManifestDamaged


class _ReadManifests:
    """Manifests read lately, by store, bucket and key, with their ETags: a restore reads a
    chain's manifests in Validate, Plan and Thaw, and a warm function asks the store again
    with ``If-None-Match`` rather than parse them again (the store still answers each read:
    a manifest replaced meanwhile is read anew)."""

    LIMIT = 64 << 20  # bytes of manifest JSON kept

    def __init__(self) -> None:
        self.found: OrderedDict[tuple[Any, ...], tuple[str, int, Manifest]] = OrderedDict()
        self.held = 0
        self.guard = threading.Lock()

    def get(self, place: tuple[Any, ...]) -> tuple[str, int, Manifest] | None:
        with self.guard:
            return self.found.get(place)

    def put(self, place: tuple[Any, ...], etag: str, size: int, manifest: Manifest) -> None:
        with self.guard:
            if place in self.found:
                self.held -= self.found.pop(place)[1]
            self.found[place] = (etag, size, manifest)
            self.held += size
            while self.held > self.LIMIT and len(self.found) > 1:
                self.held -= self.found.popitem(last=False)[1][1]


READ_MANIFESTS = _ReadManifests()


def parse_manifest(body: bytes, place: str) -> Manifest:
    """A manifest's bytes read from ``place`` (a URL, for the message), or ManifestDamaged."""
    try:
        return Manifest.model_validate_json(body)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the document"
        raise ManifestDamaged(
            f"the manifest at {place} is damaged: {where}: {first['msg']} "
            f"({error.error_count()} problem(s), {len(body)} bytes).",
            fix="restore another backup ('shardvault list'); this backup's objects may be "
            "intact, but without its manifest nothing says which bytes belong where.",
        ) from None


def manifest_place(record: BackupItem, location: str) -> tuple[str, str | None]:
    """A backup's manifest key where it is read (``location``: "vault" or "store") and, in
    the vault, the version promotion locked (None in the store, and for a backup promoted
    before versions were recorded: the newest is read); "" when the record names none."""
    if location == "vault":
        return record.vault_manifest_key or "", record.vault_manifest_version
    return record.manifest_key or "", None


def load_manifest(bucket: Bucket, key: str, version_id: str | None = None) -> Manifest:
    """The manifest at ``key`` (its ``version_id``, when named: a vault manifest's locked
    version, which a delete marker or a newer version cannot hide)."""
    place = (bucket.endpoint, bucket.name, key, version_id)
    known = READ_MANIFESTS.get(place)
    try:
        if known is not None:
            response = bucket.get(key, version_id, IfNoneMatch=known[0])
        else:
            response = bucket.get(key, version_id)
        body = response["Body"].read()
    except ClientError as error:
        if known is not None and error.response["Error"]["Code"] in ("304", "NotModified"):
            return known[2]  # the store says it is the manifest read before
        # Without s3:ListBucket (the functions have none on AWS), S3 answers a missing key
        # with 403 AccessDenied instead of NoSuchKey: both mean "no manifest we can read".
        if error.response["Error"]["Code"] not in ("NoSuchKey", "AccessDenied", "403"):
            raise
        raise InvalidRequest(
            f"no manifest at s3://{bucket.name}/{key} (or no access to it).",
            fix="check the cluster and backup id ('shardvault list'); if it is listed, the "
            "catalog and the store disagree: the backup's objects were removed.",
        ) from None
    manifest = parse_manifest(body, f"s3://{bucket.name}/{key}")
    if etag := response.get("ETag"):
        READ_MANIFESTS.put(place, etag, len(body), manifest)
    return manifest
