"""Read a backup back from the store into files, per its manifest, verifying while writing.

Each object's bytes are checksummed as they stream to disk and compared with the manifest's
CRC64NVME when the object ends, so no verification pass follows the last byte written. This
is what tests use to prove a backup byte for byte, and the base of restore.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from botocore.exceptions import ClientError
from pydantic import ValidationError

from shardvault.checksums import crc64nvme, to_b64
from shardvault.errors import ChecksumMismatch, InvalidRequest, ManifestDamaged
from shardvault.models import FileEntry, Manifest, ManifestStream
from shardvault.planning import backup_prefix

CHUNK = 1024 * 1024


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


class StreamWriter:
    """Writes a stream's bytes into its files, in listing order."""

    def __init__(self, root: Path, files: list[FileEntry]) -> None:
        self.root = root
        self.pending: Iterator[FileEntry] = iter(files)
        self.handle: BinaryIO | None = None
        self.left = 0

    def _open_next(self) -> bool:
        for entry in self.pending:
            path = self.root / entry.path
            if entry.path.endswith("/"):
                path.mkdir(parents=True, exist_ok=True)
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            self.handle, self.left = open(path, "wb"), entry.size  # noqa: SIM115
            if entry.size:
                return True
            self.handle.close()
        self.handle = None
        return False

    def write(self, data: memoryview) -> None:
        while len(data):
            if not self.left:
                if self.handle:
                    self.handle.close()
                if not self._open_next():
                    raise ChecksumMismatch("the stream holds more bytes than its files.")
            n = min(self.left, len(data))
            self.handle.write(data[:n])
            self.left, data = self.left - n, data[n:]

    def close(self) -> None:
        if self.handle:
            self.handle.close()
        if self.left:
            raise ChecksumMismatch(f"the stream ended {self.left} bytes short of its files.")
        while self._open_next():  # only empty files may follow the last byte
            self.handle.close()
            raise ChecksumMismatch("the stream ended before its last non-empty file.")


def read_stream(s3: Any, bucket: str, stream: ManifestStream, root: Path) -> int:
    writer = StreamWriter(root, stream.files)
    written = 0
    for obj in stream.objects:
        body = s3.get_object(Bucket=bucket, Key=obj.key)["Body"]
        crc, size = 0, 0
        for chunk in body.iter_chunks(CHUNK):
            crc, size = crc64nvme(chunk, crc), size + len(chunk)
            writer.write(memoryview(chunk))
        if to_b64(crc) != obj.crc64nvme or size != obj.length:
            raise ChecksumMismatch(
                f"object {obj.key}: read {size} bytes with CRC64NVME {to_b64(crc)}, the manifest "
                f"says {obj.length} bytes with {obj.crc64nvme}.",
                fix="the object is corrupt in the store: restore from another backup.",
            )
        written += size
    writer.close()
    return written


def materialize(manifest: Manifest, s3: Any, bucket: str, target: Path) -> dict[str, Path]:
    """Writes every shard's files under ``target/<shard_id>/``; returns the shard roots."""
    roots = {}
    for shard in manifest.shards:
        root = target / shard.shard_id
        root.mkdir(parents=True, exist_ok=True)
        for stream in shard.streams:
            read_stream(s3, bucket, stream, root)
        roots[shard.shard_id] = root
    return roots
