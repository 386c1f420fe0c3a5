"""The engine interface: everything ShardVault knows of an engine, both directions.

``EngineAdapter`` joins four sides, each its own protocol: ``BackupSource`` (below, Backup),
``LoadSignals`` (``server_pid``, ``health_probe``), ``RestoreTarget`` (``finish``,
``adoptable``) and ``ServerControl`` (the server a restored copy runs). Two bases hold what
adapters share: ``CopySource`` for engines whose checkpoint is a copy in the agent's state
directory (SQLite, RocksDB, MariaDB, and hooks' held directories), and ``NoServer`` for
engines that run no server from a restored copy. The conformance suite
(``tests/integration/test_engine_conformance.py``) runs every adapter through one contract.

Adding an engine is one module here that implements ``EngineAdapter`` (and its tests), plus
its name in ``shardvault.contracts.models.Engine`` and ``engines.ADAPTERS`` and the traits the
control plane knows of it (``shardvault.contracts.engines.TRAITS``); nothing outside this package
tests an engine's name (``tests/unit/test_engine_seam.py`` checks all of that).

Backup:

- *check*: the shard's data is where its configuration entry says (a database, not just a
  path); raises ``ShardDataMissing`` naming the fix. It reads only: no adapter ever creates a
  file in a source, so a misspelled path fails by name instead of backing up an empty database.
- *shard_bytes*: the shard's size for the registry; 0 (logged once) when its data is missing,
  since the heartbeat must go on; flush and checkpoint refuse such a shard by name.
- *flush*: make recent writes durable in the engine's files (cheap; run on all nodes first).
- *checkpoint_flushes*: the engine's checkpoint makes recent writes durable itself
  (PostgreSQL's ``pg_backup_start`` takes an immediate checkpoint). Flush exists to bring
  several nodes' checkpoints close together; a backup of one node flushes in its Checkpoint
  command, and skips the flush for such an engine (a second checkpoint, 13 to 16 ms of a
  small incremental, that brought nothing together).
- *screen_module*: the module of the engine's block screen (PostgreSQL's page LSNs,
  ``engines.pgpages``), None for an engine without one (``block_screen`` returns None). The
  agent starts the mapped screen's helper with it at its own start
  (``shardvault_agent.backup.mappedscreen``: the imports take about 0.2 s, which an incremental
  would otherwise wait for at its first screened range).
- *checkpoint*: fix a consistent set of files to copy and return its listing; the engine
  keeps them restorable (a snapshot, or a backup mode with WAL retained) until release.
- *stop*: end the checkpoint and return the *tail*: files needed to make the copy consistent
  on its own (PostgreSQL's backup label and WAL). Empty for engines that snapshot.
- *release*: give back everything the checkpoint held. Safe to call at any point, twice.
- *held_log*: how much of its log the engine keeps on the source for the backup's checkpoint
  (PostgreSQL: the WAL its replication slot retains) and the directory it fills
  (``sourceguard`` reports it and fails the backup by name before that disk fills); None for
  engines whose checkpoint holds no log on the source.
- *server_pid* / *health_probe*: the shard's server process (its cgroup's stall information)
  and a session that asks it a cheap question (its answer time); both steer an adaptive
  backup (``throttle``). None for engines without a server.
- *held_backups*: the backups whose checkpoints the engine keeps on disk across an agent
  restart (SQLite's snapshots; PostgreSQL's backup mode dies with the agent's session), so a
  starting agent can release those whose backup has ended (``reconcile``).
- *block_screen*: what lets an incremental's scan skip reading blocks: given this capture's
  marker and the parent's, a ``BlockScreen`` that says from each block's header alone which
  blocks may have changed since the parent (PostgreSQL: the page LSN against the parent's
  start), or None (every block of a changed file is read and hashed).

Restore (``shardvault_agent.restore`` places the files; the adapter makes them a database):

- *fsyncs_restored_files*: the engine makes a restored copy's files durable itself when it
  starts (PostgreSQL fsyncs its data directory when recovery begins from a backup label);
  otherwise the restore fsyncs the placed files before the shard counts as restored.
- *finish*: turn placed files into a checked, running copy (``Finishing``): recover and start
  a server where the engine has one, run the engine's checks and the policy's validation
  queries; returns the shard's result, ``checks`` among it.
- *adoptable*: the ``ShardConfig`` fields with which this node backs up the copy it finished.
- *serving* / *stop_server* / *start_server*: the server that runs from a shard's directory
  (an earlier restore's copy that a restore with ``replace`` moves aside, or this restore's
  copy that an abort removes). Engines without a server answer None and do nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from shardvault.contracts.cut import CutRequest
from shardvault.contracts.models import FileEntry
from shardvault.errors import CheckpointNotFound, EngineError, ShardDataMissing
from shardvault_agent.backup.throttle import HealthProbe
from shardvault_agent.config import AgentConfig, ShardConfig
from shardvault_agent.wal.archiver import LogSource

log = logging.getLogger("shardvault.agent")
_reported: set[str] = set()  # problems already logged by size_or_zero


@dataclass
class Capture:
    """Files captured for one shard phase: paths relative to ``root``. ``trust_identity``:
    the engine changes its files only through the file system (never by writes to a mapped
    file, which need not touch ctime), so an incremental may skip a file whose identity and
    size are unchanged since its parent (``scan``: *unchanged file*)."""

    root: Path
    files: list[FileEntry]
    marker: dict[str, str] = field(default_factory=dict)
    mutable: bool = False
    trust_identity: bool = False


@dataclass(frozen=True)
class HeldLog:
    """Log a checkpoint keeps on the source: its bytes, and the directory they fill.
    ``let_go``: log it held until just now and has let go (PostgreSQL's hand-off to the
    archive): part of the report's peak, not of what the source guard bounds."""

    bytes: int
    directory: Path
    let_go: int = 0


@dataclass
class Finishing:
    """One shard to finish on this node: its files are complete at ``root``. ``layout``: what
    prepare laid out (the backup's ``marker``, a point-in-time ``recovery`` target).
    ``servers_given``: how this restore's other shards' servers are reached (the adapter's
    own notes, e.g. their ports); ``note_server`` records a server's note before it starts,
    so an abort stops a server that is starting."""

    shard_id: str
    root: Path
    layout: dict[str, Any]
    validation_queries: list[str]
    heapallindexed: bool
    servers_given: list[dict[str, Any]]
    note_server: Callable[[dict[str, Any]], None]
    # A point-in-time restore's WAL feed (``restore.walfeed``): ``wal_done`` stops it once the
    # server left recovery and removes the WAL directory; ``wal_progress`` is when it last
    # moved (``time.monotonic``), from which the wait for recovery is counted.
    wal_done: Callable[[], None] = lambda: None
    wal_progress: Callable[[], float] | None = None


class BlockScreen(Protocol):
    """An engine's proof, from the first bytes of a block (its *header*), that the block holds
    what the parent backup stored for it. Blocks are ``blockmap.BLOCK_SIZE`` bytes.

    - ``screens(path)``: the file's blocks all carry such a header (a path the engine does
      not vouch for is read and hashed whole);
    - ``may_differ(blocks, block_size)``: of consecutive blocks read into one buffer (the
      last possibly cut short), the indexes of those whose headers do not prove them
      unchanged (a block too short to hold its header must be among them).

    The scan only screens a file the parent read at the same path, by its device and inode
    (``BlockMap.same_file``), against a parent this node made (``backup.commands.parent_screen``),
    and hashes every block the screen lets through, so a block whose header moved but whose
    bytes did not is not sent."""

    def screens(self, path: str) -> bool: ...

    def may_differ(self, blocks: memoryview, block_size: int) -> list[int]: ...


class BackupSource(Protocol):
    """The backup side: where a shard's data is, and how a consistent copy of it is taken,
    held and given back."""

    shard_fields: ClassVar[tuple[str, ...]]  # the ShardConfig fields its shards must set
    config_fields: ClassVar[tuple[str, ...]]  # the AgentConfig sections its agents must set
    checkpoint_flushes: ClassVar[bool]
    screen_module: ClassVar[str | None]

    def check(self, shard: ShardConfig) -> None: ...

    def check_ready(self, shard: ShardConfig) -> None:
        """``check``, and what a backup needs of the engine (settings, privileges, a server
        that answers): a shard this node leads reports its problem with each heartbeat, so a
        backup is refused by name before anything is taken."""
        ...

    def shard_bytes(self, shard: ShardConfig) -> int: ...

    def flush(self, shard: ShardConfig) -> None: ...

    def checkpoint(
        self, shard: ShardConfig, backup_id: str, work_dir: Path, *, log_archived: bool = False
    ) -> Capture:
        """Takes the shard's checkpoint. ``log_archived``: the agent's archiver stores the
        shard's log and the control plane copies an archived tail into the backup (the
        checkpoint command's ``archived_tails``): an engine whose tail is its log may then
        refer to the archive instead of holding and copying the log (PostgreSQL: the
        *archived tail*). Others ignore it."""
        ...

    def holds(self, shard: ShardConfig, backup_id: str) -> bool: ...

    def stop(
        self, shard: ShardConfig, backup_id: str, work_dir: Path, cut: CutRequest | None = None
    ) -> Capture:
        """Ends the shard's backup and captures its tail; ``cut``: then, at the cut's
        instant, marks the cluster's cut in the shard's log (``shardvault.contracts.cut``), and the
        tail reaches it. An engine without such marks ignores ``cut``."""
        ...

    def release(self, shard: ShardConfig, backup_id: str) -> None: ...

    def cut(self, shard: ShardConfig, cut: CutRequest) -> dict[str, str]:
        """A scheduled cut, with no backup: at the cut's instant, the cluster's restore point
        in the shard's log, on disk before it answers; the marker fields that record it
        (``cut_wal``: the log file that holds it). An engine without restore points refuses
        it (``EngineError``)."""
        ...

    def use_log_archive(self, shard_ids: set[str]) -> None:
        """The shards whose log the agent's archiver stores (the daemon says so as it starts
        the archiver): what ``check_ready`` asks of them may differ (PostgreSQL: an archived
        tail takes no slot). Others ignore it."""
        ...

    def log_source(self, shard: ShardConfig) -> LogSource | None:
        """Where the archiver finds the shard's log to store (``wal.archiver.LogSource``):
        PostgreSQL's spool, MariaDB's binary logs; None: the shard's log is not archived."""
        ...

    def linked_dirs(self, shard: ShardConfig) -> dict[str, str]:
        """The shard's linked directories now (``shardvault.contracts.links``): each link's
        path in the shard and where it leads, as the link says. The archiver records them
        with each batch: a point-in-time restore must know a tablespace created after its
        base, whose replay writes into the directory it was created in."""
        ...

    def held_backups(self) -> set[str]:
        """The backups whose hold outlives the agent's process (files in its state directory),
        for ``reconcile`` to release after a restart; a hold that ends with the process (a
        server session) is not named."""
        ...

    def held_log(self, shard: ShardConfig, backup_id: str) -> HeldLog | None: ...

    def block_screen(
        self, marker: dict[str, str], parent_marker: dict[str, str]
    ) -> BlockScreen | None: ...


class LoadSignals(Protocol):
    """What steers an adaptive backup (``throttle``): the shard's server and its health."""

    def server_pid(self, shard: ShardConfig) -> int | None: ...

    def health_probe(self, shard: ShardConfig) -> HealthProbe | None:
        """A session of its own on the shard's server (closed by the throttle); None when
        the engine has no server, or it cannot be reached (the host's signals remain)."""
        ...


class RestoreTarget(Protocol):
    """The restore side: placed files made into a checked copy, and what backs that copy up."""

    fsyncs_restored_files: ClassVar[bool]

    def finish(self, job: Finishing) -> dict[str, Any]: ...

    def adoptable(self, shard_id: str, result: dict[str, Any]) -> dict[str, Any] | None: ...


class ServerControl(Protocol):
    """The server that runs from a shard's directory, as a restore's undo needs it."""

    def serving(self, root: Path) -> dict[str, Any] | None:
        """How the server running from ``root`` is reached (what ``start_server`` needs to
        start it again); None when none runs."""
        ...

    def stop_server(self, root: Path, *, immediate: bool = False) -> None: ...

    def server_files(self, root: Path) -> list[Path]:
        """What a server of ``root`` keeps beside it (its socket directory, its log): removed
        with the shard when its restore is undone."""
        ...

    def start_server(self, root: Path, server: dict[str, Any]) -> None:
        """Starts the server of ``root`` again as ``serving`` described it; best effort (a
        failure is logged: it runs while a failed restore is undone)."""
        ...

    def server_account(self) -> tuple[int, int] | None:
        """The uid and gid the server runs as when the agent is root: a file the agent puts
        into a running copy (a WAL feed's segment, which the server later recycles and
        writes) must be that account's. None: no server, or the agent's own account."""
        ...


class EngineAdapter(BackupSource, LoadSignals, RestoreTarget, ServerControl, Protocol):
    """Everything the agent asks of an engine, both directions (the module's docstring)."""


class CopySource:
    """A shard whose checkpoint is a copy in the agent's ``state_dir`` (``copies`` names its
    directory there: ``<state_dir>/<copies>/<backup id>/<shard id>``). Nothing is held on the
    source: the copy alone is the hold, and it outlives the agent's process (``held_backups``).
    There is no log to keep or archive, no block screen and no server to watch."""

    copies: ClassVar[str]  # the directory under state_dir
    copy_proof: ClassVar[str | None] = None  # a file only a whole copy has; None: the directory
    what: ClassVar[str] = "copy"  # how errors name a copy ("SQLite snapshot")
    config_fields: ClassVar[tuple[str, ...]] = ()
    checkpoint_flushes: ClassVar[bool] = False
    screen_module: ClassVar[str | None] = None

    def __init__(self, config: AgentConfig) -> None:
        self.config = config

    def copy_dir(self, backup_id: str, shard: ShardConfig) -> Path:
        return self.config.state_dir / self.copies / backup_id / shard.shard_id

    def holds(self, shard: ShardConfig, backup_id: str) -> bool:
        copy = self.copy_dir(backup_id, shard)
        return (copy / self.copy_proof).is_file() if self.copy_proof else copy.exists()

    def stop(
        self, shard: ShardConfig, backup_id: str, work_dir: Path, cut: CutRequest | None = None
    ) -> Capture:
        """No tail and no cut: the copy is consistent on its own."""
        if not self.holds(shard, backup_id):
            raise CheckpointNotFound(
                f"no {self.what} of shard {shard.shard_id} for backup {backup_id}.",
                fix="retry the backup.",
            )
        return Capture(root=self.copy_dir(backup_id, shard), files=[])

    def cut(self, shard: ShardConfig, cut: CutRequest) -> dict[str, str]:
        raise EngineError(
            f"shard {shard.shard_id}: a {self.what} makes no restore point a restore could stop "
            "at, so it takes no scheduled cut.",
            fix="remove cut.every_minutes from this cluster's policy; its backups are its points.",
        )

    def release(self, shard: ShardConfig, backup_id: str) -> None:
        copy = self.copy_dir(backup_id, shard)
        shutil.rmtree(copy, ignore_errors=True)
        with contextlib.suppress(OSError):  # the backup's directory, once its last shard left
            copy.parent.rmdir()

    def held_backups(self) -> set[str]:
        return {p.name for p in (self.config.state_dir / self.copies).glob("*") if p.is_dir()}

    def use_log_archive(self, shard_ids: set[str]) -> None:
        pass  # no log to archive

    def linked_dirs(self, shard: ShardConfig) -> dict[str, str]:
        return {}  # a copy in the state dir holds no links

    def log_source(self, shard: ShardConfig) -> LogSource | None:
        return None  # no log archived

    def held_log(self, shard: ShardConfig, backup_id: str) -> HeldLog | None:
        return None  # a copy in the state dir: nothing held on the source

    def block_screen(
        self, marker: dict[str, str], parent_marker: dict[str, str]
    ) -> BlockScreen | None:
        return None  # no block header the agent can vouch for: every block is read

    def server_pid(self, shard: ShardConfig) -> int | None:
        return None  # the host's stall signals steer its backups

    def health_probe(self, shard: ShardConfig) -> HealthProbe | None:
        return None


class NoServer:
    """An engine that runs no server from a restored copy (a file, or what hooks started)."""

    def serving(self, root: Path) -> dict[str, Any] | None:
        return None

    def stop_server(self, root: Path, *, immediate: bool = False) -> None:
        return None

    def server_files(self, root: Path) -> list[Path]:
        return []

    def start_server(self, root: Path, server: dict[str, Any]) -> None:
        return None

    def server_account(self) -> tuple[int, int] | None:
        return None


def list_tree(
    root: Path,
    skip_dir: Callable[[str], bool] = lambda rel: False,
    skip_file: Callable[[str], bool] = lambda rel: False,
    follow: Callable[[str], bool] = lambda rel: False,
) -> list[FileEntry]:
    """Regular files under ``root`` in sorted order (by path component, as ``pathlib`` sorts
    paths), plus directories that would otherwise be lost (as ``path/`` with size 0), so a
    restore recreates the tree exactly. A skipped directory is listed, empty. A link to a file
    is listed as a file of its target's size; a link to a directory is left out unless
    ``follow`` names it (a *linked directory*, ``shardvault.contracts.links``: then it is
    listed as a directory and walked). One ``os.scandir`` per directory: a PostgreSQL data
    directory's thousand files are listed at every checkpoint, and ``pathlib``'s walk took
    0.1 to 0.2 s of it."""
    found: list[tuple[list[str], FileEntry]] = []
    _walk(os.fspath(root), "", Walk(skip_dir, skip_file, follow), found)
    found.sort(key=lambda item: item[0])
    return [entry for _, entry in found]


@dataclass(frozen=True)
class Walk:
    """What ``list_tree`` skips and follows, by path relative to its root."""

    skip_dir: Callable[[str], bool]
    skip_file: Callable[[str], bool]
    follow: Callable[[str], bool]


def _walk(
    directory: str, prefix: str, walk: Walk, found: list[tuple[list[str], FileEntry]]
) -> None:
    try:
        with os.scandir(directory) as scan:
            entries = list(scan)
    except (FileNotFoundError, NotADirectoryError):
        return  # removed while listing (a dropped database's directory)
    for entry in entries:
        rel = prefix + entry.name
        try:
            if entry.is_dir(follow_symlinks=False) or (
                entry.is_symlink() and walk.follow(rel) and entry.is_dir()
            ):
                found.append((rel.split("/"), FileEntry(path=rel + "/", size=0)))
                if not walk.skip_dir(rel):
                    _walk(entry.path, rel + "/", walk, found)
            elif entry.is_file() and not walk.skip_file(rel):
                found.append((rel.split("/"), FileEntry(path=rel, size=entry.stat().st_size)))
        except FileNotFoundError:
            continue  # removed while listing; the engine's log recreates or drops it


def tree_bytes(root: Path) -> int:
    """The bytes of every file under ``root`` (a link to a file counts as its target; links
    to directories are not walked). A file or directory removed while it is walked (a
    dropped table, a temporary file) counts as 0."""
    return _dir_bytes(os.fspath(root))


def _dir_bytes(path: str) -> int:
    total = 0
    with os.scandir(path) as entries:
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    total += _dir_bytes(entry.path)
                elif entry.is_file():
                    total += entry.stat().st_size
            except FileNotFoundError:
                continue
    return total


def size_or_zero(adapter: EngineAdapter, shard: ShardConfig, measure: Callable[[], int]) -> int:
    """``measure()`` for a shard whose data is where its entry says; 0 when it is not, logged
    the first time (the heartbeat asks every few seconds and must not stop for one shard)."""
    try:
        adapter.check(shard)
        return measure()
    except (ShardDataMissing, OSError) as error:  # OSError: removed since the check
        if str(error) not in _reported:
            _reported.add(str(error))
            log.warning("shard %s counted as 0 bytes: %s", shard.shard_id, error)
        return 0
