"""A 3-node PostgreSQL cluster backed up while pgbench writes to every node.

The backup is read back per its manifest, then each copy is started by a real PostgreSQL: it
must recover from its own backup label and WAL, pass pg_amcheck, and satisfy pgbench's
invariants (every transaction moves the same delta into accounts, tellers, branches and
history), which only a consistent copy does.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path

import psycopg
import pytest

from shardvault.assurance.verify import VerifyRequest, verify
from shardvault.aws.materialize import materialize
from shardvault.aws.readback import load_manifest
from shardvault.client import operations as ops
from shardvault.contracts.models import BackupRequest
from shardvault.contracts.pgwal import lsn_number
from shardvault.local.postgres import (
    PostgresInstance,
    attach_instance,
    restored_instance,
    start_pgbench,
    stop_process,
)

from .conftest import Cluster, client_of, entered_states, output, run_cli, running_pg_cluster

SCALE = 5
# Each server's write load, in transactions a second: writes go on through every backup, while
# the machine keeps room for the backup (unbounded, three pgbench loads and their backends took
# both cores of CI's machine and a 3-node incremental of this small cluster 25 s).
LOAD_TPS = 150


@pytest.fixture
def pg_cluster(stack, tmp_path):
    with running_pg_cluster(stack, tmp_path, nodes=3, scale=SCALE) as running:
        yield running  # the cluster, and its servers: shard-1, shard-2, ...


def file_map(root: Path) -> dict[str, int]:
    return {
        p.relative_to(root).as_posix(): p.stat().st_size for p in root.rglob("*") if p.is_file()
    }


def test_backup_under_pgbench_load_reads_back_and_recovers_consistently(pg_cluster, tmp_path):
    cluster, servers = pg_cluster
    loads = [start_pgbench(server, clients=2, seconds=120, rate=LOAD_TPS) for server in servers]
    started = time.time()
    try:
        time.sleep(1)  # the load is running before the backup starts
        progress = cluster.backup()
    finally:
        for load in loads:
            stop_process(load)
    assert progress.status == "SUCCEEDED", progress.cause

    svc = cluster.stack.services()
    manifest = load_manifest(svc.store_bucket, progress.record["manifest_key"])
    roots = materialize(manifest, svc.store_bucket, tmp_path / "readback")

    for shard in manifest.shards:
        root = roots[shard.shard_id]
        source = cluster.sources[shard.shard_id]
        listed = {
            f.path: f.size for s in shard.streams for f in s.files if not f.path.endswith("/")
        }
        # The read-back tree is exactly the checkpointed files, at their checkpointed sizes.
        assert file_map(root) == listed
        assert "pg_wal" in {p.name for p in root.iterdir()}
        assert (root / "backup_label").read_text().startswith("START WAL LOCATION")
        # Files that nothing wrote during the backup are byte-identical to the source.
        unchanged = [
            rel
            for rel in listed
            if (source / rel).exists() and (source / rel).stat().st_mtime < started - 1
        ]
        assert len(unchanged) > 100
        for rel in unchanged:
            assert (root / rel).read_bytes() == (source / rel).read_bytes(), rel

    for shard_id, root in roots.items():
        check_recovered_copy(root, shard_id)


def check_recovered_copy(root: Path, shard_id: str) -> None:
    instance = attach_instance(root)
    try:
        # Recovery from the backup label and the WAL in the backup reached consistency.
        assert instance.psql("SELECT pg_is_in_recovery()") == "f"
        counts = instance.psql("SELECT count(*) FROM pgbench_accounts")
        assert counts == str(SCALE * 100_000), shard_id
        sums = instance.psql(
            "SELECT (SELECT coalesce(sum(abalance), 0) FROM pgbench_accounts), "
            "(SELECT coalesce(sum(tbalance), 0) FROM pgbench_tellers), "
            "(SELECT coalesce(sum(bbalance), 0) FROM pgbench_branches), "
            "(SELECT coalesce(sum(delta), 0) FROM pgbench_history), "
            "(SELECT count(*) FROM pgbench_history)"
        ).split("|")
        assert len(set(sums[:4])) == 1, f"{shard_id}: inconsistent balances {sums}"
        assert int(sums[4]) > 0, f"{shard_id}: the load wrote nothing before the checkpoint"
        check = subprocess.run(
            [
                str(instance.bin_dir / "pg_amcheck"),
                "-h", str(instance.socket_dir), "-p", str(instance.port), "-U", "postgres",
                "--all", "--install-missing", "--heapallindexed",
            ],
            capture_output=True,
            text=True,
            check=False,
        )  # fmt: skip
        assert check.returncode == 0, check.stdout + check.stderr
    finally:
        instance.stop()


def test_a_killed_agent_ends_the_backup_and_postgres_leaves_backup_mode(pg_cluster):
    cluster, servers = pg_cluster
    victim = cluster.configs[0]["node_id"]
    execution = cluster.start_backup()
    # Kill the agent once the checkpoint is held: PostgreSQL must end the backup itself
    # (the session, and its temporary replication slot, die with the agent).
    deadline = time.monotonic() + 60
    while not any(
        p.name.endswith(".data.json")
        for p in Path(cluster.configs[0]["state_dir"]).glob("backups/*/*")
    ):
        assert time.monotonic() < deadline, "the checkpoint was never taken"
        time.sleep(0.05)
    cluster.stack.stop_agent(victim, kill=True)
    progress = ops.wait_backup(cluster.client, execution, interval=0.2, timeout=300)
    assert progress.status == "FAILED"
    (record,) = cluster.records()
    assert victim in record["cause"]  # the timeout names the node whose agent went silent
    assert "restart the agent" in record["cause"]
    assert cluster.open_uploads() == []
    assert cluster.store_keys() == []
    for server in servers:
        assert server.psql("SELECT count(*) FROM pg_replication_slots") == "0"
        # No agent session (which held backup mode) is left on any server. A killed client's
        # backend exits when it next reads its socket, and a live agent's heartbeat checks
        # connect briefly: wait a little for both, not forever.
        sessions = (
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'shardvault-agent'"
        )
        deadline = time.monotonic() + 30
        while (left := server.psql(sessions)) != "0" and time.monotonic() < deadline:
            time.sleep(0.5)
        assert left == "0"


STATIC_DIGEST = "SELECT md5(string_agg(id || ':' || v, ',' ORDER BY id)) FROM static_check"
HISTORY = "SELECT tid, bid, aid, delta, mtime FROM pgbench_history"
ROW_BALANCES = [
    ("pgbench_accounts", "aid", "abalance"),
    ("pgbench_tellers", "tid", "tbalance"),
    ("pgbench_branches", "bid", "bbalance"),
]


def create_static_tables(servers) -> dict[str, str]:
    """A table no load touches, in every source; returns each shard's ordered digest."""
    for server in servers:
        server.psql(
            "CREATE TABLE static_check AS SELECT g AS id, md5(g::text) AS v "
            "FROM generate_series(1, 20000) g"
        )
    return {f"shard-{i + 1}": s.psql(STATIC_DIGEST) for i, s in enumerate(servers)}


def check_consistent_copy(
    instance: PostgresInstance,
    shard_id: str,
    static: dict[str, str],
    source_history: dict[str, set[str]],
) -> None:
    """The copy equals its source at one point in time: recovered, the untouched table equal
    by ordered hash, pgbench's history a subset of the source's, and TPC-B's balances equal
    to the history's deltas, in total and row by row."""
    assert instance.psql("SELECT pg_is_in_recovery()") == "f"
    assert instance.psql(STATIC_DIGEST) == static[shard_id]
    history = history_rows(instance.psql)
    assert history, shard_id
    assert history <= source_history[shard_id], shard_id
    sums = instance.psql(
        "SELECT (SELECT sum(abalance) FROM pgbench_accounts), "
        "(SELECT sum(tbalance) FROM pgbench_tellers), "
        "(SELECT sum(bbalance) FROM pgbench_branches), "
        "(SELECT sum(delta) FROM pgbench_history)"
    ).split("|")
    assert len(set(sums)) == 1, f"{shard_id}: inconsistent balances {sums}"
    # Row by row: every balance (0 after pgbench -i) is the sum of the restored history's
    # deltas for it, the source's state at the consistency point for every row.
    for table, key, column in ROW_BALANCES:
        mismatched = instance.psql(
            f"SELECT count(*) FROM {table} t LEFT JOIN (SELECT {key}, sum(delta) AS d "
            f"FROM pgbench_history GROUP BY {key}) h USING ({key}) "
            f"WHERE t.{column} <> coalesce(h.d, 0)"
        )
        assert mismatched == "0", f"{shard_id}: {mismatched} rows of {table} disagree"


def history_rows(psql) -> set[str]:
    return set(psql(HISTORY).splitlines())


@pytest.mark.parametrize("target_nodes", [2, 4])
def test_a_backup_under_load_restores_into_another_node_count(
    pg_cluster, make_target, target_nodes
):
    """The restored data equals the source's at the backup's consistency point: tables the
    load does not touch are equal by an ordered hash; pgbench's history (append-only) holds
    only rows the source holds, and the balances agree with it (TPC-B's invariants), which only
    a copy consistent at one point in time does."""
    cluster, servers = pg_cluster
    static = create_static_tables(servers)
    loads = [start_pgbench(server, clients=2, seconds=120, rate=LOAD_TPS) for server in servers]
    try:
        time.sleep(1)
        backup = cluster.backup()
    finally:
        for load in loads:
            stop_process(load)
    assert backup.status == "SUCCEEDED", backup.cause
    source_history = {f"shard-{i + 1}": history_rows(s.psql) for i, s in enumerate(servers)}
    target = make_target(nodes=target_nodes, engine="postgres")

    restored = target.restore(
        cluster.name, validation_queries=["SELECT count(*) > 0 FROM static_check"]
    )

    assert restored.status == "SUCCEEDED", restored.cause
    summary = output(restored)
    assert summary["validation"] == "passed"
    shards = {s["shard_id"]: s for s in summary["shards"]}
    assert sorted(shards) == ["shard-1", "shard-2", "shard-3"]
    used = {s["node_id"] for s in shards.values()}
    assert len(used) == min(target_nodes, 3)  # balanced: one shard per node while nodes last
    for shard_id, shard in shards.items():
        assert shard["checks"]["pg_amcheck --all"] == "ok", shard
        check_consistent_copy(restored_instance(shard), shard_id, static, source_history)
    ports = {(s["node_id"], s["port"]) for s in shards.values()}
    assert len(ports) == 3  # instances sharing a node listen on distinct ports
    # The target's agents adopted the servers they restored: the new cluster is backed up
    # as it is, several instances on one node included.
    execution = ops.start_backup(client_of(target.stack), BackupRequest(cluster=target.name))
    protected = ops.wait_backup(client_of(target.stack), execution, interval=0.2, timeout=600)
    assert protected.status == "SUCCEEDED", protected.cause
    assert output(protected)["shards"] == ["shard-1", "shard-2", "shard-3"]


def test_an_incremental_chain_under_load_restores_consistently_into_two_nodes(
    pg_cluster, make_target
):
    """Full, pgbench writes, incremental, more writes, incremental (depth 2): the restore of
    the last one into 2 nodes recovers to a consistent copy (pg_amcheck, TPC-B invariants row
    by row, an untouched table equal by ordered hash), and the incremental sent less than the
    full."""
    cluster, servers = pg_cluster
    static = create_static_tables(servers)
    full = cluster.backup()
    assert full.status == "SUCCEEDED", full.cause
    last = full
    for _ in range(2):
        loads = [start_pgbench(server, clients=2, seconds=120, rate=LOAD_TPS) for server in servers]
        try:
            time.sleep(2)
            last = cluster.backup(incremental=True)
        finally:
            for load in loads:
                stop_process(load)
        assert last.status == "SUCCEEDED", last.cause
    records = {r["backup_id"]: r for r in cluster.records()}
    newest, first = records[last.record["backup_id"]], records[full.record["backup_id"]]
    assert (newest["kind"], newest["depth"]) == ("incremental", 2)
    # A busy small database: pgbench touches many of its pages; still less than a full.
    assert newest["data_bytes"] < first["data_bytes"]
    # Files unchanged since the parent (template databases, the static tables) are not read,
    # nor the pages of changed tables whose LSN is older than the parent's start.
    assert newest["data_read_bytes"] < first["data_read_bytes"]
    assert newest["data_screened_bytes"] > 0
    source_history = {f"shard-{i + 1}": history_rows(s.psql) for i, s in enumerate(servers)}
    target = make_target(nodes=2, engine="postgres")

    restored = target.restore(cluster.name, backup_id=last.record["backup_id"])

    assert restored.status == "SUCCEEDED", restored.cause
    for shard in output(restored)["shards"]:
        assert shard["checks"]["pg_amcheck --all"] == "ok", shard
        check_consistent_copy(restored_instance(shard), shard["shard_id"], static, source_history)


def test_an_encrypted_synthesized_full_under_load_restores_consistently_into_two_nodes(
    pg_cluster, make_target, policy_for
):
    """Full, then under pgbench writes an incremental and a full the policy synthesizes (the
    nodes send only their changes; the chain is copied in the store), all sealed under the
    chain's key: the synthesized full restores into 2 nodes to a consistent copy (pg_amcheck,
    TPC-B invariants row by row, an untouched table equal by ordered hash)."""
    cluster, servers = pg_cluster
    policy_for(
        cluster.name, engine="postgres", encryption="kms", incremental="{synthesized_fulls: 1}"
    )
    static = create_static_tables(servers)
    full = cluster.backup()
    assert full.status == "SUCCEEDED", full.cause
    made = []
    for request in ({"incremental": True}, {}):
        loads = [start_pgbench(server, clients=2, seconds=120, rate=LOAD_TPS) for server in servers]
        try:
            time.sleep(2)
            made.append(cluster.backup(**request))
        finally:
            for load in loads:
                stop_process(load)
        assert made[-1].status == "SUCCEEDED", made[-1].cause
    records = {r["backup_id"]: r for r in cluster.records()}
    synthesized, first = records[made[-1].record["backup_id"]], records[full.record["backup_id"]]
    assert synthesized["kind"] == "full"
    assert synthesized["synthesized_from"] == made[0].record["backup_id"]
    assert synthesized["data_bytes"] < first["data_bytes"]
    assert synthesized["data_read_bytes"] < first["data_read_bytes"]
    manifest = load_manifest(
        cluster.stack.services().vault_bucket, synthesized["vault_manifest_key"]
    )
    assert manifest.encryption is not None
    assert (
        manifest.encryption.wrapped_key
        == load_manifest(
            cluster.stack.services().vault_bucket, first["vault_manifest_key"]
        ).encryption.wrapped_key
    )  # the chain's key, continued
    source_history = {f"shard-{i + 1}": history_rows(s.psql) for i, s in enumerate(servers)}
    target = make_target(nodes=2, engine="postgres")

    restored = target.restore(cluster.name, backup_id=synthesized["backup_id"])

    assert restored.status == "SUCCEEDED", restored.cause
    for shard in output(restored)["shards"]:
        assert shard["checks"]["pg_amcheck --all"] == "ok", shard
        check_consistent_copy(restored_instance(shard), shard["shard_id"], static, source_history)


def test_a_lone_nodes_incremental_stops_in_its_checkpoint_and_restores_consistently(
    stack, tmp_path, make_target, policy_for
):
    """One node: its incremental ends the backup in the Checkpoint command, once its changes
    are packed (no Stop state), and cuts there; under pgbench writes, its restore recovers to
    that restore point, consistent (pg_amcheck, TPC-B invariants, a static table equal)."""
    with running_pg_cluster(stack, tmp_path, nodes=1, scale=SCALE) as (cluster, servers):
        # Static: under the load the default (auto) steers it, and a paced scan reads its
        # screened pages instead of judging them through a mapping, which this test checks.
        policy_for(cluster.name, engine="postgres", upload="{throttle: static}")
        static = create_static_tables(servers)
        assert cluster.backup().status == "SUCCEEDED"
        (server,) = servers
        load = start_pgbench(server, clients=2, seconds=120, rate=LOAD_TPS)
        try:
            time.sleep(2)
            execution = cluster.start_backup(incremental=True)
            last = ops.wait_backup(cluster.client, execution, interval=0.2, timeout=600)
        finally:
            stop_process(load)
        assert last.status == "SUCCEEDED", last.cause
        assert "Stop" not in entered_states(execution)
        backup_id = last.record["backup_id"]
        (record,) = [r for r in cluster.records() if r["backup_id"] == backup_id]
        assert (record["kind"], record["data_packed"]) == ("incremental", True)
        assert record["cut_name"] == backup_id  # its restore point, made as it stopped
        # Its scan judged the changed relation files' pages through the agent's mapped screen.
        log = cluster.agent_log(cluster.configs[0]["node_id"])
        judged = re.search(r"unchanged by their headers, (\d+) bytes judged through a mapping", log)
        assert judged, "the scan screened nothing"
        assert int(judged[1]) > 0
        source_history = {"shard-1": history_rows(server.psql)}
        target = make_target(nodes=1, engine="postgres")

        restored = target.restore(cluster.name, backup_id=backup_id)

        assert restored.status == "SUCCEEDED", restored.cause
        (shard,) = output(restored)["shards"]
        assert shard["checks"]["pg_amcheck --all"] == "ok", shard
        check_consistent_copy(restored_instance(shard), "shard-1", static, source_history)


class Marks:
    """A row with the writer's clock every few milliseconds on each server, until stopped:
    where a restored copy's newest row lies tells where its recovery stopped."""

    EVERY = 0.005

    def __init__(self, servers: list[PostgresInstance]) -> None:
        for server in servers:
            server.psql("CREATE TABLE cut_marks (at double precision NOT NULL)")
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._write, args=(s,)) for s in servers]

    def _write(self, server: PostgresInstance) -> None:
        with psycopg.connect(server.conninfo, autocommit=True) as conn:
            while not self.stopping.wait(self.EVERY):
                conn.execute("INSERT INTO cut_marks VALUES (extract(epoch FROM clock_timestamp()))")

    def __enter__(self) -> Marks:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join()


COMMIT_LOCK = 4242
MARK_STALL = 1.0  # seconds a loaded machine may stall a Marks writer (a run saw 0.3)
APP_DATABASE = "bank"  # the application's database; the agents connect to postgres


class DistributedCommits:
    """Rounds of one row committed on every server, as an application's distributed commit
    does under the cut's commit pause (README: *The cut*): the commit lock taken shared on
    every server (``pg_try_advisory_lock_shared``: on a refusal, let go of all and retry, never
    hold one while waiting on another), the round's row committed on each in turn, the locks
    let go. A cut that pauses these commits restores every server with the same rounds.

    They run in database ``APP_DATABASE``, not the agents' (their conninfo names
    ``postgres``): advisory locks are per database, and the policy's ``cut.database`` is
    what makes the pause hold them."""

    def __init__(self, servers: list[PostgresInstance]) -> None:
        for server in servers:
            server.psql(f"CREATE DATABASE {APP_DATABASE}")
            server.psql("CREATE TABLE rounds (n int PRIMARY KEY)", dbname=APP_DATABASE)
        self.servers, self.stopping, self.done = servers, threading.Event(), 0
        self.thread = threading.Thread(target=self._commit)

    def _commit(self) -> None:
        conns = [
            psycopg.connect(s.conninfo, dbname=APP_DATABASE, autocommit=True) for s in self.servers
        ]
        try:
            while not self.stopping.is_set():
                held = []
                for conn in conns:
                    got = conn.execute("SELECT pg_try_advisory_lock_shared(%s)", (COMMIT_LOCK,))
                    if not got.fetchone()[0]:
                        break
                    held.append(conn)
                if len(held) == len(conns):
                    for conn in conns:
                        conn.execute("INSERT INTO rounds VALUES (%s)", (self.done,))
                    self.done += 1
                for conn in held:
                    conn.execute("SELECT pg_advisory_unlock_shared(%s)", (COMMIT_LOCK,))
                if len(held) < len(conns):
                    time.sleep(0.001)
        finally:
            for conn in conns:
                conn.close()

    def __enter__(self) -> DistributedCommits:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join()


def newest_mark(server: PostgresInstance) -> float:
    return float(server.psql("SELECT max(at) FROM cut_marks"))


def paused_backup(cluster: Cluster, tries: int = 3) -> dict:
    """The catalog record of a backup whose cut paused the distributed commits: a loaded
    machine may leave one best-effort (a node's lock came after another let go), which the
    record says; the next backup tries again."""
    for _ in range(tries):
        backup = cluster.backup()
        assert backup.status == "SUCCEEDED", backup.cause
        record = next(r for r in cluster.records() if r["backup_id"] == backup.record["backup_id"])
        assert isinstance(record["cut_paused"], bool), record
        if record["cut_paused"]:
            return record
    raise AssertionError(f"no cut of {tries} paused the commits: {record}")


def test_every_node_restores_to_the_backups_cut(pg_cluster, make_target, policy_for):
    """Under writes on all three nodes, the backup ends with one restore point per node at
    one instant (its name, skew and instants recorded); the restore recovers every node to it:
    each node's newest row was written just before its restore point, none after, so the
    nodes' restored states lie within the reported skew of each other. Without the cut each
    node would stop at the end of its own backup (pg_backup_stop), a second earlier here.
    The policy's commit lock pauses the distributed commits around the cut: every node comes
    back with the same rounds of them."""
    cluster, servers = pg_cluster
    policy_for(
        cluster.name,
        engine="postgres",
        cut=f"{{commit_lock: {COMMIT_LOCK}, database: {APP_DATABASE}}}",
    )
    with Marks(servers), DistributedCommits(servers) as commits:
        time.sleep(0.5)
        record = paused_backup(cluster)
        time.sleep(0.5)  # rows after the cut: none may come back
    assert commits.done > 100  # the commits went on through the backup
    assert record["cut_name"] == record["backup_id"]
    assert 0 < record["cut_pause_seconds"] < 0.1, record
    shown = run_cli(cluster.stack, "show", cluster.name, record["backup_id"])
    assert "commits paused at most" in shown.stdout, shown.stdout
    svc = cluster.stack.services()
    assert record["location"] == "vault"  # the policy's vault
    manifest = load_manifest(svc.vault_bucket, record["vault_manifest_key"])
    assert manifest.cut_name == record["backup_id"]
    cut_at = {s.shard_id: float(s.marker["cut_at"]) for s in manifest.shards}
    assert manifest.cut_skew_seconds == pytest.approx(
        max(cut_at.values()) - min(cut_at.values()), abs=1e-5
    )
    assert record["cut_skew_seconds"] == manifest.cut_skew_seconds
    assert record["cut_skew_seconds"] < 0.25  # one machine, one clock: scheduling alone
    # The cut came after every node's backup had ended (its margin), past its stop point.
    assert all(
        lsn_number(s.marker["cut_lsn"]) > lsn_number(s.marker["stop_lsn"]) for s in manifest.shards
    )
    # Verify finds every tail's WAL whole, from the backup's first segment to the cut's.
    request = VerifyRequest(cluster=cluster.name, backup_id=record["backup_id"])
    assert verify(request, svc, time.time())["result"] == "ok"

    target = make_target(nodes=3, engine="postgres")
    restored = target.restore(cluster.name, backup_id=record["backup_id"])

    assert restored.status == "SUCCEEDED", restored.cause
    newest = {}
    for shard in output(restored)["shards"]:
        assert shard["checks"]["recovered"] == "ok", shard
        assert shard["recovered_to"] == record["backup_id"]
        instance = restored_instance(shard)
        newest[shard["shard_id"]] = newest_mark(instance)
        # Recovered to the cut and opened: on a new timeline, writable.
        assert instance.psql("SELECT pg_is_in_recovery()") == "f"
        assert instance.psql("SELECT timeline_id FROM pg_control_checkpoint()") != "1"
    for shard_id, mark in newest.items():
        assert mark <= cut_at[shard_id], (shard_id, mark, cut_at)  # nothing after the cut
        # And all before it, but for a writer's stall: a recovery stopped at the checkpoint
        # would be seconds short (the cut comes after the data phase).
        assert mark > cut_at[shard_id] - MARK_STALL, (shard_id, mark, cut_at)
    spread = max(newest.values()) - min(newest.values())
    assert spread <= record["cut_skew_seconds"] + MARK_STALL, (newest, record["cut_skew_seconds"])
    rounds = {
        shard["shard_id"]: restored_instance(shard).psql(
            "SELECT count(*), max(n) FROM rounds", dbname=APP_DATABASE
        )
        for shard in output(restored)["shards"]
    }
    assert len(set(rounds.values())) == 1, rounds  # no round on one side of the cut only

    # The copies, on their new timeline, are backed up and restored in turn (their backup's
    # WAL is on timeline 2; recovery finds no history file for it, and needs none).
    client = client_of(target.stack)
    execution = ops.start_backup(client, BackupRequest(cluster=target.name))
    again = ops.wait_backup(client, execution, interval=0.2, timeout=600)
    assert again.status == "SUCCEEDED", again.cause
    second = make_target(nodes=1, engine="postgres")
    restored_again = second.restore(target.name, backup_id=again.record["backup_id"])
    assert restored_again.status == "SUCCEEDED", restored_again.cause
    for shard in output(restored_again)["shards"]:
        assert newest_mark(restored_instance(shard)) == newest[shard["shard_id"]]
