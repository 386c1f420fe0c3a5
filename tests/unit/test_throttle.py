"""The adaptive throttle: its controller over simulated sources, its signals over files and
probes it is given, and its limiter steering real reads."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from shardvault_agent.backup import throttle
from shardvault_agent.backup.throttle import (
    DECREASE,
    MILD_DECREASE,
    REBASE_SECONDS,
    RECOVERY_SHARE,
    SETTLE_SECONDS,
    START_MULTIPLE,
    TICK_SECONDS,
    AdaptiveLimiter,
    Aimd,
    LatencySignal,
    StallSignal,
    pressure_files,
    read_stall_total,
)

MB = 1_000_000


class Source:
    """A database that stays healthy while the backup reads at most ``safe`` bytes a second:
    its pressure is the read rate over that; the reader could take ``speed``."""

    def __init__(self, safe: float, speed: float = 800 * MB) -> None:
        self.safe, self.speed = safe, speed

    def run(self, aimd: Aimd, seconds: float, start: float = 0.0, taken: float | None = None):
        """Ticks ``aimd`` for ``seconds``; yields (time, rate taken, pressure) per tick."""
        now, taken = start, self.speed if taken is None else taken
        while now < start + seconds:
            pressure = taken / self.safe
            aimd.step(pressure, "cpu stall", taken, now, TICK_SECONDS)
            now += TICK_SECONDS
            taken = self.speed if aimd.rate is None else min(aimd.rate, self.speed)
            yield now, taken, pressure


def test_a_healthy_source_is_read_ever_faster_from_a_slow_start_to_unlimited():
    source, aimd = Source(safe=100_000 * MB), Aimd(floor=4 * MB)
    assert aimd.rate == 4 * START_MULTIPLE * MB  # not at full speed at once
    trace = list(source.run(aimd, 6))
    assert trace[2][1] == pytest.approx(2 * trace[0][1])  # doubling every half second
    assert aimd.rate is None  # far past what the readers take: unlimited
    assert aimd.cuts == 0
    assert aimd.limited_by is None


def test_a_source_under_pressure_is_held_near_its_limit():
    source, aimd = Source(safe=100 * MB), Aimd(floor=4 * MB)
    trace = list(source.run(aimd, 30))

    assert max(taken for _, taken, _ in trace) <= 2 * source.safe  # the slow start's overshoot
    steady = [taken for t, taken, _ in trace if t > 10]
    assert max(steady) <= 1.25 * source.safe  # each overshoot is cut at its next tick
    assert sum(steady) / len(steady) >= 0.6 * source.safe  # and the rate climbs back


def test_a_spike_is_answered_at_once_and_the_rate_recovers_after_it():
    source, aimd = Source(safe=100_000 * MB), Aimd(floor=4 * MB)
    list(source.run(aimd, 6))
    assert aimd.rate is None  # a healthy source: never limited

    source.safe = 50 * MB  # the application's peak begins
    trace = list(source.run(aimd, 10, start=6))
    assert trace[0][1] < source.speed  # cut at the first tick above the target
    assert next(t for t, taken, _ in trace if taken <= 50 * MB) <= 6 + 6 * SETTLE_SECONDS
    low = aimd.rate

    source.safe = 62 * MB  # a little room: the rate creeps up...
    trace = list(source.run(aimd, 1, start=16, taken=low))
    assert 0 < trace[-1][1] - low <= RECOVERY_SHARE * aimd.peak * 1.01

    source.safe = 100_000 * MB  # ...and when the peak ends, it doubles back to unlimited
    list(source.run(aimd, 8, start=17))
    assert aimd.rate is None
    assert aimd.limited_by is None


def test_the_rate_never_goes_below_the_floor_nor_above_the_ceiling():
    aimd = Aimd(floor=20 * MB, ceiling=300 * MB)
    source = Source(safe=1 * MB)  # unbearable at any rate
    assert aimd.rate == 80 * MB  # the slow start's, under the ceiling
    rates = [taken for _, taken, _ in source.run(aimd, 20)]
    assert min(rates) == 20 * MB  # the backup still ends in its window
    source.safe = 10_000 * MB
    rates = [taken for _, taken, _ in source.run(aimd, 12, start=20)]
    assert max(rates) == 300 * MB
    assert aimd.rate == 300 * MB


def test_a_cut_is_as_deep_as_the_overshoot_and_the_next_waits_until_it_shows():
    aimd = Aimd(floor=MB, rate=100 * MB)
    aimd.step(1.05, "cpu stall", 100 * MB, 10.0, TICK_SECONDS)  # just past: mostly noise
    assert aimd.rate == pytest.approx(100 * MB * MILD_DECREASE)
    for tick in range(1, int(SETTLE_SECONDS / TICK_SECONDS)):  # the cut not shown yet
        aimd.step(1.05, "cpu stall", 80 * MB, 10.0 + tick * TICK_SECONDS, TICK_SECONDS)
    assert aimd.cuts == 1
    aimd.step(1.6, "cpu stall", 80 * MB, 10.0 + SETTLE_SECONDS, TICK_SECONDS)
    assert aimd.rate == pytest.approx(80 * MB / 1.6)  # the share that meets the target
    aimd.step(9.0, "cpu stall", 50 * MB, 10.0 + 2 * SETTLE_SECONDS, TICK_SECONDS)
    assert aimd.rate == pytest.approx(50 * MB * DECREASE)  # never more than half at once
    assert aimd.cuts == 3


def test_pressure_while_the_backup_reads_nothing_is_not_its_doing():
    aimd = Aimd(floor=MB)
    aimd.step(5.0, "io stall", 0.0, 0.0, TICK_SECONDS)
    assert aimd.rate == START_MULTIPLE * MB
    assert aimd.cuts == 0


def test_a_floor_above_the_ceiling_yields_to_the_ceiling():
    assert Aimd(floor=50 * MB, ceiling=10 * MB).floor == 10 * MB


PSI = (
    "some avg10=1.00 avg60={avg60} avg300=3.00 total={total}\n"
    "full avg10=0.00 avg60=0.00 avg300=0.00 total=7\n"
)


def test_a_stall_signal_is_the_share_of_the_tick_stalled_over_the_minute_before_plus_margin(
    tmp_path: Path,
):
    psi, now = tmp_path / "cpu", [100.0]
    psi.write_text(PSI.format(avg60="20.00", total=5_000_000))
    signal = StallSignal("cpu stall", psi, margin=0.10, clock=lambda: now[0])
    assert signal.target == pytest.approx(0.30)

    now[0] += 0.5
    psi.write_text(PSI.format(avg60="20.00", total=5_000_000 + 300_000))  # 0.3 s stalled of 0.5
    assert signal.sample() == pytest.approx(0.6 / 0.30)
    now[0] += 1.0
    assert signal.sample() == pytest.approx(0.0)  # nothing stalled since
    psi.unlink()
    assert signal.sample() is None  # PSI gone (or never there): no reading, no cut


def test_psi_files_are_the_servers_cgroups_when_it_has_one_else_the_hosts(tmp_path: Path):
    assert read_stall_total(tmp_path / "missing") is None
    proc = tmp_path / "proc"
    (proc / "42").mkdir(parents=True)
    (proc / "42" / "cgroup").write_text("0::/\n")
    assert pressure_files(42, proc) == {"cpu": proc / "pressure/cpu", "io": proc / "pressure/io"}
    assert throttle.cgroup_of(42, proc) is None
    (proc / "42" / "cgroup").write_text("0::/system.slice/postgresql@15-main.service\n")
    assert throttle.cgroup_of(42, proc) == "/system.slice/postgresql@15-main.service"
    assert pressure_files(None, proc)["io"] == proc / "pressure/io"


class SlowProbe:
    def __init__(self, seconds: float, others: bool = True) -> None:
        self.seconds, self.others, self.closed = seconds, others, False

    def ask(self) -> bool:
        time.sleep(self.seconds)
        return self.others

    def close(self) -> None:
        self.closed = True


def test_a_latency_signal_compares_answers_with_those_before_the_backup():
    probe = SlowProbe(0.004)
    signal = LatencySignal("s1 latency", probe, ratio=1.25, slack=0.001)
    try:
        assert 0.004 * 1.25 <= signal.target < 0.02
        time.sleep(0.2)
        assert signal.sample() == pytest.approx(0.004 / signal.target, rel=0.5)
        probe.seconds = 0.02  # the server slows down
        time.sleep(0.3)
        assert signal.sample() > 1.0
        probe.others = False  # nobody else is connected: no reason to slow the backup
        time.sleep(0.2)
        assert signal.sample() is None
    finally:
        signal.close()
    assert probe.closed


class Fixed:
    def __init__(self, name: str, pressure: float | None) -> None:
        self.name, self.pressure, self.closed = name, pressure, False

    def sample(self) -> float | None:
        return self.pressure

    def rebase(self, pressure: float) -> float:
        return 1.0  # stays high: a source that the floor never relieves

    def close(self) -> None:
        self.closed = True


def test_the_limiter_holds_readers_back_while_a_signal_is_high_and_reports_it():
    signals = [Fixed("cpu stall", 0.2), Fixed("s1 latency", 3.0)]
    limiter = AdaptiveLimiter(floor=2 * MB, ceiling=None, make_signals=lambda: signals)
    try:
        started, taken = time.monotonic(), 0
        while time.monotonic() - started < 2.0:  # a reader of at most 200 MB/s
            limiter.take(MB)
            taken += MB
            time.sleep(0.005)
        report = limiter.snapshot()
        assert report["limited_by"] == "s1 latency"
        assert report["cuts"] >= 1  # one cut in 2 s: the next waits until it shows
        assert report["pressures"] == {"cpu stall": 0.2, "s1 latency": 3.0}
        start = 2 * MB * START_MULTIPLE
        assert 2 * MB <= limiter.rate <= start / 2  # cut from its start, never below the floor
        assert taken <= 2.0 * start + MB  # held under its start rate, never let go faster
        assert report["throttled_seconds"] > 0
        assert report["lowest_rate_bytes_per_second"] == limiter.rate
    finally:
        limiter.close()
    assert all(s.closed for s in signals)
    assert limiter.thread is None


def test_the_limiter_makes_its_signals_before_any_read_and_is_paced():
    """The latency baseline is taken when the limiter is made (at the checkpoint), before the
    reads it guards; and a scan under it reads its ranges a MiB at a time (``paced``)."""
    made: list[float] = []
    limiter = AdaptiveLimiter(
        floor=2 * MB, ceiling=None, make_signals=lambda: made.append(time.monotonic()) or []
    )
    try:
        assert len(made) == 1  # no read yet
        assert limiter.thread is not None
        assert limiter.paced()
    finally:
        limiter.close()


def test_pressure_the_floor_cannot_relieve_becomes_the_sources_own_level(tmp_path: Path):
    """At the floor for REBASE_SECONDS and still over its target: the stall is not the
    backup's; its present level plus the margin becomes the target, and the rate may grow."""
    psi, now = tmp_path / "cpu", [0.0]
    psi.write_text(PSI.format(avg60="30.00", total=0))
    stall = StallSignal("cpu stall", psi, margin=0.10, clock=lambda: now[0])
    limiter = AdaptiveLimiter(floor=2 * MB, ceiling=None, make_signals=list)
    limiter.close()  # driven by hand below
    limiter.aimd.rate = limiter.aimd.floor
    limiter.smoothed["cpu stall"] = 1.25  # 0.5 stalled against 0.4
    for at in (0.0, REBASE_SECONDS / 2):
        limiter._rebase_at_floor([stall], {"cpu stall": 1.25}, at)
        assert stall.target == pytest.approx(0.40)  # not yet
    limiter._rebase_at_floor([stall], {"cpu stall": 1.25}, REBASE_SECONDS)
    assert stall.target == pytest.approx(0.60)  # 0.5, its level now, plus the margin
    assert limiter.smoothed["cpu stall"] == pytest.approx(0.5 / 0.6)  # room to grow
    assert limiter.snapshot()["rebases"] == 1
    limiter.aimd.rate = 3 * MB  # above the floor: no rebase, however high
    limiter._rebase_at_floor([stall], {"cpu stall": 2.0}, 2 * REBASE_SECONDS)
    limiter._rebase_at_floor([stall], {"cpu stall": 2.0}, 4 * REBASE_SECONDS)
    assert stall.target == pytest.approx(0.60)
