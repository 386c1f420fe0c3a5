"""A checked stream: an object's bytes on their way from the store to another provider, proven
to be the manifest's before the last of them leaves.

The read that completes ``size`` bytes compares their CRC64NVME with the manifest's before it
returns them. An upload sends its last bytes only after that read, so the provider never
commits (and never locks) bytes that are not the backup's: a mismatch raises
``ChecksumMismatch`` inside the upload, which then aborts. *Observers* (anything with an
``update(bytes)``) see the same bytes: GCS's copy hashes them in GCS's own checksums too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, BinaryIO

from shardvault.data.checksums import crc64nvme, to_b64
from shardvault.errors import ChecksumMismatch


class CheckedStream:
    def __init__(
        self,
        source: BinaryIO,
        key: str,
        size: int,
        expected_crc64nvme: str,
        *,
        into: str,
        observers: Sequence[Any] = (),
    ) -> None:
        self.source, self.key, self.size, self.expected = source, key, size, expected_crc64nvme
        self.into, self.observers = into, observers
        self.crc64 = 0
        self.passed = 0

    def read(self, size: int | None = -1) -> bytes:
        want = self.size - self.passed if size is None or size < 0 else size
        chunk: bytes = self.source.read(min(want, self.size - self.passed))
        self.crc64 = crc64nvme(chunk, self.crc64)
        for observer in self.observers:
            observer.update(chunk)
        self.passed += len(chunk)
        if (not chunk and want) or self.passed >= self.size:
            self._check_whole()
        return chunk

    def _check_whole(self) -> None:
        got = to_b64(self.crc64)
        if self.passed != self.size or got != self.expected:
            raise ChecksumMismatch(
                f"{self.key} read from the store with CRC64NVME {got} ({self.passed} bytes); "
                f"the manifest says {self.expected} ({self.size} bytes). Nothing was committed "
                f"to {self.into}.",
                fix="the staging copy is damaged: verify the backup (shardvault verify "
                "--read-data) and take a new one.",
            )

    def tell(self) -> int:
        return self.passed

    @property
    def crc64nvme(self) -> str:
        """The CRC64NVME of the bytes passed so far, base64 as S3 reports it."""
        return to_b64(self.crc64)
