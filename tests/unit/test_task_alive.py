"""An agent skips a command whose task has ended (a week-old inbox must not take checkpoints
nobody releases) but not one whose token the service does not know yet: the local stack
accepts heartbeats only after the dispatching Lambda returned, and the doorbell can wake the
agent before that."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from shardvault_agent import daemon


class Unknown(Exception):
    pass


class TimedOut(Exception):
    pass


class FakeSfn:
    exceptions = SimpleNamespace(
        TaskDoesNotExist=Unknown, InvalidToken=Unknown, TaskTimedOut=TimedOut
    )

    def __init__(self, answers: list[Exception | None]) -> None:
        self.answers, self.calls = answers, 0

    def send_task_heartbeat(self, taskToken: str) -> None:
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        if answer is not None:
            raise answer


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch):
    monkeypatch.setattr(daemon.time, "sleep", lambda _: None)


def alive(answers: list[Exception | None]) -> tuple[bool, int]:
    sfn = FakeSfn(answers)
    return daemon.Agent.task_alive(SimpleNamespace(sfn=sfn), "token"), sfn.calls


def test_a_token_unknown_at_first_is_asked_again_and_the_command_runs():
    assert alive([Unknown(), Unknown(), None]) == (True, 3)


def test_a_token_nobody_knows_after_the_rechecks_counts_as_ended():
    assert alive([Unknown()]) == (False, len(daemon.TOKEN_RECHECK_WAITS) + 1)


def test_a_timed_out_task_is_ended_at_once():
    assert alive([TimedOut()]) == (False, 1)


def test_a_heartbeat_that_cannot_tell_runs_the_command():
    assert alive([RuntimeError("throttled")]) == (True, 1)
