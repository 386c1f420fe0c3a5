"""The source guard: what a running backup holds of its source's log, reported, and bounded
before the source's disk fills.

Terms:
- *held log*: the log an engine keeps on the source for a backup's checkpoint
  (``EngineAdapter.held_log``; PostgreSQL: the WAL from its replication slot's restart point
  to the server's current position). A slow backup holds more: every segment written while
  it reads, none recycled by checkpoints, until release.
- *guard*: a thread per backup, from its checkpoint to its release, that measures the held
  log of the node's shards every ``GUARD_SECONDS`` and keeps the peak (log an engine has just
  let go, ``HeldLog.let_go``, counts in the peak, not in the limits). It *trips* when the
  held log passes the policy's ``max_held_wal_mib``, or when the disk that holds it has less
  free than ``min_source_free_percent`` while the backup holds at least ``HOLDS_SOMETHING``
  (a disk that was nearly full before is not the backup's doing until it holds a segment).
- *guarded reads*: every read of the backup takes from its rate limiter, which checks the
  guard first (``RateLimiter``'s ``guard``): a tripped guard fails the read with
  ``SourceLogFull``. The
  command fails by name, the backup's failure path releases the checkpoint, and the source
  lets the log go. A measurement that fails says nothing (logged once): the guard never fails
  a backup for its own trouble. A guard that finds nothing held ``NOTHING_HELD_STOP`` times
  in a row ends (engines that hold no log on the source; a backup past its release).
"""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Callable, Iterable
from typing import Any

from shardvault.errors import SourceLogFull
from shardvault_agent.engines.base import HeldLog

log = logging.getLogger("shardvault.agent")

GUARD_SECONDS = 1.0
NOTHING_HELD_STOP = 5  # samples in a row that find nothing held: the guard has nothing to do
HOLDS_SOMETHING = 16 * 2**20  # one WAL segment (PostgreSQL's default size)
MiB = 2**20


def disk_free_share(directory: Any) -> float:
    usage = shutil.disk_usage(directory)
    return usage.free / usage.total if usage.total else 1.0


class SourceGuard:
    """Watches what one backup holds (see the module docstring)."""

    def __init__(
        self,
        backup_id: str,
        measure: Callable[[], Iterable[HeldLog]],
        max_bytes: int | None,
        min_free_percent: float,
        free_share: Callable[[Any], float] = disk_free_share,
        interval: float = GUARD_SECONDS,
    ) -> None:
        self.backup_id, self.measure, self.free_share = backup_id, measure, free_share
        self.max_bytes, self.min_free = max_bytes, min_free_percent / 100
        self.interval = interval
        self.peak: int | None = None
        self.tripped: SourceLogFull | None = None
        self.stopping = threading.Event()
        self.complained = False
        self.thread = threading.Thread(target=self._run, name="source-guard", daemon=True)
        self.thread.start()

    def check(self) -> None:
        """Raises the guard's error once it tripped."""
        if self.tripped is not None:
            raise self.tripped

    def close(self) -> None:
        self.stopping.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=10)

    def _run(self) -> None:
        empty = 0
        while True:
            empty = 0 if self.sample() else empty + 1
            if self.tripped is not None or empty >= NOTHING_HELD_STOP:
                return  # tripped for good, or an engine that holds no log here
            if self.stopping.wait(self.interval):
                return

    def sample(self) -> bool:
        """One measurement: the peak grows, and the guard trips when the log is too much.
        False when nothing is held (or it cannot be measured)."""
        try:
            held = list(self.measure())
            free = {h.directory: self.free_share(h.directory) for h in held}
        except Exception as error:
            if not self.complained:
                log.warning("cannot measure the log backup %s holds: %s", self.backup_id, error)
                self.complained = True
            return False
        if not held:
            return False
        total = sum(h.bytes for h in held)
        self.peak = max(self.peak or 0, total + sum(h.let_go for h in held))
        if self.max_bytes is not None and total > self.max_bytes:
            self.tripped = SourceLogFull(
                f"backup {self.backup_id} holds {total / MiB:,.0f} MiB of the source's WAL, "
                f"more than the policy's max_held_wal_mib ({self.max_bytes / MiB:,.0f}).",
                fix="the backup was failed and the WAL let go; let it read faster (upload "
                "rate_limit_mib_per_second, throttle), or raise max_held_wal_mib if the "
                "source's disk has room.",
            )
        elif total >= HOLDS_SOMETHING and (low := min(free.values())) < self.min_free:
            where = min(free, key=free.__getitem__)
            self.tripped = SourceLogFull(
                f"backup {self.backup_id} holds {total / MiB:,.0f} MiB of the source's WAL "
                f"and {where} has {low:.1%} free, below the policy's min_source_free_percent "
                f"({self.min_free * 100:g} %).",
                fix="the backup was failed and the WAL let go before the disk filled; free "
                "space on the source, or let backups read faster.",
            )
        if self.tripped is not None:
            log.error("%s", self.tripped)
        return True
