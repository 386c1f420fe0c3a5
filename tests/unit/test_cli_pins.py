"""``shardvault restore --pin`` and ``--tablespace``: a shard pinned to two nodes (a tablespace
given two directories) is refused by name before any restore starts (the placement used to
keep the last pin silently); repeating the same pin is harmless and accepted."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from shardvault.client import cli
from shardvault.client import operations as ops
from shardvault.client.commands import restore as restore_command
from shardvault.contracts.models import RestoreRequest
from shardvault.restore import admission


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[RestoreRequest]:
    """The restores the CLI starts (none reaches a state machine), against a configured
    deployment so that only the pins can stop the command."""
    monkeypatch.setenv("SHARDVAULT_STATE_MACHINE_ARN", "arn:backup")
    monkeypatch.setenv("SHARDVAULT_CATALOG_TABLE", "catalog")
    monkeypatch.setenv("SHARDVAULT_RESTORE_STATE_MACHINE_ARN", "arn:restore")
    requests: list[RestoreRequest] = []

    def start_restore(config: ops.ClientConfig, request: RestoreRequest) -> str:
        requests.append(request)
        return "arn:execution"

    monkeypatch.setattr(ops, "start_restore", start_restore)
    # The backup named exists (the CLI asks the catalog before it starts a restore).
    monkeypatch.setattr(admission, "resolve_backup", lambda request, catalog: {})
    monkeypatch.setattr(restore_command, "table", lambda name: None)
    return requests


@pytest.fixture
def output(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    text = io.StringIO()
    monkeypatch.setattr(restore_command, "console", Console(file=text, width=200))
    monkeypatch.setattr(cli, "errors", Console(file=text, width=200))
    return text


def restore(*pins: str) -> int:
    return cli.main(["restore", "orders", "--into", "copy", *(f"--pin={p}" for p in pins)])


def test_a_shard_pinned_to_two_nodes_is_refused_by_name_before_anything_starts(
    started: list[RestoreRequest], output: io.StringIO
) -> None:
    assert restore("shard-1=node-1", "shard-2=node-2", "shard-1=node-3") == cli.REFUSED
    assert started == []
    said = output.getvalue()
    assert "InvalidRequest" in said
    assert "shard shard-1 is pinned to two nodes" in said
    assert "shard-1=node-1" in said
    assert "shard-1=node-3" in said
    assert "keep one --pin for shard-1" in said


def test_the_same_pin_twice_is_accepted(started: list[RestoreRequest], output: io.StringIO) -> None:
    assert restore("shard-1=node-1", "shard-2=node-2", "shard-1=node-1") == 0
    (request,) = started
    assert request.placement == {"shard-1": "node-1", "shard-2": "node-2"}


def test_a_pin_without_a_node_is_refused(
    started: list[RestoreRequest], output: io.StringIO
) -> None:
    assert restore("shard-1") == cli.REFUSED
    assert started == []
    assert "is not SHARD=NODE" in output.getvalue()


def restore_with_tablespaces(*given: str) -> int:
    options = [f"--tablespace={g}" for g in given]
    return cli.main(["restore", "orders", "--into", "copy", *options])


def test_tablespaces_go_into_the_request_and_one_given_two_directories_is_refused(
    started: list[RestoreRequest], output: io.StringIO
) -> None:
    assert restore_with_tablespaces("fast=/mnt/ssd/fast", "shard-2:slow=/mnt/hdd/s2") == 0
    (request,) = started
    assert request.tablespaces == {"fast": "/mnt/ssd/fast", "shard-2:slow": "/mnt/hdd/s2"}
    assert restore_with_tablespaces("fast=/a", "fast=/b") == cli.REFUSED
    assert restore_with_tablespaces("fast") == cli.REFUSED
    assert len(started) == 1
    said = output.getvalue()
    assert "tablespace fast is given two directories: /a and /b" in said
    assert "is not [SHARD:]NAME=DIR" in said
