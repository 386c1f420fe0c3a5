"""One suite every engine adapter passes (issue 45), against a real shard of each engine:
SQLite, RocksDB (through its library), PostgreSQL and MariaDB servers, and command hooks (a
snapshot script of the operator's, here one that hard-links a directory's files).

What the agent's commands rely on, whatever the engine: a healthy shard is ready; a
checkpoint captures files that exist and is held until its release; stop captures the tail;
release lets it go and may be repeated; an agent restarted (a new adapter) lets go of what
the old one held without error; a shard whose data is gone is refused by name, never with a
crash; a backup's captures laid out as a restore lays them out finish and pass their checks,
and the same files cut short never pass (a failed check, or a named error with its fix).
restic runs one suite against every storage backend in the same way.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from shardvault_agent.config import AgentConfig
from shardvault_agent.engines import adapter_for
from shardvault_agent.engines.base import Capture, EngineAdapter, Finishing

from shardvault.errors import ShardVaultError
from shardvault.local import demo
from shardvault.local.mariadb import init_server
from shardvault.local.mariadb import stop_server as stop_mariadb
from shardvault.local.postgres import init_instance

ENGINES = ["sqlite", "rocksdb", "postgres", "mariadb", "hooks"]


def sqlite_shard(root: Path) -> tuple[dict, object]:
    path = root / "shard.db"
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v TEXT)")
        db.executemany("INSERT INTO t (v) VALUES (?)", [(f"row {i}",) for i in range(500)])
    return {"path": str(path)}, None


def rocksdb_shard(root: Path) -> tuple[dict, object]:
    data = root / "rocks"
    write = (
        "import sys\nfrom rocksdict import Options, Rdict\n"
        "options = Options(raw_mode=True)\noptions.create_if_missing(True)\n"
        "db = Rdict(sys.argv[1], options)\n"
        "for i in range(500):\n    db[b'k%06d' % i] = b'v' * 100\n"
        "db.flush()\ndb.close()\n"
    )
    subprocess.run([sys.executable, "-c", write, str(data)], check=True, timeout=60)
    return {"data_dir": str(data)}, None


def postgres_shard(root: Path) -> tuple[dict, object]:
    instance = init_instance(root / "pg")
    instance.psql("CREATE TABLE t AS SELECT g AS k FROM generate_series(1, 500) g")
    return {"data_dir": str(instance.data_dir), "conninfo": instance.conninfo}, instance


def mariadb_shard(root: Path) -> tuple[dict, object]:
    server = init_server(root / "maria")
    return {"data_dir": str(server.data_dir), "socket": str(server.socket)}, server


def hooks_shard(root: Path) -> tuple[dict, object]:
    data = root / "store"
    data.mkdir()
    (data / "000001.sst").write_bytes(b"sst" * 1000)
    return {"data_dir": str(data)}, None


def hook_scripts(root: Path) -> dict:
    """A checkpoint hook that hard-links the shard's files into a snapshot per backup and
    names it; a release hook that removes it (what an operator's LVM or ZFS script does)."""
    snapshots = root / "snapshots"

    def script(name: str, body: str) -> list[str]:
        path = root / name
        path.write_text(f"#!{sys.executable}\nimport json, os, pathlib, shutil\n{body}\n")
        path.chmod(0o755)
        return [str(path)]

    take = (
        f"snap = pathlib.Path({str(snapshots)!r}) / os.environ['SHARDVAULT_BACKUP_ID']\n"
        "snap.mkdir(parents=True, exist_ok=True)\n"
        "data = pathlib.Path(os.environ['SHARDVAULT_DATA_DIR'])\n"
        "for f in data.iterdir():\n"
        "    if not (snap / f.name).exists():\n"
        "        os.link(f, snap / f.name)\n"
        "print(json.dumps({'directory': str(snap), 'marker': {}}))"
    )
    drop = (
        f"shutil.rmtree(pathlib.Path({str(snapshots)!r}) / os.environ['SHARDVAULT_BACKUP_ID'],"
        " ignore_errors=True)"
    )
    # The operator's check of a restored copy: here, that the store's file is whole.
    check = (
        "restored = pathlib.Path(os.environ['SHARDVAULT_RESTORED_DIR'])\n"
        "assert (restored / '000001.sst').read_bytes() == b'sst' * 1000, 'damaged'"
    )
    return {
        "checkpoint": script("checkpoint", take),
        "release": script("release", drop),
        "finish": script("finish", check),
    }


SHARDS = {
    "sqlite": sqlite_shard,
    "rocksdb": rocksdb_shard,
    "postgres": postgres_shard,
    "mariadb": mariadb_shard,
    "hooks": hooks_shard,
}


def stop_server(engine: str, server: object) -> None:
    if engine == "postgres":
        server.stop(mode="immediate")  # type: ignore[attr-defined]
    elif engine == "mariadb":
        stop_mariadb(server.data_dir)  # type: ignore[attr-defined]


@pytest.fixture(params=ENGINES)
def engine_shard(request, tmp_path: Path) -> Iterator[tuple[AgentConfig, EngineAdapter]]:
    engine = request.param
    fields, server = SHARDS[engine](tmp_path)
    shard = {"shard_id": "s1", "role": "leader", **fields}
    settings = demo.agent_config(tmp_path, "conformance", f"{engine}-node", engine, [shard])
    if engine == "hooks":
        settings["hooks"] = hook_scripts(tmp_path)
    config = AgentConfig.model_validate(settings)
    try:
        yield config, adapter_for(config)
    finally:
        stop_server(engine, server)


def assert_captured(capture: Capture) -> None:
    """A capture names files, each under its root as listed (a directory ends in ``/``)."""
    for entry in capture.files:
        path = capture.root / entry.path.rstrip("/")
        assert path.exists(), f"{entry.path} listed but not under {capture.root}"


def test_a_checkpoint_is_held_until_its_release_and_release_may_repeat(engine_shard):
    config, adapter = engine_shard
    shard = config.shards[0]
    work = config.state_dir / "work" / "b1"
    work.mkdir(parents=True)
    adapter.check_ready(shard)
    assert adapter.shard_bytes(shard) > 0

    adapter.flush(shard)
    captured = adapter.checkpoint(shard, "b1", work)
    assert captured.files, "a checkpoint captures the shard's files"
    assert_captured(captured)
    assert adapter.holds(shard, "b1")

    tail = adapter.stop(shard, "b1", work)
    assert_captured(tail)

    adapter.release(shard, "b1")
    assert not adapter.holds(shard, "b1")
    assert "b1" not in adapter.held_backups()
    adapter.release(shard, "b1")  # a retried release finds nothing to do

    again = adapter.checkpoint(shard, "b2", config.state_dir / "work" / "b2")
    assert again.files  # the shard is not left in a state that refuses the next backup
    adapter.release(shard, "b2")


def test_an_agent_restarted_lets_go_of_what_the_old_one_held(engine_shard):
    config, adapter = engine_shard
    shard = config.shards[0]
    adapter.checkpoint(shard, "b1", config.state_dir / "work" / "b1")

    restarted = adapter_for(config)  # the agent process restarted: a new adapter
    # What outlives the process (files in the state directory; a server session does not)
    # is named, for reconcile to release.
    assert restarted.held_backups() <= {"b1"}
    restarted.release(shard, "b1")
    assert not restarted.holds(shard, "b1")
    assert "b1" not in restarted.held_backups()
    adapter.release(shard, "b1")  # and the old one's release is safe too
    restarted.checkpoint(shard, "b2", config.state_dir / "work" / "b2")
    restarted.release(shard, "b2")


def test_a_shard_whose_data_is_gone_is_refused_by_name(engine_shard, tmp_path):
    config, _ = engine_shard
    shard = config.shards[0]
    moved = {
        field: tmp_path / "nowhere" / Path(getattr(shard, field)).name
        for field in ("path", "data_dir")
        if getattr(shard, field, None) is not None
    }
    gone = config.model_copy(update={"shards": [shard.model_copy(update=moved)]})
    with pytest.raises(ShardVaultError) as refused:
        adapter_for(gone).check(gone.shards[0])
    assert refused.value.name  # a named error with its fix, not a crash
    assert refused.value.fix


def laid_out(captures: list[Capture], root: Path) -> Path:
    """The captures' files placed under ``root`` as a restore places its streams: the data's,
    then the tail's (a file in both is the tail's)."""
    root.mkdir(parents=True)
    for capture in captures:
        for entry in capture.files:
            target = root / entry.path.rstrip("/")
            if entry.path.endswith("/"):
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(capture.root / entry.path, "rb") as source, open(target, "wb") as out:
                out.write(source.read(entry.size))  # the size captured, as a backup reads
    return root


def backed_up_and_laid_out(
    config: AgentConfig, adapter: EngineAdapter, root: Path
) -> tuple[Capture, dict[str, str]]:
    """A backup of the shard (checkpoint, stop, release) laid out under ``root`` as a restore
    lays it out: the checkpoint's capture and the marker the restore's finish gets."""
    shard = config.shards[0]
    work = config.state_dir / "work" / "b1"
    work.mkdir(parents=True)
    data = adapter.checkpoint(shard, "b1", work)
    tail = adapter.stop(shard, "b1", work)
    laid_out([data, tail], root)
    adapter.release(shard, "b1")
    return data, {**data.marker, **tail.marker}


def finish(adapter: EngineAdapter, root: Path, marker: dict[str, str]) -> dict:
    """Finishes a restored shard at ``root``; stops whatever server it started."""
    servers: list[dict] = []
    job = Finishing(
        shard_id="s1",
        root=root,
        layout={"shard_id": "s1", "marker": marker},
        validation_queries=[],
        heapallindexed=False,
        servers_given=[],
        note_server=servers.append,
    )
    try:
        return adapter.finish(job)
    finally:
        if servers or adapter.serving(root):
            adapter.stop_server(root, immediate=True)


def test_a_backup_laid_out_as_a_restore_lays_it_out_finishes_and_passes_its_checks(
    engine_shard, tmp_path
):
    """What a restore does with a backup's captures: the engine's finish starts (or opens)
    the shard and its checks pass."""
    config, adapter = engine_shard
    root = tmp_path / "restored" / "s1"
    _, marker = backed_up_and_laid_out(config, adapter, root)

    result = finish(adapter, root, marker)

    assert result["checks_passed"], result["checks"]
    assert result["shard_id"] == "s1"


def test_a_restored_shard_cut_short_does_not_pass(engine_shard, tmp_path):
    """Bad data is refused: a shard whose files arrived cut short either fails its checks or
    is refused by name (with its fix), never reported restored."""
    config, adapter = engine_shard
    root = tmp_path / "restored" / "s1"
    data, marker = backed_up_and_laid_out(config, adapter, root)
    for entry in data.files:  # every file of the checkpoint arrived cut short
        if not entry.path.endswith("/") and entry.size:
            os.truncate(root / entry.path, entry.size // 2)

    refused: ShardVaultError | None = None
    result: dict = {}
    try:
        result = finish(adapter, root, marker)
    except ShardVaultError as error:
        refused = error
    if refused is not None:
        assert refused.fix  # by name, with its fix
    else:
        assert not result["checks_passed"], result["checks"]
