"""A backup of one node flushes in its Checkpoint command (the Flush map exists to bring
several nodes' checkpoints close together): the engine flushes each shard before it takes
that shard's checkpoint, and not again when the command is retried; an engine whose
checkpoint flushes itself (PostgreSQL's) is not flushed first."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from shardvault_agent.commands import Commands
from shardvault_agent.engines.sqlite.adapter import SqliteAdapter
from shardvault_agent.ratelimit import RateLimiter

from .support import handle, sqlite_agent


def recording_commands(tmp_path: Path) -> tuple[Commands, list[str]]:
    config = sqlite_agent(tmp_path, rows=100)
    engine, calls = SqliteAdapter(config), []
    flush, checkpoint = engine.flush, engine.checkpoint

    def recorded_flush(shard):
        calls.append(f"flush {shard.shard_id}")
        return flush(shard)

    def recorded_checkpoint(shard, backup_id, work_dir, **options):
        calls.append(f"checkpoint {shard.shard_id}")
        return checkpoint(shard, backup_id, work_dir, **options)

    engine.flush, engine.checkpoint = recorded_flush, recorded_checkpoint
    no_faults = SimpleNamespace()
    return Commands(config, engine, RateLimiter(None), sender=no_faults), calls


def test_a_lone_nodes_checkpoint_flushes_first(tmp_path: Path) -> None:
    cmds, calls = recording_commands(tmp_path)
    args = {"backup_id": "b1", "shard_ids": ["s1"], "flush": True}

    handle(cmds, "checkpoint", args)
    handle(cmds, "checkpoint", args)  # retried: the checkpoint is held, nothing is taken again

    assert calls == ["flush s1", "checkpoint s1"]


def test_an_engine_whose_checkpoint_flushes_is_not_flushed_first(tmp_path: Path) -> None:
    cmds, calls = recording_commands(tmp_path)
    cmds.engine.checkpoint_flushes = True  # as PostgresAdapter's: pg_backup_start checkpoints
    handle(cmds, "checkpoint", {"backup_id": "b1", "shard_ids": ["s1"], "flush": True})
    assert calls == ["checkpoint s1"]


def test_without_the_flag_the_checkpoint_does_not_flush(tmp_path: Path) -> None:
    cmds, calls = recording_commands(tmp_path)
    handle(cmds, "checkpoint", {"backup_id": "b1", "shard_ids": ["s1"]})
    assert calls == ["checkpoint s1"]
