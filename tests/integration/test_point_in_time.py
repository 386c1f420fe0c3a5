"""Point-in-time restores (shardvault.wal.pitr): a backup, then the WAL archive replayed to a
target, on a real PostgreSQL whose WAL the agent archives continuously.

Checked in the restored server itself: a marker row written every quarter second after the
backup, each stamped with the source's clock; a restore to a time between two markers holds
every marker up to the earlier one and none after it."""

from __future__ import annotations

import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest

from shardvault.contracts.wal_archive import WAL_DIR
from shardvault.local.postgres import restored_instance

from .conftest import output

MARKS = 12


def write_marks(node, count: int = MARKS, start: int = 0) -> list[datetime]:
    """Marker rows start..count-1, a quarter second apart, a segment switch every third;
    the commit times of all markers so far by the source's clock."""
    node.server.psql("CREATE TABLE IF NOT EXISTS marks (n int PRIMARY KEY, at timestamptz)")
    for n in range(start, count):
        node.server.psql(f"INSERT INTO marks VALUES ({n}, clock_timestamp())")
        if n % 3 == 2:
            node.server.psql("SELECT pg_switch_wal()")
        time.sleep(0.25)
    rows = node.server.psql("SELECT at FROM marks ORDER BY n").splitlines()
    return [datetime.fromisoformat(r) for r in rows]


def after(times: list[datetime], n: int) -> datetime:
    """Halfway between marker ``n``'s commit and the next one's: a restore to it holds 0..n."""
    return times[n] + (times[n + 1] - times[n]) / 2


def settle(node) -> None:
    """Everything written so far in the archive: a last segment switched and stored."""
    node.server.psql("INSERT INTO marks VALUES (1000, clock_timestamp())")  # a commit after all
    last = node.server.psql("SELECT pg_walfile_name(pg_switch_wal())")
    node.wait_archived(last)
    time.sleep(0.1)


def restored_marks(progress) -> list[int]:
    summary = output(progress)
    (shard,) = summary["shards"]
    return [int(n) for n in restored_instance(shard).psql("SELECT n FROM marks ORDER BY n").split()]


@pytest.fixture
def archived(archiving):
    return backed_up_and_archived(archiving)


def backed_up_and_archived(archiving, **policy: str):
    """A node backed up, then MARKS markers written and archived after the backup."""
    node = archiving(delay=0.2, **policy)
    node.start_agent()
    node.server.psql("CREATE TABLE marks (n int PRIMARY KEY, at timestamptz)")
    backup = node.backup()
    assert backup.status == "SUCCEEDED", backup.cause
    times = write_marks(node)
    settle(node)
    return node, backup, times


def test_a_restore_to_a_time_holds_what_was_committed_up_to_it_and_nothing_after(
    archived, make_target
) -> None:
    node, _, times = archived
    target = after(times, 6)
    into = make_target(nodes=1, engine="postgres")

    progress = into.restore(node.cluster, target={"time": target.isoformat()})

    assert progress.status == "SUCCEEDED", progress.cause
    assert restored_marks(progress) == list(range(7))
    (shard,) = output(progress)["shards"]
    assert shard["recovered_to"] == target.isoformat()
    assert shard["recovery_target"] == "time"  # what the CLI's table shows as it is
    assert shard["checks"]["pg_amcheck --all"] == "ok"


def test_a_restore_to_the_latest_wal_holds_every_archived_commit(archived, make_target) -> None:
    node, _, _ = archived
    into = make_target(nodes=1, engine="postgres")
    plan = into.restore(node.cluster, target={"latest": True}, plan_only=True)
    assert plan.status == "SUCCEEDED", plan.cause
    archived_wal = sum(f["size"] for b in node.batches() for f in b["files"])
    assert 0 < plan.record["wal_bytes"] <= archived_wal  # what it will download, said first

    progress = into.restore(node.cluster, target={"latest": True})

    assert progress.status == "SUCCEEDED", progress.cause
    assert restored_marks(progress) == [*range(MARKS), 1000]


def test_a_restore_with_replace_replaces_the_running_copy_of_an_earlier_one(
    archived, make_target
) -> None:
    node, _, times = archived
    into = make_target(nodes=1, engine="postgres")
    target = after(times, 2)
    first = into.restore(node.cluster, target={"time": target.isoformat()})
    assert first.status == "SUCCEEDED", first.cause
    (copy,) = output(first)["shards"]
    assert restored_marks(first) == list(range(3))

    again = into.restore(node.cluster, target={"latest": True}, replace=True)

    assert again.status == "SUCCEEDED", again.cause  # the running copy kept it from starting
    assert restored_marks(again) == [*range(MARKS), 1000]
    assert servers_of(copy["path"]) == 1  # the first copy's server was stopped, not left


def servers_of(data_dir: str) -> int:
    """How many PostgreSQL servers were started on ``data_dir`` and still run."""
    ps = subprocess.run(
        ["ps", "-ww", "-eo", "stat=,args="], capture_output=True, text=True, check=True
    )
    lines = ps.stdout.splitlines()  # a zombie (Z) was stopped; only its parent must reap it
    return sum(1 for line in lines if not line.startswith("Z") and f" -D {data_dir} " in line)


def test_a_target_outside_the_archive_is_refused_naming_the_range(archived, make_target) -> None:
    node, backup, times = archived
    into = make_target(nodes=1, engine="postgres")
    before = datetime.fromtimestamp(float(backup.record["completed_at"]) - 3600).astimezone()
    after = times[-1].replace(year=times[-1].year + 1)
    for when, phrase in ((before, "no complete backup"), (after, "restorable range is from")):
        progress = into.restore(node.cluster, target={"time": when.isoformat()})
        assert progress.status == "FAILED"
        assert progress.error == "TargetOutOfRange", progress.cause
        assert phrase in progress.cause, progress.cause
        assert into.records() == []  # refused before anything was written


def test_a_restore_to_a_restore_point_or_an_lsn_stops_there(archiving, make_target) -> None:
    node = archiving(delay=0.2)
    node.start_agent()
    node.server.psql("CREATE TABLE marks (n int PRIMARY KEY, at timestamptz)")
    assert node.backup().status == "SUCCEEDED"
    write_marks(node, 4)
    node.server.psql("SELECT pg_create_restore_point('before-four')")  # an operator's mark
    write_marks(node, 8, start=4)
    lsn = node.server.psql("SELECT pg_current_wal_insert_lsn()")  # just after marker 7
    write_marks(node, start=8)
    settle(node)

    by_name = make_target(nodes=1, engine="postgres").restore(
        node.cluster, target={"name": "before-four"}
    )
    assert by_name.status == "SUCCEEDED", by_name.cause
    assert restored_marks(by_name) == list(range(4))
    (shard,) = output(by_name)["shards"]
    assert (shard["recovery_target"], shard["recovered_to"]) == ("name", "before-four")

    by_lsn = make_target(nodes=1, engine="postgres").restore(node.cluster, target={"lsn": lsn})
    assert by_lsn.status == "SUCCEEDED", by_lsn.cause
    assert restored_marks(by_lsn) == list(range(8))

    unknown = make_target(nodes=1, engine="postgres").restore(
        node.cluster, target={"name": "never-made"}
    )
    assert unknown.error == "TargetOutOfRange", unknown.cause
    assert "holds no restore point named 'never-made'" in unknown.cause


def test_a_restore_follows_the_archive_across_a_promotion(archiving, make_target) -> None:
    """The source is promoted after its backup (as a failover or a restore in place does):
    the archive goes on in a new timeline, and a restore to a time after the promotion
    replays the old timeline to it, then the new one."""
    node = archiving(delay=0.2)
    node.start_agent()
    node.server.psql("CREATE TABLE marks (n int PRIMARY KEY, at timestamptz)")
    assert node.backup().status == "SUCCEEDED"
    write_marks(node, 6)
    promote_in_place(node)
    times = write_marks(node, start=6)
    settle(node)
    assert "00000002.history" in node.archived()
    target = after(times, 8)
    into = make_target(nodes=1, engine="postgres")

    progress = into.restore(node.cluster, target={"time": target.isoformat()})

    assert progress.status == "SUCCEEDED", progress.cause
    assert restored_marks(progress) == list(range(9))
    (shard,) = output(progress)["shards"]
    # Promoted once more at the target: the copy's own timeline is the third.
    assert restored_instance(shard).psql("SELECT timeline_id FROM pg_control_checkpoint()") == "3"


def promote_in_place(node) -> None:
    """Stops the source and starts it in archive recovery from its own pg_wal: at its end
    PostgreSQL promotes it into timeline 2 (and archives the history file)."""
    node.server.stop()
    with open(node.server.data_dir / "postgresql.auto.conf", "a") as conf:
        conf.write("restore_command = 'false'\n")
    (node.server.data_dir / "recovery.signal").touch()
    node.server.start()
    deadline = time.monotonic() + 60
    while node.server.psql("SELECT pg_is_in_recovery()") != "f":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert node.server.psql("SELECT timeline_id FROM pg_control_checkpoint()") == "2"


def test_a_sqlite_cluster_says_it_has_no_point_in_time(make_cluster, make_target) -> None:
    cluster = make_cluster(nodes=1, size_mb=1)
    assert cluster.backup().status == "SUCCEEDED"
    into = make_target(nodes=1)
    progress = into.restore(cluster.name, target={"latest": True})
    assert progress.error == "TargetUnsupported", progress.cause
    assert "keeps no WAL archive" in progress.cause


def test_a_sealed_cluster_restores_to_a_time_through_each_batchs_own_key(
    archiving, make_target
) -> None:
    node, _, times = backed_up_and_archived(archiving, encryption="kms")
    assert all(b["encryption"] for b in node.batches())  # sealed, each under its data key
    target = after(times, 3)
    into = make_target(nodes=1, engine="postgres")

    progress = into.restore(node.cluster, target={"time": target.isoformat()})

    assert progress.status == "SUCCEEDED", progress.cause
    assert restored_marks(progress) == list(range(4))


def many_batches(archiving, count: int = 14) -> tuple:
    """A node backed up, then ``count`` markers, each followed by most of a segment of WAL
    and archived in a batch of its own. Full segments, as a real load writes them: segments
    a switch leaves nearly empty let recovery's read-ahead (``recovery_prefetch``, 512 kB of
    records) ask for many at once."""
    node = archiving(delay=0.1)
    node.start_agent()
    node.server.psql("CREATE TABLE marks (n int PRIMARY KEY, at timestamptz)")
    node.server.psql("CREATE TABLE pad (t text)")
    backup = node.backup()
    assert backup.status == "SUCCEEDED", backup.cause
    for n in range(count):
        node.server.psql(f"INSERT INTO marks VALUES ({n}, clock_timestamp())")
        node.server.psql(
            "INSERT INTO pad SELECT repeat(md5(g::text), 40) FROM generate_series(1, 9000) g"
        )
        last = node.server.psql("SELECT pg_walfile_name(pg_switch_wal())")
        node.wait_archived(last)
    settle(node)
    rows = node.server.psql("SELECT at FROM marks WHERE n < 1000 ORDER BY n").splitlines()
    return node, [datetime.fromisoformat(r) for r in rows]


def test_recovery_is_fed_only_what_it_reaches_and_a_few_batches_ahead(
    archiving, make_target
) -> None:
    node, times = many_batches(archiving)
    into = make_target(nodes=1, engine="postgres")

    progress = into.restore(node.cluster, target={"time": after(times, 1).isoformat()})

    assert progress.status == "SUCCEEDED", progress.cause
    assert restored_marks(progress) == [0, 1]
    summary = output(progress)
    archived = len(node.batches())  # every batch the archive holds, the base's own too
    assert 8 < summary["wal_batches"] <= archived
    # The batches up to the target's (a few), and AHEAD more at most: not the archive.
    assert 0 < summary["wal_batches_fetched"] <= summary["wal_batches"] - 4
    (shard,) = summary["shards"]
    assert shard["wal"]["fetched"] == summary["wal_batches_fetched"]
    assert not (Path(shard["path"]) / WAL_DIR).exists()  # replayed, then removed
    assert not any((into.restore_dir(0) / ".incoming").glob("**/*.wal"))  # no landing left


def test_a_damaged_batch_fails_recovery_with_its_own_error_not_a_short_copy(
    archived, make_target
) -> None:
    node, _, _ = archived
    svc = node.stack.services()
    batch = node.batches()[-2]  # one recovery to the archive's end needs
    body = svc.store_s3.get_object(Bucket=svc.store.bucket, Key=batch["key"])["Body"].read()
    damaged = body[:40] + bytes([body[40] ^ 0xFF]) + body[41:]
    svc.store_s3.put_object(Bucket=svc.store.bucket, Key=batch["key"], Body=damaged)
    into = make_target(nodes=1, engine="postgres")

    progress = into.restore(node.cluster, target={"latest": True})

    # Not promoted at the batch before it, as "the end of the archive" would have been.
    assert progress.status == "FAILED"
    assert progress.error in ("ChecksumMismatch", "FrameUnreadable"), progress.cause
    (record,) = into.records()
    assert batch["key"] in record["cause"]
    assert not [p for p in into.restore_dir(0).iterdir() if not p.name.startswith(".")]
    assert not list(into.restore_dir(0).glob("*/postmaster.pid"))  # no server left running
