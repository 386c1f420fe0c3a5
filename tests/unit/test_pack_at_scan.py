"""A node packs its objects right after the command that lists them (an incremental's changes
at its scan, a tail and a full's block map at its stop), cut as the control plane cuts them
(``shardvault.backup.scanning``), and the plan takes those checksums only for the very objects
it plans (``shardvault.backup.planner.plan_items``)."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from shardvault_agent.backup.scan import scan_capture
from shardvault_agent.commands import Commands
from shardvault_agent.engines.sqlite.adapter import SqliteAdapter
from shardvault_agent.ratelimit import RateLimiter

from shardvault.backup.planner import (
    PhasePlan,
    packed_by_nodes,
    plan,
    plan_items,
    plan_stopped_with_checkpoint,
)
from shardvault.contracts.commands import AnswerReceipt, Listing
from shardvault.contracts.models import ObjectChecksums, Phase
from shardvault.data.checksums import crc64nvme_of_bytes, crc64nvme_of_stream
from shardvault.data.pipeline import frame_spans, plaintext_crc, unpack_frames
from shardvault.data.planning import MiB, blockmap_listings, listings_from_results, plan_objects
from shardvault.errors import AnswerMismatch
from tests.unit.support import catalog_item

from .support import (
    handle,
    lone_node_context,
    moto_services,
    requests_made,
    sqlite_agent,
    with_buckets,
)

PACK = {"cluster": "c", "prefix": "backups", "part_size": 8 * MiB, "compression": {}}
# The parent's block map as the control plane names it; its bytes are the test's own
# (``incremental_agent``), and it was made on another node (no block screen).
PARENT = {
    "backup_id": "parent",
    "object": {
        "key": "backups/c/parent/s1/blockmap/00000",
        "node_id": "n0",
        "shard_id": "s1",
        "phase": "blockmap",
        "index": 0,
        "stream_offset": 0,
        "length": 1,
        "part_size": 8 * MiB,
        "part_count": 1,
        "crc64nvme": "AAAAAAAAAAA=",
        "verified_by": "attributes",
    },
    "place": "c/parent/s1/blockmap/00000",
    "url": "https://store.invalid/parent.map",
    "marker": {},
    "node_id": "n0",
}


def incremental_agent(tmp_path: Path) -> tuple[Commands, Path]:
    """An agent whose shard s1 was backed up by ``parent`` (its block map made by a scan of
    that backup's capture), then changed: a few rows rewritten."""
    config = sqlite_agent(tmp_path, rows=600)
    cmds = Commands(
        config,
        SqliteAdapter(config),
        RateLimiter(None),
        sender=SimpleNamespace(),
    )
    handle(cmds, "checkpoint", {"backup_id": "parent", "shard_ids": ["s1"]})
    capture = cmds.backup.files.load_capture("parent", "s1", Phase.DATA)
    parent_map = tmp_path / "parent.map"
    scan_capture(capture.root, capture.files, RateLimiter(None), None, parent_map)
    cmds.backup.parent_map = lambda shard_id, parent: parent_map if parent else None  # type: ignore[method-assign]
    with sqlite3.connect(config.shards[0].path) as conn:
        conn.execute("UPDATE t SET x = randomblob(1024) WHERE rowid % 100 = 0")
    return cmds, parent_map


def checkpoint(cmds: Commands, backup_id: str, pack: dict[str, Any] | None) -> dict[str, Any]:
    args: dict[str, Any] = {
        "backup_id": backup_id,
        "shard_ids": ["s1"],
        "parents": {"s1": PARENT},
    }
    if pack is not None:
        args["pack"] = pack
    return handle(cmds, "checkpoint", args)


def planned(answer: dict[str, Any], backup_id: str, pack: dict[str, Any], phase=Phase.DATA):
    """What the control plane plans from a node's answer (its planner's own listings)."""
    listed = Listing.model_validate(answer)
    listings = listings_from_results([listed], phase) + blockmap_listings([listed])
    return plan_objects(backup_id=backup_id, listings=listings, **pack)


def test_an_incrementals_node_packs_the_objects_the_plan_will_hold(tmp_path: Path) -> None:
    cmds, _ = incremental_agent(tmp_path)
    answer = checkpoint(cmds, "b2", PACK)

    (shard,) = answer["shards"]
    assert 0 < shard["delta_bytes"] < shard["bytes"] / 10
    objects = planned(answer, "b2", PACK)
    items = plan_items(objects, packed_by_nodes([Listing.model_validate(answer)]))
    assert [item["object"]["phase"] for item in items] == ["data", "blockmap"]
    assert all(item["checksums"] for item in items)
    for item, obj in zip(items, objects, strict=True):
        sums = ObjectChecksums.model_validate(item["checksums"])
        frames = unpack_frames(sums.frames)
        assert cmds.backup.files.packed_path(obj).stat().st_size == sums.stored_length
        assert sum(frame.stored_size for frame in frames) == sums.stored_length
    # The block map packed is the one the scan wrote, byte for byte.
    blockmap = ObjectChecksums.model_validate(items[1]["checksums"])
    spans = frame_spans(unpack_frames(blockmap.frames), objects[1].frame_size, objects[1].length)
    with open(cmds.backup.files.map_path("b2", "s1"), "rb") as written:
        assert plaintext_crc(spans) == crc64nvme_of_stream(written)
    # The Upload map's pack of the same object is the packed copy, not another.
    packed_dir = cmds.backup.files.packed_path(objects[0]).parent
    before = {p: p.stat().st_mtime_ns for p in packed_dir.iterdir()}
    assert handle(cmds, "pack", {"object": items[0]["object"]}) == items[0]["checksums"]
    assert {p: p.stat().st_mtime_ns for p in before} == before


def test_a_retried_checkpoint_answers_the_same_packed_objects(tmp_path: Path) -> None:
    cmds, _ = incremental_agent(tmp_path)
    first = checkpoint(cmds, "b2", PACK)
    packed = cmds.backup.files.backup_dir("b2") / "packed"
    before = {p: p.stat().st_mtime_ns for p in packed.iterdir()}
    again = checkpoint(cmds, "b2", PACK)
    assert again["shards"][0]["packed"] == first["shards"][0]["packed"]
    assert {p: p.stat().st_mtime_ns for p in packed.iterdir()} == before  # not packed again


def test_a_checkpoint_taken_again_does_not_send_the_lost_ones_packed_copies(
    tmp_path: Path,
) -> None:
    """An agent restarted mid-backup takes a checkpoint it no longer holds anew (PostgreSQL's
    backup mode dies with the session). Its scan may plan the very same objects (the same
    blocks changed), but the lost checkpoint's packed bytes are older than the new start:
    they are packed again from the new capture."""
    cmds, _ = incremental_agent(tmp_path)
    first = checkpoint(cmds, "b2", PACK)
    packed = cmds.backup.files.backup_dir("b2") / "packed"
    lost = {p.name: p.stat().st_mtime_ns for p in packed.glob("*.bin")}
    shard = cmds.shards()["s1"]
    shutil.rmtree(cmds.engine.copy_dir("b2", shard))  # the hold is lost
    again = checkpoint(cmds, "b2", PACK)
    assert [p["object"] for p in again["shards"][0]["packed"]] == [
        p["object"] for p in first["shards"][0]["packed"]
    ]  # the same plan ...
    now = {p.name: p.stat().st_mtime_ns for p in packed.glob("*.bin")}
    assert set(now) == set(lost)
    assert all(now[name] != lost[name] for name in lost)  # ... packed again


def test_a_plan_other_than_the_packed_one_is_packed_again(tmp_path: Path) -> None:
    """A packed copy made for one plan is never sent under another (its summary names the
    plan it was packed for); the plan does not take checksums made for another cut."""
    cmds, _ = incremental_agent(tmp_path)
    answer = checkpoint(cmds, "b2", PACK)
    other = PACK | {"compression": {"level": 9}}
    objects = planned(answer, "b2", other)

    items = plan_items(objects, packed_by_nodes([Listing.model_validate(answer)]))
    assert [item["checksums"] for item in items] == [None, None]
    handle(cmds, "pack", {"object": items[0]["object"]})
    summary = json.loads(cmds.backup.files.packed_path(objects[0]).with_suffix(".json").read_text())
    assert summary["object"] == items[0]["object"]


def test_an_answer_whose_checksums_name_another_object_is_not_taken(tmp_path: Path) -> None:
    cmds, _ = incremental_agent(tmp_path)
    answer = checkpoint(cmds, "b2", PACK)
    (shard,) = answer["shards"]
    data, blockmap = shard["packed"]
    data["checksums"] = blockmap["checksums"]  # another object's

    items = plan_items(
        planned(answer, "b2", PACK), packed_by_nodes([Listing.model_validate(answer)])
    )
    assert items[0]["checksums"] is None
    assert items[1]["checksums"] is not None


def test_no_packing_without_the_request_nor_beyond_what_the_map_holds_at_once(
    tmp_path: Path,
) -> None:
    cmds, _ = incremental_agent(tmp_path)
    assert "packed" not in checkpoint(cmds, "b2", None)["shards"][0]
    # Parts so small that the change makes more objects than the Upload map holds at once.
    tiny = PACK | {"part_size": 64}
    assert "packed" not in checkpoint(cmds, "b3", tiny)["shards"][0]
    assert not list(Path(cmds.backup.files.backup_dir("b3")).rglob("*.bin"))


def test_a_full_packs_nothing_at_its_checkpoint(tmp_path: Path) -> None:
    cmds, _ = incremental_agent(tmp_path)
    answer = handle(
        cmds, "checkpoint", {"backup_id": "f2", "shard_ids": ["s1"], "parents": {}, "pack": PACK}
    )
    assert "packed" not in answer["shards"][0]  # its objects are packed in the Upload map


def test_a_fulls_stop_packs_its_block_map_as_the_tails_plan_cuts_it(tmp_path: Path) -> None:
    """A full's data is packed in the Upload map (its packs hash its blocks); its stop joins
    the block map from those hashes and packs it, with the tail (SQLite has none)."""
    cmds, _ = incremental_agent(tmp_path)
    answer = handle(cmds, "checkpoint", {"backup_id": "f2", "shard_ids": ["s1"], "parents": {}})
    for obj in planned(answer, "f2", PACK):
        handle(cmds, "pack", {"object": obj.model_dump(mode="json")})

    stopped = handle(cmds, "stop", {"backup_id": "f2", "shard_ids": ["s1"], "pack": PACK})

    objects = planned(stopped, "f2", PACK, Phase.TAIL)
    items = plan_items(objects, packed_by_nodes([Listing.model_validate(stopped)]))
    assert [item["object"]["phase"] for item in items] == ["blockmap"]
    (item,) = items
    assert item["checksums"] is not None
    assert cmds.backup.files.packed_path(objects[0]).exists()


STOP = {"stop": {"cut": {"name": "b2", "margin_seconds": 0.0, "commit_lock": None}}}


def counted_stops(cmds: Commands) -> list[str]:
    """The shards the engine is asked to stop, in order."""
    stops: list[str] = []
    stop = cmds.engine.stop

    def counting(shard, *args, **kwargs):
        stops.append(shard.shard_id)
        return stop(shard, *args, **kwargs)

    cmds.engine.stop = counting  # type: ignore[method-assign]
    return stops


def test_a_lone_nodes_checkpoint_stops_once_every_change_is_packed(tmp_path: Path) -> None:
    """Asked to (``stop``: the backup's only node), the checkpoint ends the backup right after
    packing, and answers the stop's listing too, its objects packed; retried, it neither
    stops again nor answers differently."""
    cmds, _ = incremental_agent(tmp_path)
    stops = counted_stops(cmds)
    args = {"backup_id": "b2", "shard_ids": ["s1"], "parents": {"s1": PARENT}}

    answer = handle(cmds, "checkpoint", args | {"pack": PACK} | STOP)

    assert stops == ["s1"]
    assert cmds.backup.files.capture_path("b2", "s1", Phase.TAIL).exists()
    stopped = answer["stopped"]
    assert [s["shard_id"] for s in stopped["shards"]] == ["s1"]
    assert planned(stopped, "b2", PACK, Phase.TAIL) == []  # SQLite: no tail; the map went with data
    assert len(answer["shards"][0]["packed"]) == 2  # the changes and the block map
    assert handle(cmds, "checkpoint", args | {"pack": PACK} | STOP) == answer
    assert stops == ["s1"]


def test_a_checkpoint_retried_after_its_stop_takes_nothing_again(tmp_path: Path) -> None:
    """PostgreSQL holds nothing once stopped (its backup session ended): a retried command
    (an agent restarted before it answered, a dispatch posted twice) must not start a new
    session and read the data after the stop; it answers what the first one did."""
    cmds, _ = incremental_agent(tmp_path)
    stops = counted_stops(cmds)
    checkpoints: list[str] = []
    checkpoint, holds = cmds.engine.checkpoint, cmds.engine.holds

    def counting(shard, *args, **kwargs):
        checkpoints.append(shard.shard_id)
        return checkpoint(shard, *args, **kwargs)

    cmds.engine.checkpoint = counting  # type: ignore[method-assign]

    def held(shard, backup_id):  # PostgreSQL's: its session ended once its tail was captured
        stopped = cmds.backup.files.stopped_before(backup_id, shard.shard_id)
        return holds(shard, backup_id) and not stopped

    cmds.engine.holds = held  # type: ignore[method-assign]
    args = {"backup_id": "b2", "shard_ids": ["s1"], "parents": {"s1": PARENT}}
    first = handle(cmds, "checkpoint", args | {"pack": PACK} | STOP)
    with sqlite3.connect(cmds.config.shards[0].path) as conn:  # written after the stop
        conn.execute("UPDATE t SET x = randomblob(1024)")

    again = handle(cmds, "checkpoint", args | {"pack": PACK} | STOP)

    assert (checkpoints, stops) == (["s1"], ["s1"])
    assert again == first


def test_a_change_too_large_to_pack_at_the_scan_is_stopped_by_the_stop_command(
    tmp_path: Path,
) -> None:
    """Its data is packed in the Upload map, before the stop: the checkpoint must not stop."""
    cmds, _ = incremental_agent(tmp_path)
    stops = counted_stops(cmds)
    tiny = PACK | {"part_size": 64}
    args = {"backup_id": "b3", "shard_ids": ["s1"], "parents": {"s1": PARENT}}

    answer = handle(cmds, "checkpoint", args | {"pack": tiny} | STOP)

    assert "stopped" not in answer
    assert stops == []
    assert not cmds.backup.files.capture_path("b3", "s1", Phase.TAIL).exists()


def test_a_plan_refuses_a_stop_whose_data_is_not_all_packed() -> None:
    """Data packed after the stop would be read after it: the backup fails instead."""
    answer = {"node_id": "n1", "shards": [], "stopped": {"node_id": "n1", "shards": []}}
    answers = [Listing.model_validate(answer)]
    unpacked = PhasePlan(items=[], objects=[], part_size=0, packed=False, update={})
    with pytest.raises(AnswerMismatch, match="n1 ended the backup in the Checkpoint command"):
        plan_stopped_with_checkpoint(None, answers, unpacked, {}, None)  # type: ignore[arg-type]


def test_a_lone_nodes_stopped_incremental_is_planned_with_one_read_one_update_and_one_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan step of a node that stopped in its Checkpoint command plans both phases from
    one read of the catalog record, records both in one update and writes one plan, the
    data's items first: each request a step of every small incremental waits for (one of
    moto's took 2 to 6 ms, DynamoDB's take milliseconds too)."""
    cmds, _ = incremental_agent(tmp_path)
    args = {"backup_id": "b2", "shard_ids": ["s1"], "parents": {"s1": PARENT}}
    answer = handle(cmds, "checkpoint", args | {"pack": PACK} | STOP)
    context = lone_node_context("b2", part_size=PACK["part_size"])
    with moto_services(monkeypatch, work_bucket="work") as svc:
        with_buckets(svc, "work", "store")
        svc.catalog.put(catalog_item({"cluster": "c", "backup_id": "b2", "status": "RUNNING"}))
        calls = requests_made(svc.catalog.table.meta.client, svc.work_s3, svc.store_s3)

        body = json.dumps(answer).encode()  # handed over as the agent hands it (run)
        key = svc.answer_key("b2", Phase.DATA, answer["node_id"])
        svc.work_s3.put_object(Bucket="work", Key=key, Body=body)
        receipt = AnswerReceipt(
            node_id=answer["node_id"],
            answer_bytes=len(body),
            answer_crc64nvme=crc64nvme_of_bytes(body),
        )
        calls.clear()

        summary = plan(context, [receipt.model_dump()], Phase.DATA, svc)

        assert summary["phase"] == "tail"
        assert calls.count("GetItem") == 1
        assert calls.count("UpdateItem") == 1
        assert calls.count("GetObject") == 1  # the answer; no plan read back
        plans = svc.work_s3.list_objects_v2(Bucket="work", Prefix="_work/b2/plans/")["Contents"]
        assert [p["Key"].rsplit("/", 1)[1] for p in plans] == ["tail.json"]
        items = svc.get_work(svc.work_key("b2", "plans", "tail.json"))
        phases = [item["object"]["phase"] for item in items]
        assert phases == ["data", "blockmap"]  # SQLite's tail is empty: its map went with data
        assert summary["objects"] == len(items)
        assert all(item["signed"] for item in items)  # one part each: signed at plan
        record = svc.catalog.get("c", "b2")
        assert record is not None
        assert record.data_packed is True
        assert record.objects_total == len(items)
        assert (record.data_objects, record.tail_objects) == (2, 0)
