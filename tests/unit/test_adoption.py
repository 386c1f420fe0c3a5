"""A target agent adopts the shards it restored and checked: they become shards it holds (so the
new cluster is backed up without editing agent configs), an aborted restore takes back only its
own adoption, and a configured shard of the same id wins."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from shardvault_agent.commands import Commands
from shardvault_agent.config import AgentConfig, ShardConfig
from shardvault_agent.engines import adapter_class
from shardvault_agent.engines.sqlite.adapter import SqliteAdapter
from shardvault_agent.ratelimit import RateLimiter

from shardvault.contracts.models import Engine


def target(tmp_path: Path, shards: list[ShardConfig] | None = None) -> Commands:
    config = AgentConfig(
        node_id="t-node-1",
        cluster="t",
        engine="sqlite",
        shards=shards or [],
        state_dir=tmp_path / "state",
        restore_dir=tmp_path / "restored",
    )
    return Commands(
        config,
        SqliteAdapter(config),
        RateLimiter(None),
        SimpleNamespace(http=None),
    )


def restored_shard(root: Path, name: str) -> dict[str, str]:
    root.mkdir(parents=True)
    (root / name).write_bytes(b"SQLite format 3\x00")
    return {"path": str(root)}


def test_a_restored_shard_becomes_a_shard_the_node_holds(tmp_path):
    commands = target(tmp_path)
    result = restored_shard(tmp_path / "restored" / "shard-1", "orders.db")

    commands.restorer.adoption.adopt("r1", "shard-1", result)

    held = commands.shards()
    assert list(held) == ["shard-1"]
    assert held["shard-1"].path == tmp_path / "restored" / "shard-1" / "orders.db"
    assert commands._shards(["shard-1"]) == [held["shard-1"]]


def test_an_aborted_restore_takes_back_only_its_own_adoption(tmp_path):
    commands = target(tmp_path)
    restorer = commands.restorer
    restorer.adoption.adopt("r1", "shard-1", restored_shard(tmp_path / "a", "one.db"))
    restorer.adoption.adopt("r2", "shard-1", restored_shard(tmp_path / "b", "two.db"))
    assert commands.shards()["shard-1"].path == tmp_path / "b" / "two.db"

    restorer.adoption.unadopt("r2", "shard-1")  # r2 replaced r1's copy, then was aborted
    assert commands.shards()["shard-1"].path == tmp_path / "a" / "one.db"
    restorer.adoption.unadopt("r2", "shard-1")  # twice: nothing more changes
    assert commands.shards()["shard-1"].path == tmp_path / "a" / "one.db"

    restorer.adoption.unadopt("r1", "shard-1")
    assert commands.shards() == {}


def test_a_configured_shard_wins_over_an_adopted_one_of_the_same_id(tmp_path):
    configured = ShardConfig(shard_id="shard-1", path=tmp_path / "live.db")
    commands = target(tmp_path, [configured])

    commands.restorer.adoption.adopt("r1", "shard-1", restored_shard(tmp_path / "r", "copy.db"))

    assert commands.shards() == {"shard-1": configured}


def adoptable(engine: Engine, shard_id: str, result: dict) -> dict | None:
    config = AgentConfig(
        node_id="t-node-1", cluster="t", engine=engine, shards=[], state_dir=Path("/nx")
    )
    return adapter_class(engine)(config).adoptable(shard_id, result)


def test_what_an_agent_needs_to_back_up_each_engines_restored_shard(tmp_path):
    postgres = {"path": "/r/shard-2", "port": 55432, "socket_dir": "/run/sv"}
    assert adoptable(Engine.POSTGRES, "shard-2", postgres) == {
        "shard_id": "shard-2",
        "data_dir": "/r/shard-2",
        "conninfo": "host=/run/sv port=55432 user=postgres dbname=postgres",
    }
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.db").touch()
    (two / "b.db").touch()
    assert adoptable(Engine.SQLITE, "shard-3", {"path": str(two)}) is None  # which one?
    (two / "b.db").unlink()
    (two / "a.db-wal").touch()  # left by the integrity check's read: not a database
    (two / "a.db-shm").touch()
    assert adoptable(Engine.SQLITE, "shard-3", {"path": str(two)}) == {
        "shard_id": "shard-3",
        "path": str(two / "a.db"),
    }
