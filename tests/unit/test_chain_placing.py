"""A node places a restored chain in the background from prepare on: prepare answers before the
chain is placed, every download of the shard waits for it, an agent restarted since prepare
places it again from its state, and a chain that does not hold every byte fails the restore on
the node by name (as a damaged object does), for every later command too."""

from __future__ import annotations

import pytest
from shardvault_agent.config import AgentConfig
from shardvault_agent.restore import Restorer

from shardvault.chains import place_chain
from shardvault.errors import ParentUnavailable
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


def test_a_chain_is_placed_after_prepare_and_again_after_a_restart(tmp_path):
    node = restorer(tmp_path)
    prepare(node, CHAIN)
    node._await_placement("r1", "s1")
    placed = saved(node)
    assert len(placed) == 2  # the full's object and the incremental's
    expected = place_chain(CHAIN, root_first=True)
    assert sorted(len(v) // 8 for v in placed.values()) == sorted(
        len(v) for v in expected.placements.values()
    )

    # An agent restarted before its placement was saved: the next download places it again.
    node._placed_marker("r1", "s1").unlink()
    for path in (node.state("r1") / "objects").glob("*.placements"):
        path.unlink()
    restarted = restorer(tmp_path)
    restarted._await_placement("r1", "s1")
    assert saved(restarted) == placed


def test_a_chain_that_misses_bytes_fails_the_restore_by_name(tmp_path):
    node = restorer(tmp_path)
    # The incremental claims a block past its one object: the manifests disagree.
    damaged = [CHAIN[0], member("incr1", [(BLOCK, BLOCK)])]
    damaged[1]["extents"] = pack_extents([(BLOCK, 2 * BLOCK)])
    prepare(node, damaged)  # answers: the chain is placed in the background

    with pytest.raises(ParentUnavailable, match="none of its objects"):
        node._await_placement("r1", "s1")
    with pytest.raises(ParentUnavailable, match="none of its objects"):
        node.finish({"backup_id": "r1", "shard_ids": ["s1"]})  # recorded for every command
    assert not node._placed_marker("r1", "s1").exists()


def test_an_aborted_restore_leaves_no_placements(tmp_path):
    node = restorer(tmp_path)
    node.abort({"backup_id": "r1"})
    node.state("r1").mkdir(parents=True)
    node._place("r1", "s1", {"chain": CHAIN, "root_first": True})  # a job that ran late
    assert not (node.state("r1") / "objects").exists()
