"""The inbox doorbell: an agent reads its whole inbox only when a command was posted since its
last read (and every few seconds anyway), not on every poll. A command stays in the inbox while
it runs, so reading the partition on every poll re-read every running command's arguments."""

from __future__ import annotations

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
