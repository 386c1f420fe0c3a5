"""Point-in-time restores' choices (shardvault.wal.pitr, shardvault.wal.archive): which backup,
which archived WAL, and where the archive stops reaching."""

from __future__ import annotations

from pathlib import Path

import pytest
from shardvault_agent.engines.postgres.restore import recovery_to_target

from shardvault.contracts.models import (
    Engine,
    Manifest,
    ManifestShard,
    RestoreRequest,
    RestoreTarget,
)
from shardvault.contracts.wal_archive import WAL_DIR
from shardvault.errors import InvalidRequest, TargetOutOfRange, TargetUnsupported
from shardvault.wal import pitr
from shardvault.wal.archive import cutoffs, expired_keys, shard_archive, wal_stream
from tests.unit.support import backup_item

SEG = 16 * 1024 * 1024


def name(number: int, tli: int = 1) -> str:
    return f"{tli:08X}{number // 256:08X}{number % 256:08X}"


def index(batch_id: str, numbers: list[int], pushed: float = 0.0, tli: int = 1) -> dict:
    return {
        "batch_id": batch_id,
        "files": [{"name": name(n, tli), "size": SEG, "pushed_at": pushed + n} for n in numbers],
    }


def history(batch_id: str, tli: int) -> dict:
    return {"batch_id": batch_id, "files": [{"name": f"{tli:08X}.history", "size": 42}]}


def test_the_archive_reaches_as_far_as_its_segments_run_without_a_gap() -> None:
    indexes = [index("a", [3, 4]), index("b", [5, 6]), index("c", [8, 9]), index("z", [1])]
    found = shard_archive("s1", name(4), indexes)
    assert (found.first, found.last) == (name(4), name(6))
    assert found.reaches == 6.0  # the push of segment 6: 7 is missing, 8 and 9 do not count
    assert [b["batch_id"] for b in found.batches] == ["a", "b"]
    assert shard_archive("s1", name(7), indexes).last is None  # its first segment is missing


def test_the_run_crosses_the_high_parts_step() -> None:
    found = shard_archive("s1", name(255), [index("a", [255, 256, 257])])
    assert found.last == name(257) == "000000010000000100000001"


def test_the_run_follows_a_promotion_into_the_newer_timeline() -> None:
    # Promoted in segment 6: timeline 1 never finished it; timeline 2 goes on from there.
    indexes = [
        index("a", [4, 5]),
        history("h", 2),
        index("b", [6, 7], tli=2),
        index("x", [2, 3], tli=3),  # a history-less timeline: not this archive's lineage
    ]
    found = shard_archive("s1", name(4), sorted(indexes, key=lambda i: i["files"][0]["name"]))
    assert found.last == name(7, tli=2)
    assert [b["batch_id"] for b in found.batches] == ["a", "h", "b"]  # its history file too
    assert found.reaches == 7.0
    # Without the history file the new timeline is not followed: the run stops at 5.
    assert shard_archive("s1", name(4), [index("a", [4, 5]), index("b", [6], tli=2)]).last == (
        name(5)
    )


def test_a_plan_says_how_much_wal_it_downloads() -> None:
    found = shard_archive("s1", name(4), [index("a", [3, 4]), index("b", [5]), index("c", [9])])
    assert pitr.replayed([found]) == (2, 3 * SEG)  # batches a and b: the run's


def test_a_segment_both_timelines_hold_is_the_newer_ones() -> None:
    indexes = [index("a", [4, 5, 6]), history("h", 2), index("b", [6, 7], tli=2)]
    found = shard_archive("s1", name(4), indexes)
    assert found.last == name(7, tli=2)
    assert found.newest == name(7, tli=2)


def test_a_file_two_batches_hold_is_placed_once_and_its_copy_aside() -> None:
    files, offsets = wal_stream([index("a", [3, 4]), index("b", [4, 5])])
    assert [f.path for f in files] == [
        f"{WAL_DIR}/",
        f"{WAL_DIR}/{name(3)}",
        f"{WAL_DIR}/{name(4)}",
        f"{WAL_DIR}/dup/b/{name(4)}",
        f"{WAL_DIR}/{name(5)}",
    ]
    assert offsets == [0, 2 * SEG]


BACKUPS = [
    backup_item(backup_id="20261123T010000Z-aaaaaa", status="COMPLETE", completed_at=1000.0),
    backup_item(backup_id="20261123T020000Z-bbbbbb", status="COMPLETE", completed_at=2000.0),
    backup_item(backup_id="20261123T030000Z-cccccc", status="FAILED", completed_at=2500.0),
]


def request(**fields) -> RestoreRequest:
    return RestoreRequest.model_validate({"cluster": "c", "target_cluster": "t", **fields})


def test_the_base_is_the_newest_complete_backup_before_the_target() -> None:
    at = {"time": "1970-01-01T00:40:00+00:00"}  # 2400 s
    assert pitr.base_backup(request(target=at), BACKUPS).backup_id.endswith("bbbbbb")
    early = {"time": "1970-01-01T00:20:00+00:00"}  # 1200 s: only the first had completed
    assert pitr.base_backup(request(target=early), BACKUPS).backup_id.endswith("aaaaaa")
    latest = pitr.base_backup(request(target={"latest": True}), BACKUPS)
    assert latest.backup_id.endswith("bbbbbb")


def test_a_target_before_every_backup_or_the_named_one_is_refused() -> None:
    before = {"time": "1970-01-01T00:10:00+00:00"}  # 600 s
    with pytest.raises(TargetOutOfRange, match="the oldest completed at 1970-01-01T00:16:40"):
        pitr.base_backup(request(target=before), BACKUPS)
    named = request(target={"time": "1970-01-01T00:20:00+00:00"}, backup_id=BACKUPS[1].backup_id)
    with pytest.raises(TargetOutOfRange, match="bbbbbb that completed before"):
        pitr.base_backup(named, BACKUPS)


ONE_SHARD = [
    backup_item(backup_id=f"2026112{i}T000000Z-aaaaaa", completed_at=i * 100.0,
                wal_from={"s1": name(10 * i)})
    for i in range(1, 4)
]  # fmt: skip


def test_an_lsn_target_starts_from_the_newest_backup_whose_wal_ends_before_it() -> None:
    def base(lsn: str, **fields) -> str:
        return pitr.base_backup(request(target={"lsn": lsn}, **fields), ONE_SHARD).backup_id

    assert base(f"0/{21 * SEG:X}").startswith("20261122")  # segment 21: after 20, not 30
    assert base(f"0/{20 * SEG + 8:X}").startswith("20261121")  # inside backup 2's last segment
    with pytest.raises(TargetOutOfRange, match="no complete backup whose WAL ends before LSN"):
        base(f"0/{5 * SEG:X}")
    with pytest.raises(TargetOutOfRange, match="no complete backup 20261123T000000Z-aaaaaa"):
        base(f"0/{25 * SEG:X}", backup_id=ONE_SHARD[2].backup_id)
    two = [b.model_copy(update={"wal_from": {"s1": name(1), "s2": name(1)}}) for b in ONE_SHARD]
    with pytest.raises(TargetUnsupported, match="has 2 shards"):
        pitr.base_backup(request(target={"lsn": "0/5000000"}), two)


def test_a_restore_point_starts_from_the_backup_of_its_name_or_the_newest() -> None:
    def base(point: str, **fields) -> str:
        return pitr.base_backup(request(target={"name": point}, **fields), ONE_SHARD).backup_id

    assert base(ONE_SHARD[0].backup_id) == ONE_SHARD[0].backup_id  # a backup's own cut
    assert base("before-migration") == ONE_SHARD[2].backup_id  # newest, as pgBackRest
    older = base("before-migration", backup_id=ONE_SHARD[1].backup_id)
    assert older == ONE_SHARD[1].backup_id


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ({"lsn": "0/3000060; DROP"}, "is not a WAL position"),
        ({"name": "it's"}, "cannot name a restore point"),
        ({"name": "a", "latest": True}, "exactly one"),
    ],
)
def test_a_malformed_target_is_refused_by_name(target, message) -> None:
    with pytest.raises(InvalidRequest, match=message):
        request(target=target)


def test_an_lsn_past_the_archive_is_refused_naming_the_lsn_range() -> None:
    archive = shard_archive("s1", name(4), [index("a", [4, 5])])
    base = manifest({"start_wal": name(2), "cut_lsn": "0/4000100"})
    target = RestoreTarget(lsn=f"0/{6 * SEG:X}")
    with pytest.raises(TargetOutOfRange, match="range is LSN 0/4000100 to 0/6000000"):
        pitr.past_lsn(target, archive, base)
    pitr.past_lsn(RestoreTarget(lsn=f"0/{6 * SEG - 1:X}"), archive, base)  # inside: no error


def manifest(marker: dict[str, str]) -> Manifest:
    shard = ManifestShard(shard_id="s1", node_id="n1", marker=marker, checkpoint_at=0, streams=[])
    return Manifest.model_construct(
        backup_id="b1", cluster="c", engine=Engine.POSTGRES, shards=[shard]
    )


def test_the_first_segment_is_the_one_the_backups_wal_ends_in() -> None:
    cut = {"start_wal": name(2), "cut_lsn": "0/5000100", "stop_wal": name(4)}
    assert pitr.first_segment(manifest(cut), "s1") == name(5)
    assert pitr.first_segment(manifest({"stop_wal": name(4)}), "s1") == name(4)
    with pytest.raises(TargetUnsupported, match="older than point-in-time"):
        pitr.first_segment(manifest({}), "s1")


def test_recovery_reads_the_placed_archive_and_stops_at_the_target() -> None:
    wal_dir = Path("/srv/re stored/s1") / WAL_DIR
    text = recovery_to_target(wal_dir, {"target_time": "2026-11-23T14:02:59+00:00"})
    # The feed's command, its directory quoted for the shell, then for postgresql.conf.
    assert f"restore_command = 'd=''{wal_dir}''; f=\"%f\";" in text
    assert "recovery_target_time = '2026-11-23T14:02:59+00:00'\n" in text
    assert "recovery_target_action = 'promote'\n" in text
    assert "recovery_target_lsn = '0/3000060'\n" in recovery_to_target(
        wal_dir, {"target_lsn": "0/3000060"}
    )
    assert "recovery_target_name = 'before-drop'\n" in recovery_to_target(
        wal_dir, {"target_name": "before-drop"}
    )
    assert "recovery_target_" not in recovery_to_target(wal_dir, {}).replace("_timeline", "")
    with pytest.raises(ValueError, match="Invalid isoformat"):
        recovery_to_target(wal_dir, {"target_time": "2026-11-23'; restore_command = 'rm -rf /"})
    with pytest.raises(ValueError, match="is not an LSN"):
        recovery_to_target(wal_dir, {"target_lsn": "0/1'\nrestore_command = 'sh"})
    with pytest.raises(InvalidRequest, match="cannot name a restore point"):
        recovery_to_target(wal_dir, {"target_name": "x'\nrestore_command = 'sh"})


def test_the_archive_keeps_what_a_restore_inside_its_window_needs() -> None:
    day = 86400.0
    backups = [
        backup_item(backup_id=f"2026112{i}T000000Z-aaaaaa", completed_at=i * day,
                    wal_from={"s1": name(10 * i)})
        for i in range(1, 6)
    ]  # fmt: skip
    assert cutoffs(backups) == {"s1": name(10)}  # back to the oldest kept backup
    # A window of 2.5 days on day 5.5: a target at day 3 starts from the day-3 backup.
    assert cutoffs(backups, window_days=2.5, now=5.5 * day) == {"s1": name(30)}
    assert cutoffs([backups[0].model_copy(update={"wal_from": {}})]) == {}  # before the record
    keys = [
        f"r/c/_wal/s1/{name(3)}--{name(9)}--{'a' * 32}.wal",
        f"r/c/_wal/s1/{name(9)}--{name(11)}--{'b' * 32}.wal",
        f"r/c/_wal/s1/00000002.history--00000002.history--{'c' * 32}.json",
        f"r/c/_wal/s1/{name(8)}--{name(9)}.00000028.backup--{'d' * 32}.json",
    ]
    assert expired_keys(keys, {"s1": name(10)}) == [keys[0], keys[3]]
