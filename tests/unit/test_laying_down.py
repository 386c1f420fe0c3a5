"""A node lays a restored shard down in the background from prepare on (its files at their final
sizes and, for a chain, each object's placements): every download and finish of the shard
waits for it, an agent restarted since prepare lays it down again from its state, and what
cannot be laid down (a chain that does not hold every byte, a file that cannot be created)
fails the restore on the node by name, for every later command too."""

from __future__ import annotations

import pytest
from shardvault_agent.config import AgentConfig
from shardvault_agent.restore import Restorer

from shardvault.chains import place_chain
from shardvault.errors import ParentUnavailable, TargetNotReady
from shardvault.extents import pack_extents
from shardvault.models import FileEntry, pack_files

BLOCK = 8192
FILES = [FileEntry(path="base/1", size=64 * BLOCK), FileEntry(path="base/2", size=16 * BLOCK)]
STREAM = sum(f.size for f in FILES)


def member(backup_id: str, extents: list[tuple[int, int]] | None) -> dict:
    length = STREAM if extents is None else sum(n for _, n in extents)
    return {
        "backup_id": backup_id,
        "files": pack_files(FILES),
        "extents": None if extents is None else pack_extents(extents),
        "objects": [
            {"key": f"{backup_id}/0", "stream_offset": 0, "length": length, "frame_size": BLOCK}
        ],
    }


CHAIN = [member("full", None), member("incr1", [(BLOCK, 2 * BLOCK), (70 * BLOCK, BLOCK)])]


def restorer(tmp_path) -> Restorer:
    config = AgentConfig(
        node_id="n1",
        cluster="c",
        engine="sqlite",
        shards=[],
        state_dir=tmp_path / "state",
        restore_dir=tmp_path / "restore",
    )
    config.restore_dir.mkdir(parents=True, exist_ok=True)
    return Restorer(config, downloader=None, keys=None)  # placing needs neither


def prepare(node: Restorer, chain: list[dict]) -> None:
    node.prepare(
        {
            "backup_id": "r1",
            "shards": [
                {
                    "shard_id": "s1",
                    "streams": [{"phase": "data", "files": pack_files(FILES)}],
                    "chain": chain,
                    "chain_root_first": True,
                }
            ],
        }
    )


def saved(node: Restorer) -> dict[str, bytes]:
    return {
        p.name: p.read_bytes() for p in sorted((node.state("r1") / "objects").glob("*.placements"))
    }


def test_a_shard_is_laid_down_after_prepare_and_again_after_a_restart(tmp_path):
    node = restorer(tmp_path)
    prepare(node, CHAIN)
    node._await_laid("r1", "s1")
    staging = node.staging("r1", "s1")
    assert {f.path: (staging / f.path).stat().st_size for f in FILES} == {
        f.path: f.size for f in FILES
    }
    placed = saved(node)
    assert len(placed) == 2  # the full's object and the incremental's
    expected = place_chain(CHAIN, root_first=True)
    assert sorted(len(v) // 8 for v in placed.values()) == sorted(
        len(v) for v in expected.placements.values()
    )

    # An agent restarted before the shard was laid down: the next download lays it down again.
    node._laid_marker("r1", "s1").unlink()
    for path in [*(node.state("r1") / "objects").glob("*.placements"), staging / "base/2"]:
        path.unlink()
    restarted = restorer(tmp_path)
    restarted._await_laid("r1", "s1")
    assert saved(restarted) == placed
    assert (staging / "base/2").stat().st_size == FILES[1].size


def test_a_chain_that_misses_bytes_fails_the_restore_by_name(tmp_path):
    node = restorer(tmp_path)
    # The incremental claims a block past its one object: the manifests disagree.
    damaged = [CHAIN[0], member("incr1", [(BLOCK, BLOCK)])]
    damaged[1]["extents"] = pack_extents([(BLOCK, 2 * BLOCK)])
    prepare(node, damaged)  # answers: the chain is placed in the background

    with pytest.raises(ParentUnavailable, match="none of its objects"):
        node._await_laid("r1", "s1")
    with pytest.raises(ParentUnavailable, match="none of its objects"):
        node.finish({"backup_id": "r1", "shard_ids": ["s1"]})  # recorded for every command
    assert not node._laid_marker("r1", "s1").exists()


def test_a_file_that_cannot_be_created_fails_the_restore_by_name(tmp_path):
    node = restorer(tmp_path)
    staging = node.staging("r1", "s1")
    staging.mkdir(parents=True)
    (staging / "base").write_text("a file where the shard has a directory")
    prepare(node, CHAIN)

    with pytest.raises(TargetNotReady, match="could not create shard s1's files"):
        node._await_laid("r1", "s1")
    with pytest.raises(TargetNotReady, match="could not create"):
        node.finish({"backup_id": "r1", "shard_ids": ["s1"]})


def test_an_aborted_restore_is_not_laid_down(tmp_path):
    node = restorer(tmp_path)
    node.abort({"backup_id": "r1"})
    node.state("r1").mkdir(parents=True)
    node._lay_down("r1", "s1", {"streams": []}, {"chain": CHAIN, "root_first": True})  # late
    assert not (node.state("r1") / "objects").exists()
    assert not node.staging("r1", "s1").exists()
