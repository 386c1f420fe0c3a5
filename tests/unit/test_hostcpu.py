"""The cores other processes keep busy, as the agent measures them for its packs: the host's
CPU over a window, less the agent's own, scaled to the cores the agent may use."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from shardvault_agent.backup.hostcpu import WINDOW_SECONDS, OthersCores, read_host_ticks


class Fake:
    def __init__(self) -> None:
        self.now, self.ticks, self.own = 0.0, (1000, 500), 0.0


def others(fake: Fake, host_cores: int = 4, cores: int = 2) -> OthersCores:
    return OthersCores(
        read_ticks=lambda: fake.ticks,
        own_seconds=lambda: fake.own,
        clock=lambda: fake.now,
        host_cores=host_cores,
        cores=cores,
    )


def test_the_others_cores_are_the_hosts_busy_ones_less_the_agents_own_over_a_window():
    fake = Fake()
    measure = others(fake)
    fake.now = WINDOW_SECONDS / 2
    assert measure() is None  # no window has passed yet
    # One second: 400 ticks over the host's 4 cores, 100 of them idle: 3 cores busy, one of
    # them the agent's own; the other 2, spread over 4 cores, hold 1 of the agent's 2.
    fake.now, fake.ticks, fake.own = 1.0, (1400, 600), 1.0
    assert measure() == pytest.approx(1.0)
    fake.now, fake.ticks = 1.1, (1500, 600)
    assert measure() == pytest.approx(1.0)  # within the next window: the last one's answer
    # The next second all idle: nobody else is busy.
    fake.now, fake.ticks, fake.own = 2.0, (1800, 1000), 1.0
    assert measure() == 0.0


def test_a_host_whose_cpu_cannot_be_read_is_not_known(tmp_path: Path):
    assert read_host_ticks(tmp_path / "absent") is None
    (tmp_path / "stat").write_text("intr 1 2 3\n")
    assert read_host_ticks(tmp_path / "stat") is None
    fake = Fake()
    fake.ticks = None  # type: ignore[assignment]
    measure = others(fake)
    fake.now = 1.0
    assert measure() is None


def test_this_hosts_cpu_is_read():
    assert read_host_ticks() is not None
    measure = OthersCores()
    time.sleep(WINDOW_SECONDS + 0.1)
    value = measure()
    assert value is not None
    assert 0.0 <= value <= measure.cores
