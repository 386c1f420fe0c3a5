"""Linked directories (PostgreSQL tablespaces): the request's remaps checked by name, and a
target node's placements made, refused, and removed with their restore or copy."""

from __future__ import annotations

from pathlib import Path

import pytest
from shardvault_agent.config import AgentConfig
from shardvault_agent.restore import linked

from shardvault.contracts.commands import ShardLayout
from shardvault.contracts.links import LINKS_MARKER, LinkedDir, encode, linked_dirs, remaps
from shardvault.errors import InvalidRequest, TargetNotEmpty

FAST = LinkedDir(path="pg_tblspc/16385", name="fast", source="/mnt/ssd/fast")
SLOW = LinkedDir(path="pg_tblspc/16386", name="slow", source="/mnt/hdd/slow")


def test_the_marker_round_trips_and_a_marker_without_links_lists_none():
    marker = {LINKS_MARKER: encode([SLOW, FAST]), "start_lsn": "0/2000028"}
    assert linked_dirs(marker) == [FAST, SLOW]
    assert linked_dirs({"start_lsn": "0/2000028"}) == []


def test_remaps_by_name_and_by_shard():
    shards = {"shard-1": [FAST, SLOW], "shard-2": [SLOW]}
    assert remaps({"fast": "/restore/fast"}, shards) == {
        "shard-1": {"pg_tblspc/16385": "/restore/fast"}
    }
    assert remaps({"shard-2:slow": "/r/s2", "shard-1:slow": "/r/s1"}, shards) == {
        "shard-2": {"pg_tblspc/16386": "/r/s2"},
        "shard-1": {"pg_tblspc/16386": "/r/s1"},
    }


@pytest.mark.parametrize(
    ("requested", "says", "fix"),
    [
        ({"cold": "/r/c"}, "'cold' is not in the backup", "shard-1:fast"),
        ({"shard-9:fast": "/r/f"}, "no shard 'shard-9'", "shard-1, shard-2"),
        ({"slow": "/r/s"}, "in shards shard-1, shard-2", "--tablespace shard-1:slow=DIR"),
        ({"fast": "relative/dir"}, "not a plain absolute path", "absolute directory"),
        ({"fast": "/r/../etc"}, "not a plain absolute path", "absolute directory"),
        ({"fast": "/r/a\nb"}, "not a plain absolute path", "control characters"),
        ({"fast": "/r/x", "shard-2:slow": "/r/x"}, "more than one tablespace", "of its own"),
    ],
)
def test_a_remap_that_cannot_be_placed_is_refused_by_name(requested, says, fix):
    with pytest.raises(InvalidRequest, match=says) as refused:
        remaps(requested, {"shard-1": [FAST, SLOW], "shard-2": [SLOW]})
    assert fix in refused.value.fix


def agent(tmp_path: Path, allowed: list[Path]) -> AgentConfig:
    return AgentConfig(
        node_id="n1",
        cluster="c1",
        engine="postgres",
        shards=[],
        state_dir=tmp_path / "state",
        restore_dir=tmp_path / "restore",
        restore_link_dirs=allowed,
    )


def layout(links: dict[str, str] | None = None) -> ShardLayout:
    marker = {LINKS_MARKER: encode([FAST, SLOW])}
    return ShardLayout(shard_id="shard-1", streams=[], marker=marker, links=links or {})


def test_placements_default_to_restore_dir_and_a_remap_must_be_allowed(tmp_path):
    ssd = tmp_path / "ssd"
    config = agent(tmp_path, [ssd])
    placed = linked.placements(config, "r1", layout({FAST.path: str(ssd / "fast")}))
    assert placed == {
        FAST.path: ssd / "fast",
        SLOW.path: tmp_path / "restore" / ".linked" / "r1" / "shard-1" / "16386",
    }
    for outside in (tmp_path / "elsewhere", tmp_path / "restore" / "shard-2"):
        with pytest.raises(InvalidRequest, match="restore_link_dirs") as refused:
            linked.placements(config, "r1", layout({FAST.path: str(outside)}))
        assert "restore_link_dirs in the node's agent configuration" in refused.value.fix
    (tmp_path / "link-to-etc").symlink_to("/etc")
    config = agent(tmp_path, [tmp_path])  # a link out of an allowed directory leads elsewhere
    with pytest.raises(InvalidRequest, match="restore_link_dirs"):
        linked.placements(config, "r1", layout({FAST.path: str(tmp_path / "link-to-etc" / "x")}))
    with pytest.raises(InvalidRequest, match="overlaps"):
        linked.placements(config, "r1", layout({FAST.path: str(tmp_path / "restore" / "x")}))


def test_links_are_made_once_and_a_directory_holding_data_is_refused_first(tmp_path):
    state, root = tmp_path / "state" / "r1.links.json", tmp_path / "staging"
    state.parent.mkdir()
    ssd = tmp_path / "ssd"
    (ssd / "fast").mkdir(parents=True)  # an empty mount point of the operator's
    placed = {FAST.path: ssd / "fast", SLOW.path: tmp_path / "area" / "16386"}
    linked.lay_out(state, root, "shard-1", placed)
    assert (root / FAST.path).resolve() == ssd / "fast"
    assert (root / SLOW.path).resolve() == tmp_path / "area" / "16386"
    (root / FAST.path / "PG_15_1").mkdir()  # bytes written through the link
    linked.lay_out(state, root, "shard-1", placed)  # a retried prepare keeps them
    assert (ssd / "fast" / "PG_15_1").is_dir()
    busy = tmp_path / "busy"
    (busy / "data").mkdir(parents=True)
    with pytest.raises(TargetNotEmpty, match="already holds data"):
        linked.lay_out(
            state, tmp_path / "other", "shard-2", {SLOW.path: tmp_path / "new", FAST.path: busy}
        )
    assert not (tmp_path / "new").exists()  # checked before anything was made


def test_an_abort_removes_what_the_restore_placed_and_keeps_the_operators_mount(tmp_path):
    config = agent(tmp_path, [tmp_path / "ssd"])
    state = tmp_path / "state" / "restores" / "r1.links.json"
    state.parent.mkdir(parents=True)
    mount = tmp_path / "ssd" / "fast"
    mount.mkdir(parents=True)
    made = tmp_path / "ssd" / "made-by-restore"
    placed = linked.placements(
        config, "r1", layout({FAST.path: str(mount), SLOW.path: str(made)})
    ) | {"pg_tblspc/16387": tmp_path / "restore" / ".linked" / "r1" / "shard-1" / "16387"}
    linked.lay_out(state, tmp_path / "staging", "shard-1", placed)
    for directory in placed.values():
        (directory / "PG_15_1").mkdir()
    linked.remove_placed(state, config.restore_dir, "r1")
    assert not state.exists()  # the record goes last
    assert mount.is_dir()
    assert not any(mount.iterdir())
    assert not made.exists()
    assert not (tmp_path / "restore" / ".linked").exists()
    assert (tmp_path / "restore").is_dir()


def test_a_replaced_copy_goes_with_its_default_tablespaces_not_the_operators(tmp_path, caplog):
    restore_dir = tmp_path / "restore"
    copy = restore_dir / ".incoming" / "r2" / "shard-1.replaced"
    ours = restore_dir / ".linked" / "r1" / "shard-1" / "16385"
    theirs = tmp_path / "ssd" / "fast"
    for directory in (copy / "pg_tblspc", ours / "PG_15_1", theirs / "PG_15_1"):
        directory.mkdir(parents=True)
    (copy / "pg_tblspc" / "16385").symlink_to(ours)
    (copy / "pg_tblspc" / "16386").symlink_to(theirs)
    linked.remove_with_copy(copy, restore_dir)
    assert not copy.exists()
    assert not (restore_dir / ".linked").exists()
    assert (theirs / "PG_15_1").is_dir()
    assert str(theirs) in caplog.text
    assert "left in place" in caplog.text


def test_the_archive_names_tablespaces_made_after_the_base_and_recovery_reaching_one():
    from shardvault_agent.engines.postgres.tablespaces import creation_reached

    from shardvault.wal.archive import ShardArchive
    from shardvault.wal.pitr import created_after

    later = {"pg_tblspc/16390": "/mnt/later"}
    batches = [
        {"links": None},  # an agent that does not say
        {"links": {FAST.path: FAST.source}},
        {"links": {FAST.path: FAST.source} | later},
        {"links": {}},  # dropped again: its creation is still in the WAL before
    ]
    archive = ShardArchive("shard-1", "0" * 24, "1" * 24, 0.0, batches, batches)
    assert created_after(archive, {LINKS_MARKER: encode([FAST])}) == later
    assert created_after(archive, {}) == {FAST.path: FAST.source} | later
    log = (
        'FATAL:  directory "/mnt/later" does not exist\n'
        "CONTEXT:  WAL redo at 0/30 for Tablespace/CREATE"
    )
    reached = creation_reached(log, later, "shard-1")
    assert reached is not None
    assert "reached the creation of tablespace pg_tblspc/16390" in reached.message
    assert "a backup taken after it" in reached.fix
    assert creation_reached("FATAL: something else", later, "shard-1") is None


def test_a_restore_that_may_replay_a_creation_into_an_existing_directory_is_refused(tmp_path):
    from shardvault.contracts.commands import Recovery
    from shardvault.errors import TargetUnsupported

    exists = tmp_path / "source-later"
    exists.mkdir()
    shard = ShardLayout(
        shard_id="shard-1",
        streams=[],
        recovery=Recovery(created_links={"pg_tblspc/16390": str(exists)}),
    )
    with pytest.raises(TargetUnsupported, match="was created after the base backup") as refused:
        linked.refuse_created(shard, "n1")
    assert f"where {exists} does not exist" in refused.value.fix
    exists.rmdir()
    linked.refuse_created(shard, "n1")  # elsewhere the replay stops at it, if it gets there


def test_restore_link_dirs_must_be_absolute_and_apart_from_the_nodes_own_data(tmp_path):
    from shardvault_agent.config import ShardConfig, placement_problems

    config = agent(tmp_path, [Path("relative"), tmp_path / "state" / "x", tmp_path / "pg"])
    config = config.model_copy(
        update={"shards": [ShardConfig(shard_id="s1", data_dir=tmp_path / "pg" / "data")]}
    )
    problems = placement_problems(config)
    assert any("restore_link_dirs: relative is relative" in p for p in problems)
    assert any(f"{tmp_path / 'state' / 'x'} overlaps {tmp_path / 'state'}" in p for p in problems)
    assert any(f"{tmp_path / 'pg'} overlaps {tmp_path / 'pg' / 'data'}" in p for p in problems)
