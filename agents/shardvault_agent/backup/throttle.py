"""Adaptive throttling: a backup reads as fast as the source's health allows, and no slower
than it must to finish in time.

Terms:
- *signal*: one measure of the source's health, sampled every *tick* (``TICK_SECONDS``) as its
  *pressure*: the measure over its target (1.0: at the target). Two kinds:
  - *stall* (``StallSignal``): the share of the tick in which some task waited for the CPU
    or for IO, from Linux pressure stall information (PSI: ``cpu.pressure`` and
    ``io.pressure`` of the database server's cgroup where cgroup v2 has one for it, else
    ``/proc/pressure/cpu`` and ``io``, the whole host's). Its target is the stall share the
    source had over the minute before the backup (the kernel's ``avg60``) plus
    ``stall_margin``: the backup may add that much waiting, no more;
  - *latency* (``LatencySignal``): how long the engine takes to answer a cheap query on a
    session of its own (the adapter's ``health_probe``: PostgreSQL reads ``pg_stat_activity``),
    against the median of ``BASELINE_PROBES`` answers taken before the backup reads
    (target: that times ``latency_ratio``, and at least ``latency_slack`` more).
- *rate*: the bytes per second the backup's readers may take (``RateLimiter``); None while
  nothing limits them.
- *controller* (``Aimd``): additive increase, multiplicative decrease, as TCP and
  CockroachDB's elastic admission control steer, on each signal's pressure averaged over
  about ``SMOOTHING_SECONDS`` (a tick's stall share is noisy). It starts at ``START_MULTIPLE``
  times the floor (a loaded source is not hit at full speed first) and doubles every half
  second while there is room (*slow start*, as TCP's). While the highest pressure is above 1
  the rate is *cut* (from what the readers actually took) by the target over the pressure,
  a fifth at least and half at most (``cut_factor``), at most once per ``SETTLE_SECONDS``:
  a cut takes about two smoothing periods to show, and cutting again sooner cut one
  overshoot three or four times, down to the floor. After a cut, below ``RECOVER_BELOW`` it
  grows by ``RECOVERY_SHARE`` of the *peak* (the most the readers took before a cut) per
  second, and below ``FAST_BELOW`` (the load went away) it doubles again; well past what the
  readers take it is unlimited. It never goes below the *floor* or above the *ceiling*.
- *rebase*: pressure that stays above 1 for ``REBASE_SECONDS`` while the backup reads at its
  floor is not the backup's doing (it reads as little as it may): the source got busier, or
  its own checkpoint (which the backup asked for) makes every first write of a page log the
  whole page for a while. Each signal then takes its present level as the source's own and
  sets its target from it again, so the rate may grow back while the source stays within a
  margin of where it is now; ``rebases`` in the report counts them.
- *idle source*: where the engine has a probe and no other client is connected, no signal
  counts: an unused database is not slowed for its own sake (the agent's own reads stall the
  host, not a client).
- *floor*: the larger of the configured floor and the rate that reads the shard's data once
  within the backup's window, so a throttled backup still ends in time.
- *ceiling*: the static cap (the policy's and the agent's ``rate_limit``), if any.
- *report* (``ThrottleReport``): the current rate, the signal that last cut it, how often
  and how long the backup ran throttled; pack answers carry it to the catalog, where
  ``backup --wait`` and ``show`` read it.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from shardvault.contracts.models import ThrottleReport as Reported
from shardvault_agent.ratelimit import RateLimiter

log = logging.getLogger("shardvault.agent")

TICK_SECONDS = 0.25
SMOOTHING_SECONDS = 1.0  # a signal's pressure is averaged (EWMA) over about this long
SETTLE_SECONDS = 2 * SMOOTHING_SECONDS  # a cut shows in the smoothed pressure by then
DECREASE = 0.5  # the deepest cut: at twice the target or more, the rate halves
MILD_DECREASE = 0.8  # the shallowest: just above the target, a fifth off
RECOVERY_SHARE = 0.1  # of the peak, per second, after a cut
RECOVER_BELOW = 0.9  # pressure under which the rate grows (between this and 1: it holds)
FAST_BELOW = 0.5  # pressure under which it doubles (per FAST_GROWTH) rather than adds
FAST_GROWTH = 4.0  # per second: doubling every half second
START_MULTIPLE = 4  # the rate at the start: the floor times this, then growing
REBASE_SECONDS = 3.0  # pressure above 1 this long at the floor: the source's own level
IDLE_STOP_SECONDS = 30.0  # a controller with no reads this long stops (a read restarts it)
BASELINE_PROBES = 5
PROBE_INTERVAL = 0.05


# --- signals ------------------------------------------------------------------------------------
class Signal(Protocol):
    name: str

    def sample(self) -> float | None:
        """The pressure since the last sample (None: no reading now, or not applicable)."""

    def rebase(self, pressure: float) -> float:
        """Takes the level that gave ``pressure`` as the source's own (see *rebase*); returns
        the factor by which pressures shrink."""

    def close(self) -> None: ...


def read_stall_total(path: Path) -> tuple[float, float] | None:
    """A PSI file's ``some`` line: (``avg60`` as a share of time, ``total`` in microseconds);
    None when the file is missing or unreadable (no PSI: kernels before 4.20, or disabled)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("some "):
            fields = dict(item.split("=", 1) for item in line.split()[1:])
            return float(fields["avg60"]) / 100, float(fields["total"])
    return None


class StallSignal:
    """The share of each tick in which some task of the group waited for what its PSI file
    measures (the CPU, or IO)."""

    def __init__(self, name: str, path: Path, margin: float, clock: Callable[[], float]) -> None:
        self.name, self.path, self.clock, self.margin = name, path, clock, margin
        first = read_stall_total(path)
        self.target = (first[0] if first else 0.0) + margin
        self.last = (clock(), first[1]) if first else None

    def sample(self) -> float | None:
        now, reading = self.clock(), read_stall_total(self.path)
        if reading is None:
            return None
        last, self.last = self.last, (now, reading[1])
        if last is None or now <= last[0]:
            return None
        stalled = (reading[1] - last[1]) / 1e6 / (now - last[0])
        return stalled / self.target if self.target > 0 else None

    def rebase(self, pressure: float) -> float:
        before, self.target = self.target, pressure * self.target + self.margin
        return before / self.target

    def close(self) -> None:
        pass


def pressure_files(server_pid: int | None, proc: Path = Path("/proc")) -> dict[str, Path]:
    """The PSI files that describe the database server: its cgroup's (cgroup v2) when it has
    one of its own, else the host's."""
    found = {r: proc / "pressure" / r for r in ("cpu", "io")}
    group = cgroup_of(server_pid, proc) if server_pid else None
    if group is None:
        return found
    for mount in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        own = {r: mount / group.lstrip("/") / f"{r}.pressure" for r in found}
        if all(p.exists() for p in own.values()):
            return own
    return found


def cgroup_of(pid: int, proc: Path = Path("/proc")) -> str | None:
    """The cgroup v2 path of a process (None: none but the root, or not readable)."""
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            group = line[3:].strip()
            return group if group not in ("", "/") else None
    return None


class HealthProbe(Protocol):
    """An engine's cheap question to its server (the adapter's ``health_probe``)."""

    def ask(self) -> bool:
        """Asks once; True when other clients are connected (the answer's time is measured
        around this call)."""

    def close(self) -> None: ...


class LatencySignal:
    """A probe's answer time against its baseline. A thread asks every ``PROBE_INTERVAL``;
    a sample is the mean of the answers since the last one, over the target."""

    def __init__(
        self,
        name: str,
        probe: HealthProbe,
        ratio: float,
        slack: float,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.name, self.probe, self.clock = name, probe, clock
        baseline = statistics.median(self._timed()[0] for _ in range(BASELINE_PROBES))
        self.ratio, self.slack = ratio, slack
        self.target = max(baseline * ratio, baseline + slack)
        self.answers: list[float] = []
        self.others = False
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._ask, name=f"probe-{name}", daemon=True)
        self.thread.start()

    def _timed(self) -> tuple[float, bool]:
        start = self.clock()
        others = self.probe.ask()
        return self.clock() - start, others

    def _ask(self) -> None:
        complained = False
        while not self.stopping.wait(PROBE_INTERVAL):
            try:
                took, others = self._timed()
            except Exception as error:  # a probe that fails says nothing; the backup goes on
                if not complained:
                    log.warning("throttle probe %s failed (said once): %s", self.name, error)
                    complained = True
                continue
            with self.lock:
                self.answers.append(took)
                self.others = others

    def sample(self) -> float | None:
        with self.lock:
            answers, self.answers = self.answers, []
            others = self.others
        if not answers or not others:
            return None
        return statistics.fmean(answers) / self.target

    def rebase(self, pressure: float) -> float:
        level = pressure * self.target
        before, self.target = self.target, max(level * self.ratio, level + self.slack)
        return before / self.target

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)
        self.probe.close()


# --- the controller -----------------------------------------------------------------------------
@dataclass
class Aimd:
    """The rate, steered by pressure (see the module docstring). Pure: time comes in."""

    floor: float
    ceiling: float | None = None
    rate: float | None = None  # None: unlimited (below the ceiling, if any)
    limited_by: str | None = None
    peak: float = 0.0
    fastest: float = 0.0  # the most the readers took in a tick
    last_cut: float = float("-inf")
    cuts: int = 0

    def __post_init__(self) -> None:
        if self.ceiling is not None:
            self.floor = min(self.floor, self.ceiling)
        if self.rate is None:  # slow start: a loaded source is not hit at full speed first
            self.rate = self.floor * START_MULTIPLE
        if self.ceiling is not None:
            self.rate = min(self.rate, self.ceiling)

    def step(
        self, pressure: float, name: str | None, taken_rate: float, now: float, dt: float
    ) -> None:
        """One tick: ``pressure`` the highest signal's (``name``), ``taken_rate`` what the
        readers took per second over the tick."""
        self.fastest = max(self.fastest, taken_rate)
        if pressure > 1.0:
            if now - self.last_cut < SETTLE_SECONDS or taken_rate <= 0:
                return  # a cut shows its effect first; a backup not reading is not the cause
            current = taken_rate if self.rate is None else min(self.rate, taken_rate)
            self.peak = max(self.peak, current, self.floor)
            self.rate = max(self.floor, current * cut_factor(pressure))
            self.limited_by, self.last_cut, self.cuts = name, now, self.cuts + 1
        elif self.rate is not None and self.rate != self.ceiling:
            if pressure < FAST_BELOW or (pressure < RECOVER_BELOW and not self.cuts):
                self.rate *= FAST_GROWTH**dt  # room to spare, or no cut yet: doubling
            elif pressure < RECOVER_BELOW:
                self.rate += self.peak * RECOVERY_SHARE * dt
            else:
                return  # near the target: hold
            if self.ceiling is not None and self.rate >= self.ceiling:
                self.rate, self.limited_by = self.ceiling, None
            elif self.ceiling is None and self.rate >= 4 * max(self.fastest, self.floor):
                self.rate, self.limited_by = None, None  # far past what it takes: unlimited
            elif pressure < FAST_BELOW:
                self.limited_by = None  # growing freely: nothing holds it back now

    @property
    def throttled(self) -> bool:
        return self.limited_by is not None


def cut_factor(pressure: float) -> float:
    """What a cut keeps of the rate: the target over the pressure (the share that brings a
    pressure proportional to the rate back to its target), between ``DECREASE`` and
    ``MILD_DECREASE``. Pressure just past the target is mostly the signal's noise, and
    halving at each such tick left the backup at its floor most of its time."""
    return min(MILD_DECREASE, max(DECREASE, 1.0 / pressure))


@dataclass
class ThrottleReport:
    rate_bytes_per_second: float | None = None
    limited_by: str | None = None
    cuts: int = 0
    throttled_seconds: float = 0.0
    lowest_rate_bytes_per_second: float | None = None
    floor_bytes_per_second: float = 0.0
    rebases: int = 0
    pressures: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The report as a pack's answer carries it: the control plane's ``ThrottleReport``,
        rounded."""
        return Reported(
            rate_bytes_per_second=_whole(self.rate_bytes_per_second),
            limited_by=self.limited_by,
            cuts=self.cuts,
            throttled_seconds=round(self.throttled_seconds, 1),
            lowest_rate_bytes_per_second=_whole(self.lowest_rate_bytes_per_second),
            floor_bytes_per_second=round(self.floor_bytes_per_second),
            rebases=self.rebases,
            pressures={k: round(v, 2) for k, v in self.pressures.items()},
        ).model_dump(mode="json")


def _whole(value: float | None) -> int | None:
    return None if value is None else round(value)


# --- the limiter ----------------------------------------------------------------------------------
class AdaptiveLimiter(RateLimiter):
    """A backup's rate limiter whose rate a controller thread steers. Its first signals are
    made when it is made (so the latency baseline comes before the reads it guards); the
    thread closes them when it stops: at ``close`` (release), or after ``IDLE_STOP_SECONDS``
    without reads, and a later read starts it again with new ones (a new baseline). A
    controller that fails leaves the backup reading at its ceiling, unsteered, and is not
    started again."""

    def __init__(
        self,
        floor: float,
        ceiling: float | None,
        make_signals: Callable[[], Iterable[Signal]],
        clock: Callable[[], float] = time.monotonic,
        guard: Callable[[], None] | None = None,
        parent: RateLimiter | None = None,
    ) -> None:
        aimd = Aimd(floor=floor, ceiling=ceiling)
        rate = None if aimd.rate is None else round(aimd.rate)
        super().__init__(rate, guard=guard, parent=parent)
        self.aimd = aimd
        self.make_signals, self.clock = make_signals, clock
        self.report = ThrottleReport(floor_bytes_per_second=self.aimd.floor)
        self.smoothed: dict[str, float] = {}
        self.pressed_at_floor_since: float | None = None
        self.taken = 0
        self.last_take = clock()
        self.thread: threading.Thread | None = None
        self.stopping = threading.Event()
        self.failed = False
        self.state_lock = threading.Lock()
        signals = self._make_signals()
        with self.state_lock:
            self._start(signals)

    def paced(self) -> bool:
        return True  # its controller may set a rate at any read

    def take(self, n: int) -> None:
        with self.state_lock:
            self.taken += n
            self.last_take = self.clock()
            self._start(None)
        super().take(n)

    def _start(self, signals: list[Signal] | None) -> None:
        if self.thread is None and not self.stopping.is_set() and not self.failed:
            self.thread = threading.Thread(
                target=self._run, args=(signals,), name="throttle", daemon=True
            )
            self.thread.start()

    def snapshot(self) -> dict[str, Any]:
        with self.state_lock:
            return self.report.as_dict()

    def close(self) -> None:
        self.stopping.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=10)

    def _make_signals(self) -> list[Signal] | None:
        """The signals, or None when they cannot be made (the controller then fails)."""
        try:
            return list(self.make_signals())
        except Exception:
            log.exception("adaptive throttle: no signals")
            return None

    def _run(self, signals: list[Signal] | None) -> None:
        if signals is None:
            signals = self._make_signals()
        try:
            if signals is None:
                raise RuntimeError("no signals")
            self._steer(signals)
        except Exception:  # the throttle must never fail a backup: it reads on, unsteered
            log.exception("adaptive throttle stopped: reading unsteered")
            self.failed = True
            self.set_rate(self.aimd.ceiling)
        finally:
            for signal in signals or []:
                signal.close()
            with self.state_lock:
                self.thread = None

    def _steer(self, signals: list[Signal]) -> None:
        last, taken_before = self.clock(), self.taken
        while not self.stopping.wait(TICK_SECONDS):
            now = self.clock()
            dt = max(now - last, 1e-6)
            pressures = self._smoothed(signals, dt)
            name = max(pressures, key=pressures.__getitem__) if pressures else None
            with self.state_lock:
                taken_rate = (self.taken - taken_before) / dt
                taken_before, idle = self.taken, now - self.last_take
            cuts = self.aimd.cuts
            self.aimd.step(pressures.get(name, 0.0) if name else 0.0, name, taken_rate, now, dt)
            self._rebase_at_floor(signals, pressures, now)
            self.set_rate(self.aimd.rate)
            if self.aimd.cuts > cuts:
                log.info(
                    "throttle: %s at %.2f of its target: reading at %.1f MiB/s (floor %.1f)",
                    name, pressures[name], (self.aimd.rate or 0) / 2**20, self.aimd.floor / 2**20,
                )  # fmt: skip
            self._record(pressures, dt)
            last = now
            if idle > IDLE_STOP_SECONDS:
                return

    def _rebase_at_floor(
        self, signals: list[Signal], pressures: dict[str, float], now: float
    ) -> None:
        """See *rebase*: the pressures the floor cannot relieve become the new baselines."""
        at_floor = self.aimd.rate is not None and self.aimd.rate <= self.aimd.floor
        if not at_floor or max(pressures.values(), default=0.0) <= 1.0:
            self.pressed_at_floor_since = None
            return
        if self.pressed_at_floor_since is None:
            self.pressed_at_floor_since = now
        if now - self.pressed_at_floor_since < REBASE_SECONDS:
            return
        for signal in signals:
            if (pressure := pressures.get(signal.name, 0.0)) > 1.0:
                self.smoothed[signal.name] *= signal.rebase(pressure)
                log.info("throttle: %s rebased at %.2f of its old target", signal.name, pressure)
        with self.state_lock:
            self.report.rebases += 1
        self.pressed_at_floor_since = None

    def _smoothed(self, signals: list[Signal], dt: float) -> dict[str, float]:
        """Each signal's pressure averaged (EWMA); none while the source has no other client."""
        raw = {s.name: p for s in signals if (p := s.sample()) is not None}
        probes = [s for s in signals if isinstance(s, LatencySignal)]
        if probes and not any(p.others for p in probes):
            self.smoothed.clear()
            return {}
        weight = min(1.0, dt / SMOOTHING_SECONDS)
        for name, value in raw.items():
            before = self.smoothed.get(name, value)
            self.smoothed[name] = before + weight * (value - before)
        return {name: self.smoothed[name] for name in raw}

    def _record(self, pressures: dict[str, float], dt: float) -> None:
        with self.state_lock:
            report, aimd = self.report, self.aimd
            report.rate_bytes_per_second = aimd.rate
            report.limited_by, report.cuts, report.pressures = aimd.limited_by, aimd.cuts, pressures
            if aimd.throttled:
                report.throttled_seconds += dt
                lowest = report.lowest_rate_bytes_per_second
                if aimd.rate is not None and (lowest is None or aimd.rate < lowest):
                    report.lowest_rate_bytes_per_second = aimd.rate
