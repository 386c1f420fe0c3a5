"""Continuous WAL archiving: the agent stores what PostgreSQL left in its shards' spools.

Terms (see ``shardvault.wal.archive`` for the batch, the request and the store's layout):
- *spool*: a leader shard's ``wal_spool_dir``, where ``shardvault-wal-push`` (the server's
  ``archive_command``) leaves each WAL file durably.
- *pending batch*: a batch packed into ``state_dir/archive/<batch id>/`` (``batch.json`` and the
  packed ``object``) and not yet recorded. It survives a restart: the agent finishes it first,
  and its files are in no other batch meanwhile.

A batch goes once its files reach the batch bound, or once its oldest file has waited the
policy's ``archive.max_delay_seconds``, or at once when a backup waits for its files
(``wait_archived``: a tail that refers to the archive instead of copying its WAL). For each
batch: write the request into the node's inbox partition, ask the archive function to sign
it, PUT the packed object through the URL (the transfers' one retry policy), ask the
function to record it, and only then delete its files from the spool. A crash anywhere
before the record leaves the files in the spool and the pending batch in the state
directory, so nothing is lost: the batch is sent again (the same key, the same bytes,
recorded again); the pending batch goes only after its files and its request. A file
PostgreSQL pushes again after a crash of its own goes in a new batch: the archive may hold a
WAL file twice, never miss one.

Settings (the compression, the delay, whether to seal) come from the function, asked for again
every ``SETTINGS_SECONDS``; a new data key only when the one in use has run the policy's
``archive.key_seconds``.
"""

from __future__ import annotations

import json
import logging
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from shardvault.contracts.layout import batch_place
from shardvault.contracts.models import Compression, Encryption
from shardvault.contracts.wal_archive import (
    BATCH_MAX_BYTES,
    REQUEST_PREFIX,
    WAL_FILE,
    Batch,
    WalFile,
)
from shardvault.data.pipeline import FrameCodec, pack, pack_frames
from shardvault.data.planning import frame_size_for
from shardvault.errors import ArchiveRefused, ShardVaultError, WalNotArchived
from shardvault_agent.keys import DataKeys
from shardvault_agent.transfer import PartSender

log = logging.getLogger("shardvault.agent.archive")
SETTINGS_SECONDS = 300.0  # the policy is read again this often (an edit counts within 5 min)
DEFAULT_DELAY = 60.0
FAILURE_PAUSE = 5.0  # after a batch failed, before the spool is looked at again


@dataclass
class Settings:
    cluster: str
    compression: Compression
    max_delay_seconds: float
    encryption: Encryption | None
    read_at: float
    key_until: float

    def stale(self, now: float) -> bool:
        return now - self.read_at >= SETTINGS_SECONDS or now >= self.key_until


class LogSource(Protocol):
    """Where a shard's log waits to be archived (a source of one *log kind*:
    ``shardvault.contracts.wal_archive.LOG_KINDS``), and what lets it go once stored.

    - ``waiting()``: the files ready to archive, oldest first (a log's closed files);
    - ``due_at_once``: they go as soon as they wait (the source closed them on the policy's
      delay itself), not once the oldest has waited ``max_delay``;
    - ``look(now, max_delay)``: called before each look (a source that closes its own files
      closes a due one here);
    - ``let_go(names)``: the archive recorded them (from the oldest on): the source drops them;
    - ``linked()``: the shard's linked directories now, recorded with each batch."""

    shard_id: str
    kind: str
    due_at_once: bool

    def waiting(self) -> list[Path]: ...

    def look(self, now: float, max_delay: float) -> None: ...

    def let_go(self, names: list[str]) -> None: ...

    def linked(self) -> dict[str, str]: ...


@dataclass(frozen=True)
class Spool:
    """PostgreSQL's spool (``walspool``): the files its ``archive_command`` left, removed once
    stored."""

    shard_id: str
    path: Path
    # The shard's linked directories now (``EngineAdapter.linked_dirs``), recorded with
    # each batch it packs.
    linked: Callable[[], dict[str, str]] = dict
    kind: str = "wal"
    due_at_once: bool = False

    def waiting(self) -> list[Path]:
        return sorted(
            (p for p in self.path.iterdir() if WAL_FILE.fullmatch(p.name)), key=lambda p: p.name
        )

    def look(self, now: float, max_delay: float) -> None:
        return None  # PostgreSQL closes its segments (archive_timeout)

    def let_go(self, names: list[str]) -> None:
        for name in names:
            (self.path / name).unlink(missing_ok=True)


class Archiver:
    def __init__(
        self,
        *,
        node_id: str,
        spools: list[LogSource],
        state_dir: Path,
        invoke: Callable[[dict[str, Any]], dict[str, Any]],
        inbox: Any,
        sender: PartSender,
        keys: DataKeys,
        parallelism: int = 2,
        poll_seconds: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.node_id, self.spools, self.root = node_id, spools, state_dir / "archive"
        self.invoke, self.inbox, self.sender, self.keys = invoke, inbox, sender, keys
        self.parallelism, self.poll_seconds, self.clock = parallelism, poll_seconds, clock
        self.settings: Settings | None = None
        self.pool = ThreadPoolExecutor(max_workers=parallelism, thread_name_prefix="archive")
        self.in_flight: dict[str, tuple[Batch, Future]] = {}
        self.paused_until = 0.0
        self.stopping = threading.Event()
        self.wake = threading.Event()  # a look now: stopping, or a backup waiting
        # Per shard, the name through which a waiting backup needs the spool sent now.
        self.hurried: dict[str, str] = {}
        self.last_error = ""  # why the last batch that failed was not archived

    # --- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        """Archives until ``stop``: pending batches first, then whatever the spools hold."""
        while not self.stopping.is_set():
            try:
                self.tick()
            except Exception as error:  # the spool keeps the WAL: try again later
                log.warning("archiving paused: %s", error)
                self.paused_until = self.clock() + FAILURE_PAUSE
            self.wake.wait(self.poll_seconds)
            self.wake.clear()
        self.pool.shutdown(wait=True)

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()

    def tick(self) -> None:
        """One look: finished batches reaped, pending ones resumed, ready ones packed."""
        self._reap()
        now = self.clock()
        if now < self.paused_until:
            return
        settings = self._settings(now)
        pending = self.pending()  # read once a look: packs below add to ``held``
        for batch in pending:
            if batch.batch_id not in self.in_flight and self._room():
                self._start(batch)
        held = {f.name for batch in pending for f in batch.files}
        for spool in self.spools:
            try:
                self._look(spool, settings, now, held)
            except ShardVaultError as error:  # the next look tries again; others go on
                self.last_error = str(error)
                log.warning("shard %s's log could not be looked at: %s", spool.shard_id, error)

    def _look(self, spool: LogSource, settings: Settings, now: float, held: set[str]) -> None:
        """Packs and starts the source's next batches while there is room."""
        spool.look(now, settings.max_delay_seconds)
        while self._room():
            hurried = self.hurried.get(spool.shard_id, "")
            files = self.ready(spool, settings.max_delay_seconds, now, held, hurried)
            if not files:
                return
            batch = self.pack(spool, files, settings)
            held.update(f.name for f in batch.files)
            self._start(batch)

    def _room(self) -> bool:
        return len(self.in_flight) < self.parallelism

    def _start(self, batch: Batch) -> None:
        self.in_flight[batch.batch_id] = (batch, self.pool.submit(self.send, batch))

    def _reap(self) -> None:
        for batch_id, (batch, future) in list(self.in_flight.items()):
            if not future.done():
                continue
            del self.in_flight[batch_id]
            error = future.exception()
            if error is not None:
                self.last_error = str(error)
                log.warning(
                    "WAL batch %s of shard %s (%s..%s) not archived, tried again in %g s: %s",
                    batch_id,
                    batch.shard_id,
                    batch.files[0].name,
                    batch.files[-1].name,
                    FAILURE_PAUSE,
                    error,
                )
                self.paused_until = self.clock() + FAILURE_PAUSE

    def _settings(self, now: float) -> Settings:
        """The policy's settings, read again every ``SETTINGS_SECONDS``; a new data key only
        when the one in use ran out (or there is none)."""
        old = self.settings
        if old is not None and not old.stale(now):
            return old
        new_key = old is None or old.encryption is None or now >= old.key_until
        answer = self.call({"action": "settings", "new_key": new_key})
        encryption, key_until = None, float("inf")  # not sealed: no key runs out
        if answer.get("encrypt"):
            if answer.get("encryption"):
                encryption = Encryption.model_validate(answer["encryption"])
                key_until = now + (answer.get("key_seconds") or 86400.0)
            elif old is not None:  # sealed as before, under the key in use
                encryption, key_until = old.encryption, old.key_until
        self.settings = Settings(
            cluster=answer["cluster"],
            compression=Compression.model_validate(answer.get("compression") or {}),
            max_delay_seconds=answer.get("max_delay_seconds") or DEFAULT_DELAY,
            encryption=encryption,
            read_at=now,
            key_until=key_until,
        )
        return self.settings

    # --- choosing and packing ----------------------------------------------------------------
    def held(self) -> set[str]:
        """Names of the WAL files some pending batch holds (never put in a second batch)."""
        names: set[str] = set()
        for batch in self.pending():
            names.update(f.name for f in batch.files)
        return names

    def ready(
        self,
        spool: LogSource,
        max_delay: float,
        now: float,
        held: set[str] | None = None,
        hurried: str = "",
    ) -> list[Path]:
        """The spool's files for the next batch, oldest names first and up to the bound, if
        the batch is full, its oldest file has waited ``max_delay``, or its first file is not
        past ``hurried`` (a backup waits for it); else none. ``held``: the names pending
        batches hold (read from the state directory when not given)."""
        held = self.held() if held is None else held
        files = [p for p in spool.waiting() if p.name not in held]
        taken, size, oldest = [], 0, now
        for path in files:
            stat = path.stat()
            if taken and size + stat.st_size > BATCH_MAX_BYTES:
                return taken  # full
            taken.append(path)
            size += stat.st_size
            oldest = min(oldest, stat.st_mtime)
        due = bool(taken) and (
            spool.due_at_once or now - oldest >= max_delay or taken[0].name[:24] <= hurried
        )
        return taken if due else []

    def pack(self, spool: LogSource, files: list[Path], settings: Settings) -> Batch:
        """Packs ``files`` into a pending batch (written whole before it counts)."""
        batch_id = secrets.token_hex(16)
        work = self.root / f".{batch_id}"
        work.mkdir(parents=True)
        stats = [p.stat() for p in files]
        entries = [
            WalFile(name=p.name, size=st.st_size, pushed_at=st.st_mtime)
            for p, st in zip(files, stats, strict=True)
        ]
        length = sum(e.size for e in entries)
        sealer = self.keys.sealer(settings.encryption) if settings.encryption else None
        codec = FrameCodec(settings.compression, sealer)
        frame_size = frame_size_for(length)
        reader = _Concatenated(files)
        try:
            with open(work / "object", "wb") as out:
                packed = pack(
                    reader.read,
                    length,
                    frame_size,
                    2 * max(BATCH_MAX_BYTES, length),  # one part: a batch is one PUT
                    codec,
                    out,
                    batch_place(settings.cluster, spool.shard_id, batch_id),
                )
        finally:
            reader.close()
        encryption = None
        if settings.encryption is not None and sealer is not None:
            encryption = settings.encryption.model_copy(update={"key_check": sealer.check})
        batch = Batch(
            batch_id=batch_id,
            shard_id=spool.shard_id,
            files=entries,
            frame_size=frame_size,
            frames=pack_frames(packed.frames),
            stored_length=packed.stored_length,
            crc64nvme=packed.crc64nvme,
            encryption=encryption,
            links=spool.linked(),
            kind=spool.kind,
        )
        (work / "batch.json").write_text(batch.model_dump_json())
        work.rename(self.root / batch_id)  # now pending: a restart finishes it
        return batch

    def pending(self) -> list[Batch]:
        if not self.root.is_dir():
            return []
        batches = []
        for path in sorted(self.root.iterdir()):
            if path.name.startswith("."):  # a pack that died (packs run in this thread only)
                shutil.rmtree(path, ignore_errors=True)  # its files are still in the spool
                continue
            try:
                batches.append(Batch.model_validate_json((path / "batch.json").read_text()))
            except FileNotFoundError:  # recorded and removed just now by its sender
                continue
        return batches

    # --- a backup's WAL ---------------------------------------------------------------------
    def wait_archived(self, shard_id: str, through: str, timeout: float) -> None:
        """Sends the shard's spooled WAL up to segment ``through`` now, and returns once the
        archive has recorded it (its files left the spool: ``send`` removes them only after
        the record). Raises ``WalNotArchived`` after ``timeout`` seconds, with the last
        failure's cause."""
        spool = next(s for s in self.spools if s.shard_id == shard_id)
        self.hurried[shard_id] = max(self.hurried.get(shard_id, ""), through)
        deadline = time.monotonic() + timeout
        try:
            while waiting := self.unarchived(spool, through):
                if time.monotonic() >= deadline:
                    raise WalNotArchived(
                        f"shard {shard_id}'s WAL up to {through} was not archived within "
                        f"{timeout:g} s: {len(waiting)} file(s) from {waiting[0]} are still in "
                        f"the spool of shard {shard_id}"
                        + (f" (last failure: {self.last_error})" if self.last_error else ""),
                        fix="see the agent's log for why the archive does not take the spool "
                        "(the policy's archive section, the archive function); the backup may "
                        "be started again once the spool drains.",
                    )
                self.wake.set()
                time.sleep(0.05)
        finally:
            if self.hurried.get(shard_id) == through:
                del self.hurried[shard_id]

    @staticmethod
    def unarchived(spool: LogSource, through: str) -> list[str]:
        """The spool's WAL files up to segment ``through`` (names compare within a timeline;
        a backup history file by its segment's), in name order."""
        try:
            names = [p.name for p in spool.waiting()]
        except FileNotFoundError:
            return []
        return sorted(n for n in names if n[:24] <= through and not n.endswith(".history"))

    # --- sending -----------------------------------------------------------------------------
    def send(self, batch: Batch) -> None:
        """Request, sign, upload, record; then the spool lets the files go."""
        request = f"{REQUEST_PREFIX}{batch.batch_id}"
        self.inbox.put_item(
            Item={"node_id": self.node_id, "command_id": request, "batch": batch.model_dump_json()}
        )
        signed = self.call({"action": "sign", "batch_id": batch.batch_id})
        path = self.root / batch.batch_id / "object"
        what = f"WAL batch {batch.files[0].name}..{batch.files[-1].name}"
        self.sender.send_file(signed["url"], path, batch.stored_length, batch.crc64nvme, what)
        self.call({"action": "record", "batch_id": batch.batch_id})
        spool = next(s for s in self.spools if s.shard_id == batch.shard_id)
        spool.let_go([entry.name for entry in batch.files])
        # The request before the pending batch: a crash between the two leaves the batch,
        # which a restart sends again (and so removes the request it writes again); the other
        # order left a request nothing would ever remove.
        self.inbox.delete_item(Key={"node_id": self.node_id, "command_id": request})
        shutil.rmtree(self.root / batch.batch_id, ignore_errors=True)
        log.info(
            "archived %d WAL file(s) of shard %s, %s..%s: %d bytes stored of %d",
            len(batch.files),
            batch.shard_id,
            batch.files[0].name,
            batch.files[-1].name,
            batch.stored_length,
            batch.plain_length,
        )

    def call(self, event: dict[str, Any]) -> dict[str, Any]:
        answer = self.invoke({**event, "node_id": self.node_id})
        if "errorType" in answer:
            raise ArchiveRefused(
                f"the archive function refused {event['action']}: {answer['errorType']}: "
                f"{answer.get('errorMessage', '')}",
                fix="see the message; the spool keeps the WAL until it is archived.",
            )
        return answer


def spool_state(source: LogSource, now: float) -> tuple[int, float]:
    """Bytes of log waiting in a source, and how long its oldest file has waited (the
    heartbeat's report; the watch alarms on a spool that does not drain)."""
    try:
        stats = [p.stat() for p in source.waiting()]
    except (OSError, ShardVaultError):  # archived meanwhile, or gone: nothing is waiting
        return 0, 0.0
    return sum(s.st_size for s in stats), max((now - s.st_mtime for s in stats), default=0.0)


class _Concatenated:
    """Reads files back to back as one stream. Not ``transfer.StreamReader``: it reads a file
    that vanished as zeros (a data file's engine repairs it from its log), which would archive
    zeros under a WAL file's name; here a missing file fails the pack, and the files stay."""

    def __init__(self, paths: list[Path]) -> None:
        self.paths, self.current = list(paths), None

    def read(self, size: int) -> bytes:
        chunks = []
        while size:
            if self.current is None:
                if not self.paths:
                    break
                self.current = open(self.paths.pop(0), "rb")  # noqa: SIM115 - closed below
            chunk = self.current.read(size)
            if not chunk:
                self.current.close()
                self.current = None
                continue
            chunks.append(chunk)
            size -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        if self.current is not None:
            self.current.close()


def lambda_invoker(client: Any, function_name: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Invokes the archive function; its answer, or Lambda's error shape on a failure."""

    def invoke(event: dict[str, Any]) -> dict[str, Any]:
        response = client.invoke(FunctionName=function_name, Payload=json.dumps(event).encode())
        answer = json.loads(response["Payload"].read() or b"{}")
        if response.get("FunctionError") and "errorType" not in answer:
            answer = {"errorType": response["FunctionError"], "errorMessage": str(answer)}
        return answer

    return invoke
