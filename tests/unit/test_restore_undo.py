"""A restore that replaces a running copy and then fails its checks puts the copy back and
starts its server again: what the node noted while finishing (the server it started, the
server it replaced) survives until the abort reads it. The engine is a recording stand-in:
the restore's bookkeeping is under test, not a server."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from shardvault_agent.commands import Commands
from shardvault_agent.config import AgentConfig
from shardvault_agent.engines.base import Finishing
from shardvault_agent.engines.sqlite.adapter import SqliteAdapter
from shardvault_agent.ratelimit import RateLimiter

from shardvault.contracts.commands import FinishRestoreArgs
from shardvault.errors import RestoreValidationFailed

from .support import restore_target


class RecordingEngine(SqliteAdapter):
    """A server-running engine whose copy fails its checks after its server started."""

    def __init__(self, config: AgentConfig) -> None:
        super().__init__(config)
        self.calls: list[tuple[str, Any]] = []

    def serving(self, root: Path) -> dict[str, Any] | None:
        return {"port": 7} if (root / "old.db").exists() else None

    def stop_server(self, root: Path, *, immediate: bool = False) -> None:
        self.calls.append(("stop", root.name, immediate))

    def server_files(self, root: Path) -> list[Path]:
        return [root.with_name(f"{root.name}.sock"), root.with_name(f"{root.name}.log")]

    def start_server(self, root: Path, server: dict[str, Any]) -> None:
        self.calls.append(("start", sorted(p.name for p in root.iterdir()), server))
        socket_dir, log = self.server_files(root)  # as a server does when it starts
        socket_dir.mkdir(exist_ok=True)
        (socket_dir / f".s.PGSQL.{server['port']}").touch()
        log.touch()

    def finish(self, job: Finishing) -> dict[str, Any]:
        job.note_server({"port": 8})
        return {"shard_id": job.shard_id, "checks": {"check": "bad"}, "checks_passed": False}


@pytest.mark.parametrize("earlier", ["configured", "adopted"])
def test_a_failed_restore_over_a_running_copy_starts_that_copy_again(tmp_path, earlier):
    """Issue 44 (12): when the copy replaced was itself an earlier restore's (adopted), the
    abort skipped the shard and then deleted the set-aside copy with the staging."""
    config = restore_target(tmp_path)
    engine = RecordingEngine(config)
    commands = Commands(config, engine, RateLimiter(None), SimpleNamespace(http=None))
    restorer = commands.restorer
    final = restorer.places.final("s1")
    final.mkdir(parents=True)
    (final / "old.db").write_text("the earlier copy")
    if earlier == "adopted":
        shard = {"shard_id": "s1", "path": str(final / "old.db"), "role": "leader"}
        restorer.adoption.path.parent.mkdir(parents=True, exist_ok=True)
        restorer.adoption.path.write_text(json.dumps({"s1": {"restore_id": "r0", "shard": shard}}))
    staged = restorer.places.staging("r1", "s1")
    staged.mkdir(parents=True)
    (staged / "new.db").write_text("this restore's copy")
    restorer.places.state("r1").mkdir(parents=True)
    (restorer.places.state("r1") / "s1.layout.json").write_text(
        json.dumps({"shard_id": "s1", "streams": []})
    )

    with pytest.raises(RestoreValidationFailed):
        restorer.finish(FinishRestoreArgs(backup_id="r1", shard_ids=["s1"]))
    socket_dir, log = engine.server_files(final)  # what this restore's server left beside it
    socket_dir.mkdir()
    (socket_dir / ".s.PGSQL.8").touch()
    log.write_text("server log")
    restorer.abort("r1")

    assert engine.calls == [
        ("stop", "s1", False),  # the earlier copy's server, before its files moved aside
        ("stop", "s1", True),  # this restore's server, at the abort
        ("start", ["old.db"], {"port": 7}),  # the earlier copy, back in place
    ]
    assert (final / "old.db").read_text() == "the earlier copy"
    assert not staged.exists()
    if earlier == "adopted":  # still the earlier restore's, as it was
        assert restorer.adoption.adopted()["s1"]["restore_id"] == "r0"
    # This restore's server's socket is gone with its copy; the earlier copy's server, started
    # again after the removal, made its own.
    assert sorted(p.name for p in socket_dir.iterdir()) == [".s.PGSQL.7"]
    assert log.read_text() == ""


def test_an_abort_prunes_tombstones_no_command_can_reach_any_more(tmp_path):
    config = restore_target(tmp_path)
    commands = Commands(
        config,
        SqliteAdapter(config),
        RateLimiter(None),
        SimpleNamespace(http=None),
    )
    restorer = commands.restorer
    restorer.places.restores_dir.mkdir(parents=True, exist_ok=True)
    old, recent = (
        restorer.places.restores_dir / "r-old.aborted",
        restorer.places.restores_dir / "r-new.aborted",
    )
    old.touch()
    recent.touch()
    fifteen_days_ago = time.time() - 15 * 86400  # past twice the inbox items' 7 days
    os.utime(old, (fifteen_days_ago, fifteen_days_ago))

    restorer.abort("r1")

    assert sorted(p.name for p in restorer.places.restores_dir.glob("*.aborted")) == [
        "r-new.aborted",
        "r1.aborted",
    ]


def test_a_directory_that_is_no_socket_directory_is_left_alone(tmp_path):
    from shardvault_agent.restore.finish import remove_server_file

    shard = tmp_path / "a.sock"  # a shard whose id ends in .sock: a database, not sockets
    (shard / "base" / "1").mkdir(parents=True)
    sockets = tmp_path / "b.sock"
    sockets.mkdir()
    (sockets / ".s.PGSQL.5432").touch()
    log = tmp_path / "b.log"
    log.write_text("server log")

    for path in (shard, sockets, log, tmp_path / "missing.log"):
        remove_server_file(path)

    assert (shard / "base" / "1").is_dir()
    assert not sockets.exists()
    assert not log.exists()
