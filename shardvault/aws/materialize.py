"""Read a backup back from the store into files, per its manifest, verifying while writing.

Objects are read whole and in order through the part pipeline (``shardvault.data.pipeline``):
each frame's plaintext is checked against the manifest's CRC64NVME as it is decoded, and each
object's stored bytes against the object's, so no verification pass follows the last byte
written. Tests use it to prove a backup byte for byte, without agents.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from shardvault.aws.store import Bucket
from shardvault.contracts.layout import batch_place
from shardvault.contracts.models import (
    FileEntry,
    Manifest,
    ManifestStream,
    ObjectResult,
    object_place,
)
from shardvault.data.checksums import crc64nvme, to_b64
from shardvault.data.pipeline import FrameCodec, FrameSink, frame_spans, unpack_frames
from shardvault.errors import ChecksumMismatch

CHUNK = 1024 * 1024


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


def read_stream(bucket: Bucket, manifest: Manifest, stream: ManifestStream, root: Path) -> int:
    writer = StreamWriter(root, stream.files)
    written = 0
    for obj in stream.objects:
        written += read_object(bucket, manifest, obj, writer)
    writer.close()
    return written


def read_object(bucket: Bucket, manifest: Manifest, obj: ObjectResult, writer: StreamWriter) -> int:
    """Streams one object into the writer; returns its stored bytes."""
    if obj.frames:
        spans = frame_spans(unpack_frames(obj.frames), obj.frame_size, obj.length)
        # An archived tail's batch copy keeps its batch's place (shardvault.backup.archived).
        place = obj.place or object_place(
            manifest.cluster, manifest.backup_id, obj.shard_id, obj.phase, obj.index
        )
        sink = FrameSink(
            spans, FrameCodec(), place, lambda _, plain: writer.write(memoryview(plain))
        )
        receive = sink.receive
    else:  # format 1: the stream's bytes as they are

        def receive(_: int, chunk: bytes) -> None:
            writer.write(memoryview(chunk))

    crc, size = stream_object(bucket, obj.key, receive)
    if crc != obj.crc64nvme or size != obj.stored_bytes:
        raise ChecksumMismatch(
            f"object {obj.key}: read {size} bytes with CRC64NVME {crc}, the manifest "
            f"says {obj.stored_bytes} bytes with {obj.crc64nvme}.",
            fix="the object is corrupt in the store: restore from another backup.",
        )
    return size


def stream_object(
    bucket: Bucket, key: str, receive: Callable[[int, bytes], None]
) -> tuple[str, int]:
    """Hands an object's stored bytes to ``receive(position, chunk)`` as they arrive; returns
    their CRC64NVME and size."""
    body = bucket.get(key)["Body"]
    crc, size = 0, 0
    for chunk in body.iter_chunks(CHUNK):
        receive(size, chunk)
        crc, size = crc64nvme(chunk, crc), size + len(chunk)
    return to_b64(crc), size


def materialize(manifest: Manifest, bucket: Bucket, target: Path) -> dict[str, Path]:
    """Writes every shard's files under ``target/<shard_id>/``; returns the shard roots."""
    roots = {}
    for shard in manifest.shards:
        root = target / shard.shard_id
        root.mkdir(parents=True, exist_ok=True)
        for stream in shard.streams:
            read_stream(bucket, manifest, stream, root)
        roots[shard.shard_id] = root
    return roots


def read_batch(bucket: Bucket, index: dict[str, Any], sealer: Any = None) -> dict[str, bytes]:
    """A WAL batch of the archive (``shardvault.wal.archive``), read back per its index: each WAL
    file's bytes by name, every frame checked against its CRC64NVME and the object against its
    stored checksum. ``sealer``: the batch's data key (``pipeline.Sealer``), if sealed."""
    length = sum(f["size"] for f in index["files"])
    spans = frame_spans(unpack_frames(index["frames"]), index["frame_size"], length)
    plain = bytearray(length)

    def put(offset: int, data: bytes) -> None:
        plain[offset : offset + len(data)] = data

    place = batch_place(index["cluster"], index["shard_id"], index["batch_id"])
    sink = FrameSink(spans, FrameCodec(sealer=sealer), place, put, where=index["key"])
    crc, size = stream_object(bucket, index["key"], sink.receive)
    if crc != index["crc64nvme"] or size != index["stored_length"] or not sink.complete:
        raise ChecksumMismatch(
            f"WAL batch {index['key']}: read {size} bytes with CRC64NVME {crc}, its "
            f"index says {index['stored_length']} bytes with {index['crc64nvme']}.",
            fix="the batch is damaged in the store.",
        )
    files, at = {}, 0
    for entry in index["files"]:
        files[entry["name"]] = bytes(plain[at : at + entry["size"]])
        at += entry["size"]
    return files
