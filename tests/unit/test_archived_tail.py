"""An archived tail's WAL: which of the archive's batches a backup copies, and where a restore
lays each of their files (shardvault.backup.archived)."""

from __future__ import annotations

from typing import Any

import pytest

from shardvault.backup import archived
from shardvault.contracts.models import Phase, ShardListing
from shardvault.errors import WalNotArchived

SEG = 16 * 1024 * 1024


def name(number: int, on_timeline: int = 1) -> str:
    return f"{on_timeline:08X}00000000{number:08X}"


def batch(batch_id: str, *files: str) -> dict[str, Any]:
    return {
        "batch_id": batch_id.ljust(32, "0"),
        "cluster": "c",
        "shard_id": "s1",
        "key": f"c/_wal/s1/{files[0]}--{files[-1]}--{batch_id}",
        "files": [{"name": f, "size": SEG, "pushed_at": 1.0} for f in files],
    }


@pytest.fixture
def archive(monkeypatch) -> list[dict[str, Any]]:
    """The shard's archive as ``archived_batches`` reads it (since a segment)."""
    indexes: list[dict[str, Any]] = []

    def read(svc, cluster, shard_id, since=""):
        return [i for i in indexes if max(f["name"][:24] for f in i["files"]) >= since]

    monkeypatch.setattr(archived, "archived_batches", read)
    return indexes


def test_the_batches_that_hold_the_range_are_copied_and_no_later_one(archive) -> None:
    archive += [
        batch("a", name(1), name(2)),  # before the backup, but for its first segment
        batch("b", name(3), name(4)),
        batch("c", name(5)),  # archived while the backup waited: not needed
    ]
    found = archived.covering(None, "c", "s1", name(2), name(4))  # type: ignore[arg-type]
    assert [b["batch_id"][0] for b in found] == ["a", "b"]


@pytest.mark.parametrize(
    ("held", "reach"),
    [
        ([(3, 4)], f"does not hold {name(2)}"),  # the first segment is missing
        ([(2, 2), (4, 4)], f"runs to {name(2)}"),  # a gap
        ([(2, 3)], f"runs to {name(3)}"),  # short of the last segment
    ],
)
def test_an_archive_without_the_whole_range_fails_the_backup_by_name(
    archive, held: list[tuple[int, int]], reach: str
) -> None:
    archive += [batch(str(i), *(name(n) for n in range(a, b + 1))) for i, (a, b) in enumerate(held)]
    with pytest.raises(WalNotArchived) as raised:
        archived.covering(None, "c", "s1", name(2), name(4))  # type: ignore[arg-type]
    assert reach in raised.value.message
    assert f"from {name(2)} to {name(4)}" in raised.value.message


def test_the_restore_reads_the_range_from_pg_wal_and_nothing_before_it_or_twice() -> None:
    batches = [
        batch("a", name(1), name(2), f"{name(2)}.00000028.backup"),
        batch("b", name(2), name(3), "00000002.history"),  # name(2) pushed again
    ]
    files, offsets = archived.stream_files(batches, name(2))
    assert [f.path for f in files] == [
        f"{archived.TAIL_EXTRAS}/{'a'.ljust(32, '0')}/{name(1)}",  # before the first segment
        f"pg_wal/{name(2)}",
        f"pg_wal/{name(2)}.00000028.backup",
        f"{archived.TAIL_EXTRAS}/{'b'.ljust(32, '0')}/{name(2)}",  # a second copy
        f"pg_wal/{name(3)}",
        "pg_wal/00000002.history",
    ]
    assert offsets == [0, 3 * SEG]
    assert archived.TAIL_EXTRAS.startswith(".shardvault-wal/")  # removed once recovered


def test_only_a_tail_that_names_the_archive_is_archived() -> None:
    marker = {"stop_wal": name(3)}

    def listing(phase: Phase, **more: str) -> ShardListing:
        return ShardListing(
            shard_id="s1", node_id="n1", phase=phase, files=[], marker=marker | more
        )

    assert archived.wal_range(listing(Phase.TAIL)) is None  # the WAL is in the tail itself
    wal = {"archived_from": name(2), "archived_through": name(4)}
    assert archived.wal_range(listing(Phase.DATA, **wal)) is None
    assert archived.wal_range(listing(Phase.TAIL, **wal)) == (name(2), name(4))
