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
    (target: that times ``latency_ratio``, and at least ``latency_slack`` more). It counts only
    while other clients are connected: an unused database is not slowed for its own sake.
- *rate*: the bytes per second the backup's readers may take (``RateLimiter``); None while
  nothing limits them.
- *controller* (``Aimd``): additive increase, multiplicative decrease, as TCP and
  CockroachDB's elastic admission control steer: while the highest pressure is above 1 the
  rate halves (from what the readers actually took, at most once per ``SETTLE_SECONDS`` so a
  cut shows its effect before the next); while it is below ``RECOVER_BELOW`` the rate grows
  by ``RECOVERY_SHARE`` of the *peak* (the most the readers took before a cut) per second:
  back off at once, recover over about ten seconds, and read unlimited again once the peak is
  reached. It never goes below the *floor* or above the *ceiling*.
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

from shardvault_agent.ratelimit import RateLimiter

log = logging.getLogger("shardvault.agent")

TICK_SECONDS = 0.25
SETTLE_SECONDS = 0.5
DECREASE = 0.5
RECOVERY_SHARE = 0.1  # of the rate before the last cut, per second
RECOVER_BELOW = 0.9  # pressure under which the rate grows (between this and 1: it holds)
IDLE_STOP_SECONDS = 30.0  # a controller with no reads this long stops (a read restarts it)
DEFAULT_THROTTLE_WINDOW_SECONDS = 6 * 3600  # a policy always sends its own window
BASELINE_PROBES = 5
PROBE_INTERVAL = 0.05


# --- signals ------------------------------------------------------------------------------------
class Signal(Protocol):
    name: str

    def sample(self) -> float | None:
        """The pressure since the last sample (None: no reading now, or not applicable)."""

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
    """The share of each tick in which some task of the group waited for ``resource``."""

    def __init__(self, name: str, path: Path, margin: float, clock: Callable[[], float]) -> None:
        self.name, self.path, self.clock = name, path, clock
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
        while not self.stopping.wait(PROBE_INTERVAL):
            try:
                took, others = self._timed()
            except Exception as error:  # a probe that fails says nothing; the backup goes on
                log.warning("throttle probe %s failed: %s", self.name, error)
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
    last_cut: float = float("-inf")
    cuts: int = 0

    def __post_init__(self) -> None:
        if self.ceiling is not None:
            self.floor = min(self.floor, self.ceiling)
            self.rate = self.ceiling if self.rate is None else self.rate

    def step(
        self, pressure: float, name: str | None, taken_rate: float, now: float, dt: float
    ) -> None:
        """One tick: ``pressure`` the highest signal's (``name``), ``taken_rate`` what the
        readers took per second over the tick."""
        if pressure > 1.0:
            if now - self.last_cut < SETTLE_SECONDS or taken_rate <= 0:
                return  # a cut shows its effect first; a backup not reading is not the cause
            current = taken_rate if self.rate is None else min(self.rate, taken_rate)
            self.peak = max(self.peak, current, self.floor)
            self.rate = max(self.floor, current * DECREASE)
            self.limited_by, self.last_cut, self.cuts = name, now, self.cuts + 1
        elif pressure < RECOVER_BELOW and self.rate is not None and self.rate != self.ceiling:
            self.rate += self.peak * RECOVERY_SHARE * dt
            if self.ceiling is not None and self.rate >= self.ceiling:
                self.rate, self.limited_by = self.ceiling, None
            elif self.ceiling is None and self.rate >= self.peak:
                self.rate, self.limited_by = None, None  # what it took before: unlimited

    @property
    def throttled(self) -> bool:
        return self.limited_by is not None


@dataclass
class ThrottleReport:
    rate_bytes_per_second: float | None = None
    limited_by: str | None = None
    cuts: int = 0
    throttled_seconds: float = 0.0
    lowest_rate_bytes_per_second: float | None = None
    floor_bytes_per_second: float = 0.0
    pressures: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        rounded = {k: round(v, 2) for k, v in self.pressures.items()}
        return {
            "mode": "adaptive",
            "rate_bytes_per_second": _whole(self.rate_bytes_per_second),
            "limited_by": self.limited_by,
            "cuts": self.cuts,
            "throttled_seconds": round(self.throttled_seconds, 1),
            "lowest_rate_bytes_per_second": _whole(self.lowest_rate_bytes_per_second),
            "floor_bytes_per_second": round(self.floor_bytes_per_second),
            "pressures": rounded,
        }


def _whole(value: float | None) -> int | None:
    return None if value is None else round(value)


# --- the limiter ----------------------------------------------------------------------------------
class AdaptiveLimiter(RateLimiter):
    """A backup's rate limiter whose rate a controller thread steers. Signals are made when
    the thread starts (the latency baseline is taken before the reads it guards) and closed
    when it stops: at ``close`` (release), or after ``IDLE_STOP_SECONDS`` without reads."""

    def __init__(
        self,
        floor: float,
        ceiling: float | None,
        make_signals: Callable[[], Iterable[Signal]],
        clock: Callable[[], float] = time.monotonic,
        guard: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(None if ceiling is None else round(ceiling), guard=guard)
        self.aimd = Aimd(floor=floor, ceiling=ceiling)
        self.make_signals, self.clock = make_signals, clock
        self.report = ThrottleReport(floor_bytes_per_second=self.aimd.floor)
        self.taken = 0
        self.last_take = clock()
        self.thread: threading.Thread | None = None
        self.stopping = threading.Event()
        self.state_lock = threading.Lock()
        with self.state_lock:
            self._start()  # now: the latency baseline comes before the reads

    def take(self, n: int) -> None:
        with self.state_lock:
            self.taken += n
            self.last_take = self.clock()
            self._start()
        super().take(n)

    def _start(self) -> None:
        if self.thread is None and not self.stopping.is_set():
            self.thread = threading.Thread(target=self._run, name="throttle", daemon=True)
            self.thread.start()

    def snapshot(self) -> dict[str, Any]:
        with self.state_lock:
            return self.report.as_dict()

    def close(self) -> None:
        self.stopping.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=10)

    def _run(self) -> None:
        signals: list[Signal] = []
        try:
            signals = list(self.make_signals())
            self._steer(signals)
        except Exception:  # the throttle must never fail a backup: it reads on, unsteered
            log.exception("adaptive throttle stopped")
        finally:
            for signal in signals:
                signal.close()
            with self.state_lock:
                self.thread = None

    def _steer(self, signals: list[Signal]) -> None:
        last, taken_before = self.clock(), self.taken
        while not self.stopping.wait(TICK_SECONDS):
            now = self.clock()
            dt = max(now - last, 1e-6)
            pressures = {s.name: p for s in signals if (p := s.sample()) is not None}
            name = max(pressures, key=pressures.__getitem__) if pressures else None
            with self.state_lock:
                taken_rate = (self.taken - taken_before) / dt
                taken_before, idle = self.taken, now - self.last_take
            cuts = self.aimd.cuts
            self.aimd.step(pressures.get(name, 0.0) if name else 0.0, name, taken_rate, now, dt)
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
