"""Checksums: CRC64NVME, the algorithm S3 uses for full-object checksums of multipart uploads.

Values travel as S3 does: the 8-byte big-endian CRC, base64-encoded. A *running* CRC is the
integer state passed from one chunk to the next, so a checksum is computed while streaming
and never needs the whole object in memory.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from typing import BinaryIO

from awscrt import checksums

READ_CHUNK = 1024 * 1024


def crc64nvme(data: bytes, previous: int = 0) -> int:
    """Extends a running CRC64NVME with ``data``."""
    return checksums.crc64nvme(data, previous)


def to_b64(crc: int) -> str:
    """The S3 wire form of a CRC64NVME value."""
    return base64.b64encode(crc.to_bytes(8, "big")).decode("ascii")


def from_b64(value: str) -> int:
    return int.from_bytes(base64.b64decode(value), "big")


def crc64nvme_of_chunks(chunks: Iterable[bytes]) -> str:
    crc = 0
    for chunk in chunks:
        crc = crc64nvme(chunk, crc)
    return to_b64(crc)


def crc64nvme_of_stream(stream: BinaryIO) -> str:
    return crc64nvme_of_chunks(iter(lambda: stream.read(READ_CHUNK), b""))


def crc64nvme_of_bytes(data: bytes) -> str:
    return to_b64(crc64nvme(data))


def combine(parts: Iterable[tuple[str, int]]) -> str:
    """The CRC64NVME of concatenated blocks from their own CRCs and lengths, in order."""
    whole = 0
    for crc, length in parts:
        whole = checksums.combine_crc64nvme(whole, from_b64(crc), length)
    return to_b64(whole)
