"""The source guard: the peak of what a backup holds of its source's log, and its failure by
name before the source's disk fills."""

from __future__ import annotations

from pathlib import Path

import pytest
from shardvault_agent.backup.sourceguard import HOLDS_SOMETHING, SourceGuard
from shardvault_agent.engines.base import HeldLog
from shardvault_agent.ratelimit import RateLimiter

from shardvault.errors import SourceLogFull

MiB = 2**20
WAL = Path("/var/lib/postgresql/15/main/pg_wal")


class Source:
    def __init__(self, held: list[int], free: float = 0.5) -> None:
        self.held, self.free = held, free
        self.fails = False

    def measure(self) -> list[HeldLog]:
        if self.fails:
            raise OSError("server gone")
        return [HeldLog(n, WAL) for n in self.held]

    def free_share(self, directory: Path) -> float:
        assert directory == WAL
        return self.free


def guard_of(source: Source, max_bytes: int | None = None, min_free: float = 5.0) -> SourceGuard:
    guard = SourceGuard(
        "b1", source.measure, max_bytes, min_free, free_share=source.free_share, interval=3600
    )
    guard.close()  # its thread sampled once; the test samples by hand
    return guard


def test_the_guard_keeps_the_peak_of_what_all_shards_hold() -> None:
    source = Source([10 * MiB, 20 * MiB])
    guard = guard_of(source)
    assert guard.peak == 30 * MiB
    source.held = [5 * MiB]
    guard.sample()
    assert guard.peak == 30 * MiB
    guard.check()  # under every limit: reads go on


def test_more_than_the_policys_cap_fails_every_later_read_by_name() -> None:
    source = Source([100 * MiB])
    guard = guard_of(source, max_bytes=64 * MiB)
    limiter = RateLimiter(None, guard=guard.check)
    with pytest.raises(SourceLogFull, match=r"holds 100 MiB .* max_held_wal_mib \(64\)"):
        limiter.take(1)


def test_a_disk_near_full_fails_the_backup_only_once_it_holds_a_segment() -> None:
    source = Source([HOLDS_SOMETHING - 1], free=0.01)
    guard = guard_of(source)
    guard.check()  # nearly full before the backup held anything: not the backup's doing
    source.held = [HOLDS_SOMETHING]
    guard.sample()
    with pytest.raises(SourceLogFull, match=r"1\.0% free, below .* \(5 %\)"):
        guard.check()


def test_a_measurement_that_fails_says_nothing_and_fails_nothing() -> None:
    source = Source([100 * MiB])
    source.fails = True
    guard = guard_of(source, max_bytes=16 * MiB)
    guard.check()
    assert guard.peak is None


def test_log_let_go_counts_in_the_peak_but_never_trips_the_cap() -> None:
    """A backup that hands its WAL to the archive (PostgreSQL's hand-off) held it until then:
    the report says so, and the policy's cap is about what the source keeps now."""

    class HandingOff(Source):
        def measure(self) -> list[HeldLog]:
            return [HeldLog(0, WAL, let_go=300 * MiB)]

    guard = guard_of(HandingOff([]), max_bytes=100 * MiB)
    assert guard.peak == 300 * MiB
    guard.check()  # nothing held now: reads go on
