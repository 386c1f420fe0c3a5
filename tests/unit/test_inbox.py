"""The inbox doorbell: an agent reads its whole inbox only when a command was posted since its
last read (and every few seconds anyway), not on every poll. A command stays in the inbox while
it runs, so reading the partition on every poll re-read every running command's arguments."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from shardvault_agent import daemon

from shardvault.aws.tables import DOORBELL_KEY, Inbox

from .support import moto_services, sqlite_agent


@pytest.fixture
def inbox_table(monkeypatch) -> Any:
    with moto_services(monkeypatch) as services:
        yield services.inbox.table


def test_each_post_rings_and_the_doorbell_is_no_command(inbox_table) -> None:
    inbox = Inbox(inbox_table)
    assert inbox.rings("n1") == 0
    inbox.post("n1", "c1", "flush", {}, "token-1")
    inbox.post("n1", "c2", "flush", {}, "token-2")
    inbox.post("n2", "c3", "flush", {}, "token-3")
    assert (inbox.rings("n1"), inbox.rings("n2")) == (2, 1)
    assert [i["command_id"] for i in inbox.pending("n1")] == ["c1", "c2"]
    assert all(i["command_id"] != DOORBELL_KEY for i in inbox.pending("n2"))


class CountingInbox(Inbox):
    reads = 0

    def pending(self, node_id: str) -> list[dict[str, Any]]:
        self.reads += 1
        return super().pending(node_id)


def test_an_agent_reads_its_inbox_only_when_the_doorbell_rang(
    inbox_table, tmp_path: Path, monkeypatch
) -> None:
    agent = daemon.Agent(sqlite_agent(tmp_path), nodes_table="n", inbox_table="i")
    agent.inbox = inbox = CountingInbox(inbox_table)
    started: list[str] = []
    monkeypatch.setattr(agent.pool, "submit", lambda _fn, item: started.append(item["command_id"]))
    clock = [1000.0]
    monkeypatch.setattr(daemon.time, "monotonic", lambda: clock[0])

    agent.poll_once()  # the first poll reads: nothing heard yet
    assert inbox.reads == 1
    inbox.post("n1", "c1", "flush", {}, "token-1")
    agent.poll_once()  # rang: read, and the command starts
    agent.poll_once()  # silent (c1 still in the inbox, running): no read
    agent.poll_once()
    assert (inbox.reads, started) == (2, ["c1"])
    inbox.post("n1", "c2", "flush", {}, "token-2")
    agent.poll_once()
    assert (inbox.reads, started) == (3, ["c1", "c2"])  # c1 is running: not started again
    clock[0] += daemon.FULL_READ_SECONDS  # and now and then a read without a ring
    agent.poll_once()
    assert inbox.reads == 4


def test_a_cut_runs_at_once_while_transfers_fill_the_command_pool(
    inbox_table, tmp_path: Path, monkeypatch
) -> None:
    """A scheduled cut keeps its instant: it never queues behind a backup's transfers."""
    agent = daemon.Agent(sqlite_agent(tmp_path, max_parallel_commands=1), nodes_table="n",
                         inbox_table="i")  # fmt: skip
    busy, ran = threading.Event(), {}
    done = {name: threading.Event() for name in ("c-upload", "c-cut")}

    def execute(item: dict[str, Any]) -> None:
        ran[item["command_id"]] = threading.current_thread().name
        done[item["command_id"]].set()

    monkeypatch.setattr(agent, "execute", execute)
    agent.pool.submit(busy.wait, 30)  # a transfer holding the only command thread
    try:
        agent.inbox.post("n1", "c-upload", "upload", {}, "token-1")
        agent.inbox.post("n1", "c-cut", "cut", {}, "token-2")
        agent.poll_once()
        assert done["c-cut"].wait(5), "the cut waited for the transfers"
        assert list(ran) == ["c-cut"]
        assert ran["c-cut"].startswith("timed")
    finally:
        busy.set()
    assert done["c-upload"].wait(5)  # and the queued command runs once the pool frees
    assert ran["c-upload"].startswith("command")
