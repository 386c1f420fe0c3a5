"""The host's CPU as the agent sees it: how many of the agent's cores other processes (the
database first of all) kept busy lately.

Terms:
- *window*: the time between two samples, at least ``WINDOW_SECONDS``: a busy share is an
  average over it, never an instant's.
- *others' cores*: the cores the whole host kept busy over the last window (``/proc/stat``'s
  ``cpu`` line: its time not idle and not waiting for IO), less this process's own CPU time
  over it, scaled to the cores this process may run on (its affinity) on the assumption that
  the others spread evenly over the host's cores.

A pack borrows an idle core for its frames (``shardvault.data.pipeline.SpareCores``) only when its
own busy threads and the others' cores leave one: a core the database is using is not idle,
however few packs run. Where ``/proc/stat`` cannot be read (a sandbox that hides it), nothing
is known and the pack counts its own threads only. The first window after a quiet spell is
the whole spell: its average stands for half a second, until the next window.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

WINDOW_SECONDS = 0.5  # a frame takes 5 to 30 ms to encode: many frames see one window
PROC_STAT = Path("/proc/stat")


def read_host_ticks(path: Path = PROC_STAT) -> tuple[int, int] | None:
    """The host's CPU time since boot, in clock ticks over all cores: all of it, and the
    part that was idle or waiting for IO; None where it cannot be read."""
    try:
        with open(path, "rb") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if len(fields) < 6 or fields[0] != b"cpu":
        return None
    ticks = [int(value) for value in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return sum(ticks), ticks[3] + ticks[4]


class OthersCores:
    """Callable: the cores of this process's affinity that other processes kept busy over
    the last window (see the module docstring); None until a window has passed, or where
    the host's CPU cannot be read."""

    def __init__(
        self,
        read_ticks: Callable[[], tuple[int, int] | None] = read_host_ticks,
        own_seconds: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
        host_cores: int | None = None,
        cores: int | None = None,
    ) -> None:
        self.read_ticks, self.own_seconds, self.clock = read_ticks, own_seconds, clock
        self.host_cores = host_cores or os.cpu_count() or 1
        self.cores = cores or len(os.sched_getaffinity(0))
        self._lock = threading.Lock()
        self._last = self._sample()
        self._value: float | None = None

    def _sample(self) -> tuple[float, tuple[int, int] | None, float]:
        return self.clock(), self.read_ticks(), self.own_seconds()

    def __call__(self) -> float | None:
        with self._lock:
            at = self.clock()
            if at - self._last[0] < WINDOW_SECONDS:
                return self._value
            sample = self._sample()
            (then, before, own_before), (now, after, own_after) = self._last, sample
            self._last = sample
            if before is None or after is None or after[0] <= before[0] or now <= then:
                self._value = None
                return None
            total, idle = after[0] - before[0], after[1] - before[1]
            host_busy = (total - idle) / total * self.host_cores  # cores, on average
            own = (own_after - own_before) / (now - then)
            others = max(0.0, host_busy - own) * self.cores / self.host_cores
            self._value = others
            return others
