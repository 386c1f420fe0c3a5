"""A starting agent reconciles its state directory against the catalog: what ended backups
and failed restores left is removed, what running ones hold is kept, and a finished restore
keeps its shards. The state directory and restore_dir are read after, from outside."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from shardvault_agent.commands import Commands
from shardvault_agent.config import AgentConfig
from shardvault_agent.engines.sqlite.adapter import SqliteAdapter
from shardvault_agent.ratelimit import RateLimiter
from shardvault_agent.reconcile import reconcile, reconcile_safely

from shardvault.aws.tables import Catalog
from tests.unit.support import catalog_item

from .support import handle, moto_services, sqlite_agent


def agent(tmp_path: Path) -> Commands:
    config = sqlite_agent(tmp_path, rows=4)
    config = AgentConfig.model_validate(
        config.model_dump() | {"restore_dir": tmp_path / "restored"}
    )
    engine = SqliteAdapter(config)
    return Commands(config, engine, RateLimiter(None), SimpleNamespace(http=None))


def checkpoint(commands: Commands, backup_id: str) -> None:
    handle(commands, "checkpoint", {"backup_id": backup_id, "shard_ids": ["s1"]})


def held(commands: Commands) -> set[str]:
    state = commands.config.state_dir
    return {p.name for d in ("backups", "snapshots") for p in (state / d).glob("*")}


def test_ended_backups_are_released_and_running_ones_kept(tmp_path, monkeypatch):
    commands = agent(tmp_path)
    for backup_id in ("b-failed", "b-running", "b-unknown"):
        checkpoint(commands, backup_id)
    with moto_services(monkeypatch) as svc:
        svc.catalog.put(catalog_item({"cluster": "c", "backup_id": "b-failed", "status": "FAILED"}))
        svc.catalog.put(
            catalog_item({"cluster": "c", "backup_id": "b-running", "status": "RUNNING"})
        )
        catalog = Catalog(svc.catalog.table)

        done = reconcile(commands, lambda key: catalog.status("c", key))

    assert done["released"] == ["b-failed", "b-unknown"]
    assert held(commands) == {"b-running"}
    snapshots = commands.config.state_dir / "snapshots"
    assert [p.name for p in snapshots.iterdir()] == ["b-running"]


def test_a_failed_restore_is_undone_and_a_finished_one_keeps_its_shards(tmp_path):
    commands = agent(tmp_path)
    restore_dir = commands.config.restore_dir
    for restore_id in ("r-failed", "r-done"):
        shard = restore_dir / f"{restore_id}-shard"
        shard.mkdir(parents=True)
        (shard / "data.db").write_bytes(b"restored")
        commands.restorer.finisher._note_started(
            restore_id, f"{restore_id}-shard", {"path": str(shard)}
        )
        (restore_dir / ".incoming" / restore_id / "leftover").mkdir(parents=True)
    statuses = {"restore#r-failed": "FAILED", "restore#r-done": "COMPLETE"}

    done = reconcile(commands, statuses.get)

    assert done == {"released": [], "undone": ["r-failed"], "unstaged": ["r-done"]}
    assert not (restore_dir / "r-failed-shard").exists()
    assert (restore_dir / "r-done-shard" / "data.db").read_bytes() == b"restored"
    assert list((restore_dir / ".incoming").iterdir()) == []


def test_an_unreadable_catalog_changes_nothing(tmp_path):
    commands = agent(tmp_path)
    checkpoint(commands, "b1")

    def denied(key: str) -> str:
        raise PermissionError("AccessDenied")

    assert "AccessDenied" in reconcile_safely(commands, denied)["skipped"]
    assert held(commands) == {"b1"}


def test_a_late_undo_leaves_a_later_restores_shard_alone(tmp_path):
    """Restore r1 placed s1 and failed while this node was away; r2 then restored s1 over it
    (replace) and adopted it. Undoing r1 at reconcile must not remove r2's shard."""
    commands = agent(tmp_path)
    restorer, restore_dir = commands.restorer, commands.config.restore_dir
    shard = restore_dir / "s9"
    shard.mkdir(parents=True)
    (shard / "data.db").write_bytes(b"SQLite format 3\x00 from r2")
    restorer.finisher._note_started("r1", "s9", {"path": str(shard)})
    restorer.finisher._note_started("r2", "s9", {"path": str(shard)})
    restorer.adoption.adopt("r2", "s9", {"path": str(shard)})

    done = reconcile(commands, {"restore#r1": "FAILED", "restore#r2": "COMPLETE"}.get)

    assert done["undone"] == ["r1"]
    assert (shard / "data.db").read_bytes() == b"SQLite format 3\x00 from r2"
    assert commands.shards()["s9"].path == shard / "data.db"
