"""Idle agents cost almost nothing: an idle agent long-polls its doorbell queue with a pause
between two polls, reads its inbox on a ring and by a rare safety poll, and heartbeats
rarely, promising that period; a command is still picked up within the pause and half a
second of its dispatch, and a busy agent's at once.

The agents run for real (threads, moto's DynamoDB and SQS) with the idle periods shortened
(doorbell_wait_seconds, idle_inbox_poll_seconds, idle_heartbeat_seconds); calls are counted
as they reach the services."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.client import BaseClient
from botocore.exceptions import ClientError, EndpointConnectionError
from shardvault_agent import daemon
from shardvault_agent.config import AgentConfig

from shardvault.aws.services import Services
from shardvault.backup.admission import check_nodes_available
from shardvault.backup.failure import explain, post_releases
from shardvault.contracts.catalog import restore_key
from shardvault.contracts.models import (
    AGENT_PROTOCOL,
    BackupContext,
    NodeRecord,
    Source,
    doorbell_name,
)
from shardvault.errors import AgentUnavailable, BackupReleased, PartUploadFailed
from shardvault.restore import failure
from shardvault.workflow.dispatch import DispatchRequest, dispatch
from tests.unit.support import catalog_item

from .support import moto_services, sqlite_agent

PROMPTLY = 1.5
"""Seconds within which a command picked up "at once" starts, on a loaded CI machine (a ring
usually takes under 0.1 s; 0.8 s was seen under load). Each test makes every other way the
agent could find the command (a poll, a safety read) take longer than this, or starts the
clock just after such a read, so that only the path under test can meet the bound."""

FAST_IDLE = {
    "doorbell_wait_seconds": 1,
    "idle_inbox_poll_seconds": 2.0,
    "idle_listen_pause_seconds": 0,
}


@pytest.fixture
def svc(monkeypatch) -> Iterator[Services]:
    with moto_services(monkeypatch) as services:
        yield services


class Running:
    """An agent running in a thread, with every request it sends counted by operation."""

    def __init__(self, agent: daemon.Agent) -> None:
        self.agent = agent
        self.calls: Counter[str] = Counter()
        self.picked_up: dict[str, float] = {}  # command id -> monotonic time it was started
        clients = [agent.registry.table.meta.client, agent.inbox.table.meta.client, agent.sqs]
        for client in {
            id(c): c for c in clients if isinstance(c, BaseClient)
        }.values():  # each once
            client.meta.events.register("before-parameter-build", self._count)
        agent.pool.submit = self._start  # type: ignore[method-assign]
        self.thread = threading.Thread(target=agent.run, daemon=True)

    def _count(self, model: Any, params: dict[str, Any], **_: Any) -> None:
        table = params.get("TableName", "")
        self.calls[f"{model.name}:{table}" if table else model.name] += 1

    def _start(self, _fn: Callable, item: dict[str, Any]) -> None:
        """Takes the place of running the command: it is done at once (and leaves the inbox)."""
        self.picked_up.setdefault(item["command_id"], time.monotonic())
        self.agent.inbox.remove("n1", item["command_id"], item["dispatch_id"])
        with self.agent.lock:
            self.agent.running.pop(daemon.command_key(item), None)
            self.agent.answered[daemon.command_key(item)] = None

    def __enter__(self) -> Running:
        self.thread.start()
        wait_for(lambda: self.calls["Query:i"] >= 1)  # registered and read its inbox once
        return self

    def __exit__(self, *exc: object) -> None:
        self.agent.stop()
        self.thread.join(timeout=10)
        for thread in threading.enumerate():  # the listener ends within one long poll
            if thread.name == "doorbell":
                thread.join(timeout=5)


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> float:
    """Waits until ``condition()``; returns the seconds it took."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "timed out"
        time.sleep(0.01)
    return time.monotonic() - start


def agent_of(tmp_path: Path, **config: Any) -> daemon.Agent:
    """An agent of node n1; idle, it listens without a pause unless ``config`` gives one."""
    config = {"idle_listen_pause_seconds": 0, **config}
    return daemon.Agent(sqlite_agent(tmp_path, **config), nodes_table="n", inbox_table="i")


def just_after_a(operation: str, running: Running) -> None:
    """Returns as soon as the agent has sent ``operation`` again: a command posted now is not
    found by that periodic read until its next period."""
    seen = running.calls[operation]
    wait_for(lambda: running.calls[operation] > seen)


def post(svc: Services, command_id: str, sqs: Any) -> float:
    """Dispatches ``flush`` to node n1 as the state machine's dispatcher does; returns when."""
    request = DispatchRequest(
        task_token=f"t-{command_id}", node_id="n1", command="flush", backup_id=command_id
    )
    started = time.monotonic()
    dispatch(request, svc, time.time(), sqs)
    return started


def test_the_idle_cadences_default_to_a_few_requests_a_minute() -> None:
    fields = AgentConfig.model_fields
    assert fields["doorbell_wait_seconds"].default == 20  # with the pause: 2 polls a minute
    assert fields["idle_listen_pause_seconds"].default == 10.0
    assert fields["idle_inbox_poll_seconds"].default == 45.0  # below the 60 s task heartbeat
    assert fields["idle_heartbeat_seconds"].default == 300.0  # 1 heartbeat in 5 minutes


def test_a_lost_ring_is_found_before_a_workflow_gives_up_on_the_command() -> None:
    """A command whose ring was lost is found by the safety read (after at most a listen and
    its pause, or the read's period); the workflows fail a task that sends no heartbeat
    within HeartbeatSeconds, so the agent's idle defaults must stay below every one."""
    root = Path(__file__).resolve().parents[2] / "statemachines"

    def heartbeats(states: dict[str, Any]) -> Iterator[int]:
        for state in states.values():
            if "HeartbeatSeconds" in state:
                yield state["HeartbeatSeconds"]
            for nested in ("Iterator", "ItemProcessor"):
                if nested in state:
                    yield from heartbeats(state[nested]["States"])

    shortest = min(
        h
        for path in root.glob("*.asl.json")
        for h in heartbeats(json.loads(path.read_text())["States"])
    )
    fields = AgentConfig.model_fields
    pause = fields["idle_listen_pause_seconds"].default
    assert fields["idle_inbox_poll_seconds"].default + pause < shortest
    assert fields["doorbell_wait_seconds"].default + pause < shortest


def test_an_idle_agent_long_polls_and_reads_and_heartbeats_only_at_its_idle_periods(
    svc, tmp_path
) -> None:
    agent = agent_of(tmp_path, **FAST_IDLE, idle_heartbeat_seconds=4.0)
    with Running(agent) as running:
        running.calls.clear()
        time.sleep(8.5)
        calls = dict(running.calls)
    # In 8.5 s: one long poll a second, an inbox read every 2 s, a heartbeat every 4 s (the
    # old agent: 17 reads of its doorbell item, 2 of its inbox and 17 heartbeats).
    assert 7 <= calls.get("ReceiveMessage", 0) <= 10, calls
    assert 3 <= calls.get("Query:i", 0) <= 5, calls
    assert 1 <= calls.get("PutItem:n", 0) <= 3, calls
    assert "GetItem:i" not in calls, calls  # the inbox's ring count is not read while idle
    record = svc.nodes.get("n1")
    assert record.heartbeat_every == 4.0  # the period it promised
    assert (record.doorbell or "").endswith("/shardvault-doorbell-n1")


def test_a_ring_has_an_idle_agent_read_its_inbox_at_once_and_heartbeat(svc, tmp_path) -> None:
    sqs = boto3.client("sqs")
    agent = agent_of(tmp_path, doorbell_wait_seconds=2)  # the safety poll: 60 s
    with Running(agent) as running:
        time.sleep(1.0)
        before = svc.nodes.get("n1")
        assert before.heartbeat_every == agent.config.idle_heartbeat_seconds
        dispatched = post(svc, "b1", sqs)
        wait_for(lambda: "flush:b1" in running.picked_up, timeout=5)
        assert running.picked_up["flush:b1"] - dispatched < PROMPTLY  # the safety poll: 45 s
        # Woken, it says at once that it is busy (a backup may follow).
        wait_for(lambda: svc.nodes.get("n1").heartbeat_at > before.heartbeat_at, timeout=PROMPTLY)
        assert svc.nodes.get("n1").heartbeat_every == agent.config.heartbeat_interval_seconds
    queue = sqs.get_queue_url(QueueName="shardvault-doorbell-n1")["QueueUrl"]
    attributes = sqs.get_queue_attributes(QueueUrl=queue, AttributeNames=["All"])["Attributes"]
    assert attributes["SqsManagedSseEnabled"] == "true"
    assert attributes["MessageRetentionPeriod"] == "300"
    assert attributes["ApproximateNumberOfMessages"] == "0"  # the ring was deleted


def test_a_ring_to_a_busy_agent_waits_for_its_busy_heartbeat(svc, tmp_path) -> None:
    sqs = boto3.client("sqs")
    agent = agent_of(tmp_path, doorbell_wait_seconds=2, heartbeat_interval_seconds=30)
    with Running(agent) as running:
        time.sleep(1.0)
        post(svc, "b1", sqs)  # wakes it: it heartbeats at once, as busy
        wait_for(lambda: "flush:b1" in running.picked_up, timeout=5)
        wait_for(lambda: svc.nodes.get("n1").heartbeat_every == 30, timeout=PROMPTLY)
        busy = svc.nodes.get("n1").heartbeat_at
        post(svc, "b2", sqs)  # busy now: its next beat is its busy period's
        wait_for(lambda: "flush:b2" in running.picked_up, timeout=5)
        time.sleep(PROMPTLY)
        assert svc.nodes.get("n1").heartbeat_at == busy


def test_an_idle_agent_pauses_between_listens_and_a_ring_waits_for_the_next(svc, tmp_path) -> None:
    """The pause halves an idle agent's SQS requests (the bulk of its idle cost); a command
    rung during a pause waits in the queue and starts at the next listen, within the pause."""
    sqs = boto3.client("sqs")
    agent = agent_of(tmp_path, doorbell_wait_seconds=1, idle_listen_pause_seconds=1.0)
    with Running(agent) as running:
        running.calls.clear()
        time.sleep(6.2)
        listens = running.calls.get("ReceiveMessage", 0)
        dispatched = post(svc, "b1", sqs)
        wait_for(lambda: "flush:b1" in running.picked_up, timeout=5)
    assert 2 <= listens <= 4, running.calls  # one per 2 s (1 s wait, 1 s pause), not 6
    assert running.picked_up["flush:b1"] - dispatched < 1.0 + PROMPTLY


def test_a_busy_agent_with_a_doorbell_picks_up_rung_commands_at_once_and_polls_slowly(
    svc, tmp_path
) -> None:
    # Busy, the agent used to read its ring count every 50 ms (20 reads a second: half of a
    # restoring agent's CPU); with a doorbell the ring wakes it, and the poll is a safety net.
    sqs = boto3.client("sqs")
    agent = agent_of(tmp_path, doorbell_wait_seconds=1, busy_ring_poll_seconds=3.0)
    with Running(agent) as running:
        post(svc, "b1", sqs)
        wait_for(lambda: "flush:b1" in running.picked_up, timeout=5)
        assert agent.busy()
        running.calls.clear()
        time.sleep(6.0)
        polls = running.calls.get("GetItem:i", 0)
        just_after_a("GetItem:i", running)  # the poll would find b2 in 3 s
        dispatched = post(svc, "b2", sqs)
        wait_for(lambda: "flush:b2" in running.picked_up, timeout=5)
    assert 1 <= polls <= 3, running.calls  # every 3 s, not 120 times in 6 s
    assert running.picked_up["flush:b2"] - dispatched < PROMPTLY


class Unreachable:
    """An SQS client whose every call fails as when the endpoint cannot be reached."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def fail(**_: Any) -> Any:
            raise EndpointConnectionError(endpoint_url="https://sqs.example")

        return fail


def test_a_failed_ring_fails_no_dispatch_and_the_safety_poll_finds_the_command(
    svc, tmp_path, caplog
) -> None:
    agent = agent_of(tmp_path, **FAST_IDLE)
    with (
        Running(agent) as running,
        caplog.at_level(logging.WARNING, "shardvault.workflow.dispatch"),
    ):
        dispatched = post(svc, "b2", Unreachable())
        took = wait_for(lambda: "flush:b2" in running.picked_up, timeout=5)
    assert took < FAST_IDLE["idle_inbox_poll_seconds"] + PROMPTLY
    assert running.picked_up["flush:b2"] >= dispatched
    assert "doorbell of node n1 not rung for flush:b2" in caplog.text


def test_the_dispatcher_rings_with_the_command_id_only(svc, tmp_path) -> None:
    sqs = boto3.client("sqs")
    record = agent_of(tmp_path).record()
    queue = sqs.create_queue(QueueName="shardvault-doorbell-n1")["QueueUrl"]
    svc.nodes.put(record.model_copy(update={"doorbell": queue}))
    post(svc, "b3", sqs)
    (ring,) = sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10)["Messages"]
    assert json.loads(ring["Body"]) == {"ring": "flush:b3"}
    # A node whose record names no doorbell (an older agent, or one without a queue) is
    # not rung: its command waits in the inbox as before.
    svc.nodes.put(record.model_copy(update={"doorbell": None}))
    post(svc, "b4", sqs)
    assert "Messages" not in sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10)


def test_the_cleanups_ring_the_nodes_they_post_releases_and_aborts_to(svc, tmp_path) -> None:
    # A failed backup's releases and a reaped restore's aborts carry no task token; rung,
    # an idle agent runs them now instead of at its next safety poll (60 s).
    sqs = boto3.client("sqs")
    record = agent_of(tmp_path).record()
    queue = sqs.create_queue(QueueName="shardvault-doorbell-n1")["QueueUrl"]
    svc.nodes.put(record.model_copy(update={"doorbell": queue}))
    context = BackupContext.model_construct(
        backup_id="b5", cluster="c", sources=[Source(node_id="n1", shard_ids=["s1"])]
    )
    post_releases(context, svc)
    svc.catalog.put(catalog_item(
        {"cluster": "t", "backup_id": restore_key("r1"), "restore_id": "r1", "status": "RUNNING",
         "execution_id": "arn:x", "placement": {"s1": "n1"}, "source_cluster": "c",
         "source_backup_id": "b1"}
    ))  # fmt: skip
    assert failure.reap("arn:x", "ABORTED", "t", svc, time.time())["reaped"]
    rings = sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10)["Messages"]
    assert sorted(json.loads(m["Body"])["ring"] for m in rings) == [
        "abort_restore:r1:reaped",
        "release:b5:cleanup",
    ]


class Refusing:
    """An SQS client that refuses everything, as without the IAM permissions."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def refuse(**_: Any) -> Any:
            error = {"Error": {"Code": "AccessDenied", "Message": "not authorized"}}
            raise ClientError(error, name)

        return refuse


def test_an_agent_without_a_doorbell_polls_its_inbox_as_before(svc, tmp_path, caplog) -> None:
    agent = agent_of(tmp_path, **FAST_IDLE)
    agent.sqs = Refusing()
    with caplog.at_level(logging.WARNING, "shardvault.agent"), Running(agent) as running:
        running.calls.clear()
        time.sleep(2.0)
        polls = running.calls["GetItem:i"]
        just_after_a("Query:i", running)  # the next full read of the inbox: in 5 s
        svc.inbox.post("n1", "flush:b5", "flush", {}, "t-b5")
        posted = time.monotonic()
        wait_for(lambda: "flush:b5" in running.picked_up, timeout=2)
    assert 3 <= polls <= 5  # the ring count, every poll_interval_seconds (0.5 s)
    assert running.picked_up["flush:b5"] - posted < PROMPTLY
    assert svc.nodes.get("n1").doorbell is None
    assert caplog.text.count("no doorbell (") == 1


def test_a_doorbell_that_stops_answering_is_said_once_polled_around_and_opened_again(
    svc, tmp_path, caplog
) -> None:
    sqs = boto3.client("sqs")
    agent = agent_of(
        tmp_path, doorbell_wait_seconds=1, idle_inbox_poll_seconds=8.0, busy_window_seconds=1.0
    )  # the doorbell is opened again 8 s after it stopped answering
    with caplog.at_level(logging.INFO, "shardvault.agent"), Running(agent) as running:
        sqs.delete_queue(QueueUrl=sqs.get_queue_url(QueueName="shardvault-doorbell-n1")["QueueUrl"])
        wait_for(lambda: "doorbell unreadable" in caplog.text, timeout=5)
        # Meanwhile the inbox is polled: a command nobody rang for is taken at once.
        just_after_a("Query:i", running)  # the next full read: in 5 s, still unopened
        svc.inbox.post("n1", "flush:b6", "flush", {}, "t-b6")
        posted = time.monotonic()
        wait_for(lambda: "flush:b6" in running.picked_up, timeout=2)
        assert running.picked_up["flush:b6"] - posted < PROMPTLY
        # Opened again (the queue is created anew), rings wake the agent again.
        wait_for(lambda: "doorbell answers again" in caplog.text, timeout=10)
        wait_for(lambda: not agent.busy(), timeout=5)  # idle: only a ring reads at once
        just_after_a("Query:i", running)  # the safety read: in 8 s
        dispatched = post(svc, "b10", sqs)
        wait_for(lambda: "flush:b10" in running.picked_up, timeout=5)
        assert running.picked_up["flush:b10"] - dispatched < PROMPTLY
    assert caplog.text.count("doorbell unreadable") == 1


def node(heartbeat_age: float, every: float = 0.0, now: float = 10_000.0) -> NodeRecord:
    return NodeRecord(
        node_id="n1",
        cluster="c",
        engine="sqlite",
        shards=[],
        free_bytes=0,
        version="1",
        protocol=AGENT_PROTOCOL,
        heartbeat_at=now - heartbeat_age,
        heartbeat_every=every,
    )


@pytest.mark.parametrize(
    ("age", "every", "silent"),
    [
        (200.0, 300.0, False),  # idle: promised a heartbeat every 300 s
        (899.0, 300.0, False),
        (901.0, 300.0, True),  # three promised heartbeats missed
        (31.0, 5.0, True),  # busy: the fixed 30 s is the longer
        (31.0, 0.0, True),  # an older agent promised nothing: the fixed 30 s
        (29.0, 0.0, False),
    ],
)
def test_silence_is_judged_by_the_heartbeat_period_the_agent_promised(
    svc, age, every, silent
) -> None:
    record = node(age, every)
    assert record.is_silent(10_000.0, 30.0) is silent
    # Validation of a backup or restore judges it so.
    if silent:
        with pytest.raises(AgentUnavailable, match="n1 \\(silent for"):
            check_nodes_available([record], 10_000.0, 30.0)
    else:
        check_nodes_available([record], 10_000.0, 30.0)


def test_the_dispatcher_judges_silence_by_the_promised_period(svc) -> None:
    svc.nodes.put(node(400.0, 300.0, now=time.time()))  # idle, heard 400 s ago: alive
    post(svc, "b7", None)
    assert [i["command_id"] for i in svc.inbox.pending("n1")] == ["flush:b7"]
    svc.nodes.put(node(3_700.0, 300.0, now=time.time()))  # silent even with the grace
    with pytest.raises(AgentUnavailable, match="last heard 3700 s ago"):
        post(svc, "b8", None)


def test_a_failed_backup_names_a_node_silent_by_its_promise_only(svc) -> None:
    context = BackupContext(
        backup_id="b9",
        cluster="c",
        engine="sqlite",
        sources=[Source(node_id="n1", shard_ids=["s1"])],
        store_url="s3://store/backups",
        started_at=0.0,
    )
    error = {"Error": "States.Timeout"}
    svc.nodes.put(node(400.0, 300.0, now=time.time()))  # idle, on time
    assert "stopped answering" not in explain(context, error, svc, time.time())
    svc.nodes.put(node(1_000.0, 300.0, now=time.time()))
    assert "The agent of n1 (silent for 1000 s) stopped answering" in explain(
        context, error, svc, time.time()
    )


def test_doorbell_names_follow_sqs_rules() -> None:
    assert doorbell_name("node-1_a") == "shardvault-doorbell-node-1_a"
    assert doorbell_name("db1.example") is None  # '.' is no SQS name character
    assert doorbell_name("n" * 60) is not None
    assert doorbell_name("n" * 61) is None  # 81 characters


def test_an_idle_agent_with_a_shard_not_ready_heartbeats_within_30_s() -> None:
    """A grant the operator gives shows in the registry (and in ``check``) within 30 s, not
    at the idle heartbeat 300 s later: each heartbeat runs the readiness checks again."""
    from types import SimpleNamespace

    from shardvault_agent.daemon import UNREADY_HEARTBEAT_SECONDS, Agent

    config = SimpleNamespace(heartbeat_interval_seconds=5.0, idle_heartbeat_seconds=300.0)

    def period(*, busy: bool, unready: bool) -> float:
        agent = SimpleNamespace(config=config, busy=lambda: busy, unready=unready)
        return Agent.heartbeat_period(agent)  # type: ignore[arg-type]

    assert period(busy=False, unready=False) == 300.0
    assert period(busy=False, unready=True) == UNREADY_HEARTBEAT_SECONDS == 30.0
    assert period(busy=True, unready=True) == 5.0


@pytest.mark.parametrize(
    ("error", "noted"),
    [
        (PartUploadFailed("part 1 failed after 2 tries: RequestTimeout", fix="retry"), True),
        (BackupReleased("backup b1 was already released on this node.", fix="none"), False),
    ],
)
def test_a_released_backups_command_fails_without_a_note_that_would_hide_the_first_cause(
    svc, tmp_path, monkeypatch, error, noted
) -> None:
    """The failure path names the earliest note's cause. A command failing because its
    backup was released meanwhile is that failure's consequence: it is answered, not noted."""
    agent = agent_of(tmp_path)
    svc.inbox.post("n1", "upload:b1:k", "upload", {"backup_id": "b1"}, "t-b1")
    (item,) = svc.inbox.pending("n1")
    answered = []
    monkeypatch.setattr(agent, "task_alive", lambda token: True)

    def failing(item: dict[str, Any]) -> dict[str, Any]:
        raise error

    monkeypatch.setattr(agent, "run_command", failing)
    monkeypatch.setattr(agent, "fail", lambda token, name, cause: answered.append(name))
    agent.execute(item)
    assert answered == [error.name]
    notes = svc.inbox.failures("n1", "b1")
    assert [n["error"] for n in notes] == ([error.name] if noted else [])
