"""The WAL archive's contract between an agent and the archive function: what an agent
describes of a batch it packed (``Batch``, its ``WalFile``s), what it asks the function
(``ArchiveCall``), and the limits both sides hold. The control plane's side is
``shardvault.wal.archive``; the keys are in ``shardvault.contracts.layout``.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from shardvault.contracts.models import Encryption, Frozen, check_name

REQUEST_PREFIX = "#archive:"  # inbox items the command poller skips ("#...")
BATCH_MAX_BYTES = 256 * 1024 * 1024  # plaintext of one batch: 16 segments of 16 MiB, one PUT
MAX_FILES = 4096  # a batch of small history files stays a small request
WAL_DIR = ".shardvault-wal"  # in a restored shard: the archive's WAL its recovery reads
# Segments (24 hex digits), timeline history files, backup history files, partial segments:
# the names shardvault_agent.wal.walspool accepts (it imports nothing of ShardVault's: a unit test
# holds the two patterns equal).
WAL_FILE = re.compile(r"^[0-9A-F]{24}(\.partial|\.[0-9A-F]{8}\.backup)?$|^[0-9A-F]{8}\.history$")
BATCH_ID = re.compile(r"^[0-9a-f]{32}$")


class WalFile(Frozen):
    name: str
    size: int = Field(ge=0)
    # When PostgreSQL handed it to the spool (the spool file's mtime, epoch seconds): the
    # archive holds no WAL written after its newest file's push (a restore's upper bound).
    pushed_at: float = 0.0

    @field_validator("name")
    @classmethod
    def _wal_name(cls, value: str) -> str:
        if not WAL_FILE.fullmatch(value):
            raise ValueError(f"{value!r} is not a WAL file's name")
        return value


class Batch(Frozen):
    """An agent's description of one packed batch (the request item's ``batch``)."""

    batch_id: str
    shard_id: str
    files: list[WalFile] = Field(min_length=1, max_length=MAX_FILES)
    frame_size: int = Field(gt=0)
    frames: str  # the frame table (shardvault.data.frames.pack_frames)
    stored_length: int = Field(ge=0)
    crc64nvme: str  # of the stored bytes, base64
    encryption: Encryption | None = None
    # The shard's linked directories as the batch was packed (``shardvault.contracts.links``:
    # path -> where the link leads); None from an agent that does not say. A tablespace
    # created after a restore's base shows here first (``shardvault.wal.pitr``).
    links: dict[str, str] | None = None

    @field_validator("batch_id")
    @classmethod
    def _batch_id(cls, value: str) -> str:
        if not BATCH_ID.fullmatch(value):
            raise ValueError("a batch id is 32 lowercase hex digits")
        return value

    @field_validator("shard_id")
    @classmethod
    def _shard_id(cls, value: str) -> str:
        return check_name("shard_id", value)

    @property
    def plain_length(self) -> int:
        return sum(f.size for f in self.files)


class ArchiveCall(Frozen):
    """The archive function's input: what to do, for which node, about which batch."""

    action: Literal["settings", "sign", "record"]
    node_id: str
    batch_id: str | None = None
    new_key: bool = False  # settings: the agent's data key ran out (or it has none)
