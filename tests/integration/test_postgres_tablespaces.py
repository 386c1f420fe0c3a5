"""PostgreSQL shards with tablespaces on other disks: backed up with their shard (full, and
incremental under writes), restored into another node count with and without a remap.

Each source shard has two tablespaces: ``fast`` holds pgbench's accounts (the load's main
table) and an unlogged table, ``slow`` the accounts' index and a table no load touches. The
restored copies must be consistent (TPC-B invariants row by row, the untouched table equal by
ordered hash, pg_amcheck), and each restored tablespace must be a directory of the target's
(its default place in ``restore_dir``, or the remap's), never the source's.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from shardvault_agent.engines.postgres.server import ensure_traversable

from shardvault.contracts.links import DEFAULT_AREA
from shardvault.local.postgres import (
    PostgresInstance,
    give_to_postgres,
    restored_instance,
    start_pgbench,
    stop_process,
)

from .conftest import output, running_pg_cluster
from .test_point_in_time import MARKS, restored_marks, settle, write_marks
from .test_postgres import LOAD_TPS, check_consistent_copy, create_static_tables, history_rows

TABLESPACES = ("fast", "slow")


@pytest.fixture
def pg_cluster(stack, tmp_path):
    with running_pg_cluster(stack, tmp_path, nodes=2, scale=2) as running:
        yield running


def give_tablespaces(server: PostgresInstance, disks: Path) -> dict[str, Path]:
    """Creates the server's tablespaces in directories of their own ("other disks") and moves
    tables into them; returns each one's directory."""
    made = {}
    for name in TABLESPACES:
        directory = disks / name
        directory.mkdir(parents=True)
        give_to_postgres(directory)
        ensure_traversable(directory)
        server.psql(f"CREATE TABLESPACE {name} LOCATION '{directory}'")
        made[name] = directory
    server.psql("ALTER TABLE pgbench_accounts SET TABLESPACE fast")
    server.psql("ALTER INDEX pgbench_accounts_pkey SET TABLESPACE slow")
    server.psql("ALTER TABLE static_check SET TABLESPACE slow")
    server.psql(
        "CREATE UNLOGGED TABLE scratch TABLESPACE fast AS SELECT g FROM generate_series(1, 1000) g"
    )
    return made


def tablespace_links(data_dir: Path) -> dict[str, Path]:
    """The copy's tablespaces: oid -> the directory its link leads to."""
    return {link.name: link.resolve() for link in (data_dir / "pg_tblspc").iterdir()}


def check_restored(
    shard: dict, static: dict, history: dict, sources: dict[str, set[Path]], allowed: list[Path]
) -> dict[str, Path]:
    """The copy is consistent, its tablespaces each lead under one of ``allowed`` and none to
    a source's directory, and the unlogged table came back empty; returns its links."""
    instance = restored_instance(shard)
    check_consistent_copy(instance, shard["shard_id"], static, history)
    assert shard["checks"]["pg_amcheck --all"] == "ok", shard
    assert instance.psql("SELECT count(*) FROM scratch") == "0"  # unlogged: init fork only
    in_fast = instance.psql(
        "SELECT count(*) FROM pg_class c JOIN pg_tablespace t ON c.reltablespace = t.oid "
        "WHERE t.spcname = 'fast' AND c.relname IN ('pgbench_accounts', 'scratch')"
    )
    assert in_fast == "2"
    links = tablespace_links(Path(shard["path"]))
    assert len(links) == 2
    every_source = set().union(*sources.values())
    for target in links.values():
        assert target not in every_source
        assert not any(s in target.parents for s in every_source)
        assert any(a in target.parents or a == target for a in allowed), (target, allowed)
        assert any(target.rglob("*")), target  # the tablespace's files are there
    return links


def test_tablespaces_are_backed_up_and_restored_into_other_node_counts(
    pg_cluster, make_target, tmp_path
):
    cluster, servers = pg_cluster
    static = create_static_tables(servers)
    sources = {
        f"shard-{i + 1}": set(give_tablespaces(s, tmp_path / "disks" / f"shard-{i + 1}").values())
        for i, s in enumerate(servers)
    }
    full = cluster.backup()
    assert full.status == "SUCCEEDED", full.cause
    loads = [start_pgbench(server, clients=2, seconds=120, rate=LOAD_TPS) for server in servers]
    try:
        time.sleep(2)
        incremental = cluster.backup(incremental=True)
    finally:
        for load in loads:
            stop_process(load)
    assert incremental.status == "SUCCEEDED", incremental.cause
    history = {f"shard-{i + 1}": history_rows(s.psql) for i, s in enumerate(servers)}
    records = {r["backup_id"]: r for r in cluster.records()}
    newest = records[incremental.record["backup_id"]]
    # The incremental read the changed tablespace's pages by their LSN, not the whole files.
    assert newest["data_screened_bytes"] > 0

    # Into one node: both shards' tablespaces in its restore_dir, apart from each other.
    one = make_target(nodes=1, engine="postgres")
    restored = one.restore(cluster.name, backup_id=incremental.record["backup_id"])
    assert restored.status == "SUCCEEDED", restored.cause
    area = one.restore_dir(0) / DEFAULT_AREA
    placed = [
        check_restored(shard, static, history, sources, [area])
        for shard in output(restored)["shards"]
    ]
    assert len({d for links in placed for d in links.values()}) == 4

    # Into three nodes, shard-1's fast tablespace remapped to an allowed directory of the
    # operator's; a remap outside the agents' restore_link_dirs is refused before anything.
    allowed = tmp_path / "ssd"
    three = make_target(nodes=3, engine="postgres", agent={"restore_link_dirs": [str(allowed)]})
    elsewhere = tmp_path / "elsewhere" / "fast"
    refused = three.restore(
        cluster.name, backup_id=incremental.record["backup_id"],
        tablespaces={"shard-1:fast": str(elsewhere)},
    )  # fmt: skip
    assert refused.status == "FAILED"
    assert "restore_link_dirs" in (refused.cause or ""), refused.cause
    assert not elsewhere.exists()
    remap = allowed / "shard-1-fast"
    remapped = three.restore(
        cluster.name,
        backup_id=incremental.record["backup_id"],
        tablespaces={"shard-1:fast": str(remap)},
    )
    assert remapped.status == "SUCCEEDED", remapped.cause
    for shard in output(remapped)["shards"]:
        node = next(i for i, c in enumerate(three.configs) if c["node_id"] == shard["node_id"])
        links = check_restored(
            shard, static, history, sources, [three.restore_dir(node) / DEFAULT_AREA, remap]
        )
        assert (remap in links.values()) == (shard["shard_id"] == "shard-1")
        # The server's user owns what it writes to, as in its data directory.
        for target in links.values():
            assert os.stat(target).st_uid == os.stat(shard["path"]).st_uid

    # A restore over the one-node copy (replace) removes the tablespaces it replaced.
    again = one.restore(cluster.name, backup_id=full.record["backup_id"], replace=True)
    assert again.status == "SUCCEEDED", again.cause
    now = {d for s in output(again)["shards"] for d in tablespace_links(Path(s["path"])).values()}
    assert len(now) == 4
    for links in placed:
        for old in links.values():
            assert not old.exists(), old
    assert set(area.glob("*/*/*")) == now


def make_tablespace(server: PostgresInstance, name: str, directory: Path) -> None:
    directory.mkdir(parents=True)
    give_to_postgres(directory)
    ensure_traversable(directory)
    server.psql(f"CREATE TABLESPACE {name} LOCATION '{directory}'")


def tree_state(root: Path) -> dict[str, tuple[int, int]]:
    return {
        p.relative_to(root).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
    }


def test_a_point_in_time_restore_replays_into_tablespaces_but_not_into_one_made_after_its_base(
    archiving, make_target, tmp_path
):
    """A restore to the archive's end replays the writes into a tablespace the base held.
    A tablespace created after the base would be re-created by the replay in its source
    location, which on the source's own host is the source's live directory: the restore is
    refused by name before a byte is written, and that directory is left as it was."""
    node = archiving(delay=0.2)
    node.start_agent()
    make_tablespace(node.server, "fast", tmp_path / "disks" / "fast")
    node.server.psql("CREATE TABLE marks (n int PRIMARY KEY, at timestamptz) TABLESPACE fast")
    backup = node.backup()
    assert backup.status == "SUCCEEDED", backup.cause
    write_marks(node)
    settle(node)
    into = make_target(nodes=1, engine="postgres")

    progress = into.restore(node.cluster, target={"latest": True})

    assert progress.status == "SUCCEEDED", progress.cause
    assert restored_marks(progress) == [*range(MARKS), 1000]
    (shard,) = output(progress)["shards"]
    (placed,) = tablespace_links(Path(shard["path"])).values()
    assert into.restore_dir(0) / DEFAULT_AREA in placed.parents

    later = tmp_path / "disks" / "later"
    make_tablespace(node.server, "later", later)
    node.server.psql("CREATE TABLE more TABLESPACE later AS SELECT generate_series(1, 500) g")
    node.wait_archived(node.server.psql("SELECT pg_walfile_name(pg_switch_wal())"))
    before = tree_state(later)
    elsewhere = make_target(nodes=1, engine="postgres")

    refused = elsewhere.restore(node.cluster, target={"latest": True})

    assert refused.status == "FAILED"
    assert "was created after the base backup" in (refused.cause or ""), refused.cause
    assert str(later) in refused.cause
    assert tree_state(later) == before
    assert not any(elsewhere.restore_dir(0).iterdir())

    # Once its directory is gone (the tablespace dropped), the replay gets as far as the
    # creation, and the restore fails naming it.
    node.server.psql("DROP TABLE more")
    node.server.psql("DROP TABLESPACE later")
    shutil.rmtree(later)
    node.wait_archived(node.server.psql("SELECT pg_walfile_name(pg_switch_wal())"))

    reached = elsewhere.restore(node.cluster, target={"latest": True})

    assert reached.status == "FAILED"
    assert "reached the creation of tablespace" in (reached.cause or ""), reached.cause
    assert not later.exists()
