"""The log archive's contract between an agent and the archive function: what an agent
describes of a batch it packed (``Batch``, its ``WalFile``s), what it asks the function
(``ArchiveCall``), and the limits both sides hold. The control plane's side is
``shardvault.wal.archive``; the keys are in ``shardvault.contracts.layout``.

*Log kinds* (``Batch.kind``): ``wal``, PostgreSQL's WAL (``WAL_FILE``: segments, timeline
history, backup history and partial files; ``pgwal``), and ``binlog``, MariaDB's binary logs
(``BINLOG_FILE``: ``<basename>.<ordinal>``, e.g. ``mysql-bin.000012``, one series per server).
The two name patterns are disjoint, so a name says its kind. Names never hold ``--``: batch
keys are split on it. A binlog file is never cut (a transaction stays in one file, which may
so exceed ``max_binlog_size``): a batch of one file may exceed ``BATCH_MAX_BYTES`` up to
``ONE_FILE_MAX_BYTES``.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from shardvault.contracts.lognames import (  # noqa: F401 (the archive's names, here too)
    BINLOG_FILE,
    LOG_KINDS,
    WAL_FILE,
    binlog_run,
    log_order,
)
from shardvault.contracts.models import Encryption, Frozen, check_name

REQUEST_PREFIX = "#archive:"  # inbox items the command poller skips ("#...")
BATCH_MAX_BYTES = 256 * 1024 * 1024  # plaintext of one batch: 16 segments of 16 MiB, one PUT
MAX_FILES = 4096  # a batch of small history files stays a small request
WAL_DIR = ".shardvault-wal"  # in a restored shard: the archive's WAL its recovery reads
BATCH_ID = re.compile(r"^[0-9a-f]{32}$")
ONE_FILE_MAX_BYTES = 4 * 1024**3  # one PUT holds up to 5 GiB, the sealed frames' overhead too


class WalFile(Frozen):
    name: str
    size: int = Field(ge=0)
    # When PostgreSQL handed it to the spool (the spool file's mtime, epoch seconds): the
    # archive holds no WAL written after its newest file's push (a restore's upper bound).
    pushed_at: float = 0.0

    @field_validator("name")
    @classmethod
    def _log_name(cls, value: str) -> str:
        if not any(pattern.fullmatch(value) for pattern in LOG_KINDS.values()):
            raise ValueError(f"{value!r} is not a WAL or binary log file's name")
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
    kind: Literal["wal", "binlog"] = "wal"  # the log kind of its files (the module docstring)
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

    @model_validator(mode="after")
    def _of_its_kind(self) -> Batch:
        pattern = LOG_KINDS[self.kind]
        if wrong := [f.name for f in self.files if not pattern.fullmatch(f.name)]:
            raise ValueError(f"{wrong[0]!r} is not a {self.kind} file's name")
        return self

    @property
    def plain_length(self) -> int:
        return sum(f.size for f in self.files)


class ArchiveCall(Frozen):
    """The archive function's input: what to do, for which node, about which batch."""

    action: Literal["settings", "sign", "record"]
    node_id: str
    batch_id: str | None = None
    new_key: bool = False  # settings: the agent's data key ran out (or it has none)
