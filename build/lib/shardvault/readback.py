"""Find and read a backup's manifest in the store (``shardvault.materialize`` reads its data)."""

from __future__ import annotations

from typing import Any

from botocore.exceptions import ClientError
from pydantic import ValidationError

from shardvault.errors import InvalidRequest, ManifestDamaged
from shardvault.models import Manifest
from shardvault.planning import backup_prefix


def manifest_key(prefix: str, cluster: str, backup_id: str) -> str:
    return f"{backup_prefix(prefix, cluster, backup_id)}manifest.json"


def load_manifest(s3: Any, bucket: str, key: str) -> Manifest:
    try:
        body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as error:
        # Without s3:ListBucket (the functions have none on AWS), S3 answers a missing key
        # with 403 AccessDenied instead of NoSuchKey: both mean "no manifest we can read".
        if error.response["Error"]["Code"] not in ("NoSuchKey", "AccessDenied", "403"):
            raise
        raise InvalidRequest(
            f"no manifest at s3://{bucket}/{key} (or no access to it).",
            fix="check the cluster and backup id ('shardvault list'); if it is listed, the "
            "catalog and the store disagree: the backup's objects were removed.",
        ) from None
    try:
        return Manifest.model_validate_json(body)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the document"
        raise ManifestDamaged(
            f"the manifest at s3://{bucket}/{key} is damaged: {where}: {first['msg']} "
            f"({error.error_count()} problem(s), {len(body)} bytes).",
            fix="restore another backup ('shardvault list'); this backup's objects may be "
            "intact, but without its manifest nothing says which bytes belong where.",
        ) from None
