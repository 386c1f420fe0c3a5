"""What the control plane knows of each engine: the few traits that change a check or a plan.

Everything else about an engine (how to flush, checkpoint, stop and release it, how to finish
and check a restored copy, its server) is the agent's, one adapter per engine
(``shardvault_agent.engines``). Terms:

- *logged tail*: a backup's tail holds the engine's write-ahead log as ``pg_wal/<segment>``
  files, from the backup's first segment to its last (PostgreSQL); verify checks them for a
  gap (``pgwal``).
- *point in time*: the engine archives its log continuously (``shardvault.wal.archive``), so a
  restore may replay past a backup to one of its *targets* (``shardvault.wal.pitr``):
  PostgreSQL's WAL to a time, an LSN, a restore point or its end; MariaDB's binary logs to a
  time (in whole seconds), a position or their end.
- *runs queries*: a restored copy answers the request's validation queries (RocksDB and
  command hooks know no query language: a digest of every pair, or the finish hook, checks
  the copy).
- *mixed cluster*: one whose nodes run different engines, which only the policy allows (its
  ``engine`` lists them); a backup records each shard's engine and a restore places each shard
  on a target node of that engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shardvault.contracts.models import Engine


@dataclass(frozen=True)
class EngineTraits:
    logged_tail: bool = False
    point_in_time: bool = False
    runs_queries: bool = True
    # The point-in-time targets its log can stop at (``RestoreTarget.kind``); a time in
    # whole seconds only (``whole_seconds``: its log stamps events by the second).
    targets: frozenset[str] = frozenset()
    whole_seconds: bool = False
    # How messages name its archived log and one file of it, and what closes the open file
    # (nothing past it is archived): PostgreSQL's WAL and segments, MariaDB's binary logs.
    log: str = ""
    log_file: str = ""
    closes: str = ""


TRAITS = {
    Engine.SQLITE: EngineTraits(),
    Engine.POSTGRES: EngineTraits(
        logged_tail=True,
        point_in_time=True,
        targets=frozenset({"time", "lsn", "name", "latest"}),
        log="WAL",
        log_file="segment",
        closes="PostgreSQL closes a segment every archive_timeout",
    ),
    Engine.MARIADB: EngineTraits(
        point_in_time=True,
        targets=frozenset({"time", "position", "latest"}),
        whole_seconds=True,
        log="binary log",
        log_file="binary log",
        closes="the agent closes a binary log after the policy's archive.max_delay_seconds",
    ),
    Engine.ROCKSDB: EngineTraits(runs_queries=False),
    Engine.HOOKS: EngineTraits(runs_queries=False),
}


def traits(engine: Engine) -> EngineTraits:
    return TRAITS[engine]


def label(engines: Iterable[Engine]) -> str:
    """How the catalog and messages name a backup's engines: ``sqlite``, or ``rocksdb+sqlite``
    for a mixed cluster."""
    return "+".join(sorted({engine.value for engine in engines}))
