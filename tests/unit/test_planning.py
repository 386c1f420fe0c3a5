"""Planning: part sizes from the data size, packing into objects, S3's limits."""

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardvault.contracts.models import FileEntry, Phase, ShardListing
from shardvault.data.planning import (
    ARCHIVE_MIN_OBJECTS,
    ARCHIVE_PART_SIZE,
    PARTS_PER_OBJECT,
    S3_MAX_PART_SIZE,
    S3_MAX_PARTS,
    S3_MIN_PART_SIZE,
    TRANSFER_CONCURRENCY_CEILING,
    TRANSFER_CONCURRENCY_FLOOR,
    GiB,
    MiB,
    TiB,
    check_part_size,
    choose_part_size,
    interleave_by_node,
    object_size_for,
    part_ranges,
    plan_objects,
    transfer_concurrency,
)
from shardvault.data.streams import StreamIndex
from shardvault.errors import InvalidRequest, PlanTooLarge


def listing(shard: str, sizes: list[int], phase: Phase = Phase.DATA) -> ShardListing:
    files = [FileEntry(path=f"f{i:06d}", size=s) for i, s in enumerate(sizes)]
    return ShardListing(shard_id=shard, node_id=f"node-{shard}", phase=phase, files=files)


def plan(listings: list[ShardListing], part_size: int | None = None):
    total = sum(item.bytes for item in listings)
    return plan_objects(
        backup_id="b1",
        cluster="c",
        prefix="backups",
        listings=listings,
        part_size=part_size or choose_part_size(total),
    )


@pytest.mark.parametrize(
    ("total", "part_size"),
    [(1 * MiB, 8 * MiB), (1 * GiB, 8 * MiB), (5 * TiB, 256 * MiB)],
)
def test_part_size_follows_the_data_size(total, part_size):
    assert choose_part_size(total) == part_size


@pytest.mark.parametrize(
    ("total", "part_size"),
    [
        (1 * GiB, 8 * MiB),  # small: the general 8 MiB parts, 4 objects
        (3 * GiB, 16 * MiB),  # 6 objects of 512 MiB, not 12 of 256 MiB
        (51 * GiB, 256 * MiB),  # 7 objects of 8 GiB, not 204 of 256 MiB
        (1 * TiB, ARCHIVE_PART_SIZE),  # 64 objects of 16 GiB, not 512 of 2 GiB
        (100 * TiB, 4 * GiB),  # past 1,000 objects the general rule grows parts further
    ],
)
def test_archive_classes_get_larger_parts_but_keep_objects_to_upload_in_parallel(total, part_size):
    for archive in ("GLACIER", "DEEP_ARCHIVE"):
        assert choose_part_size(total, archive) == part_size
    objects = -(-total // object_size_for(part_size))
    assert objects >= ARCHIVE_MIN_OBJECTS
    # Classes read without a restore keep the general sizes.
    for direct in (None, "STANDARD", "STANDARD_IA", "GLACIER_IR"):
        assert choose_part_size(total, direct) == choose_part_size(total)


def test_one_mib_is_one_object_of_one_part():
    (obj,) = plan([listing("s", [1 * MiB])])
    assert (obj.length, obj.part_count) == (1 * MiB, 1)


def test_one_gib_packs_into_256_mib_objects():
    objects = plan([listing("s", [100 * MiB] * 10 + [24 * MiB])])
    assert len(objects) == 4
    assert all(o.length == 256 * MiB and o.part_count == PARTS_PER_OBJECT for o in objects)


def test_five_tib_stays_within_s3_limits_and_makes_few_objects():
    objects = plan([listing("s", [5 * TiB])])
    assert len(objects) == 640  # xbcloud's 10 MiB chunks would be 524,288 objects
    assert all(o.part_count <= S3_MAX_PARTS for o in objects)
    assert all(S3_MIN_PART_SIZE <= o.part_size <= S3_MAX_PART_SIZE for o in objects)


def test_part_size_never_exceeds_s3_maximum_even_for_huge_inputs():
    assert choose_part_size(10_000 * TiB) == S3_MAX_PART_SIZE


@pytest.mark.parametrize("size", [1, S3_MIN_PART_SIZE - 1])
def test_a_part_size_below_s3_minimum_is_an_invalid_request_naming_the_range(size):
    """Too small is a wrong request, not a plan too large to store."""
    with pytest.raises(InvalidRequest) as raised:
        check_part_size(size)
    assert f"part size {size} bytes is below S3's minimum" in raised.value.message
    assert "5 MiB to 5 GiB" in raised.value.message
    assert "5 MiB to 5 GiB" in raised.value.fix


def test_a_part_size_above_s3_maximum_is_a_plan_too_large():
    with pytest.raises(PlanTooLarge) as raised:
        check_part_size(S3_MAX_PART_SIZE + 1)
    assert "above S3's maximum" in raised.value.message
    assert "5 MiB to 5 GiB" in raised.value.fix


@pytest.mark.parametrize("size", [S3_MIN_PART_SIZE, S3_MAX_PART_SIZE])
def test_the_limits_themselves_are_accepted(size):
    assert check_part_size(size) == size


def test_parts_cover_the_object_with_only_the_last_part_short():
    ranges = part_ranges(20 * MiB + 3, 8 * MiB)
    assert [(r.part_number, r.offset, r.size) for r in ranges] == [
        (1, 0, 8 * MiB),
        (2, 8 * MiB, 8 * MiB),
        (3, 16 * MiB, 4 * MiB + 3),
    ]


def test_many_small_files_pack_into_one_object():
    objects = plan([listing("s", [8 * 1024] * 1000)])
    assert len(objects) == 1
    assert objects[0].length == 8 * 1024 * 1000


def test_objects_are_per_shard_and_keys_name_backup_shard_and_phase():
    objects = plan([listing("b", [10]), listing("a", [10]), listing("a", [5], Phase.TAIL)])
    assert [o.key for o in objects] == [
        "backups/c/b1/a/data-00000",
        "backups/c/b1/a/tail-00000",
        "backups/c/b1/b/data-00000",
    ]


def test_empty_stream_makes_no_object():
    assert plan([listing("s", [0, 0])]) == []


@given(
    shards=st.lists(
        st.lists(st.integers(min_value=0, max_value=3 * 256 * MiB), min_size=0, max_size=30),
        min_size=1,
        max_size=4,
    )
)
def test_object_count_bound_and_streams_covered_without_gaps(shards):
    listings = [listing(f"s{i}", sizes) for i, sizes in enumerate(shards)]
    objects = plan(listings)
    total = sum(item.bytes for item in listings)
    object_size = object_size_for(objects[0].part_size) if objects else 256 * MiB
    # The target from the issue: at most one object per 256 MiB plus one per shard.
    assert len(objects) <= math.ceil(total / object_size) + len(listings)
    for item in listings:
        mine = [o for o in objects if o.shard_id == item.shard_id]
        assert sum(o.length for o in mine) == item.bytes
        offsets = [o.stream_offset for o in mine]
        assert offsets == sorted(offsets)
        assert all(
            a.stream_offset + a.length == b.stream_offset for a, b in itertools.pairwise(mine)
        )


@given(
    sizes=st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=20),
    data=st.data(),
)
def test_segments_of_a_range_are_exactly_the_bytes_of_that_range(sizes, data):
    files = [FileEntry(path=f"f{i}", size=s) for i, s in enumerate(sizes)]
    index = StreamIndex(files)
    stream = b"".join(bytes([i]) * s for i, s in enumerate(sizes))
    offset = data.draw(st.integers(min_value=0, max_value=len(stream)))
    length = data.draw(st.integers(min_value=0, max_value=len(stream) - offset))
    rebuilt = b"".join(
        bytes([int(seg.path[1:])]) * seg.length for seg in index.segments(offset, length)
    )
    assert rebuilt == stream[offset : offset + length]


def test_a_block_map_is_one_object_however_large():
    """A manifest records one block map object per shard: the map of a 600 GiB shard (600
    MiB) beside a small incremental's 256 MiB objects must not be cut in three, or the next
    incremental would get a third of its parent's map."""
    data = listing("s1", [300 * MiB])
    block_map = listing("s1", [600 * MiB], Phase.BLOCKMAP)

    objects = plan([data, block_map], part_size=8 * MiB)

    maps = [o for o in objects if o.phase == Phase.BLOCKMAP]
    assert [(m.stream_offset, m.length) for m in maps] == [(0, 600 * MiB)]
    assert maps[0].part_count == 75
    assert maps[0].length // maps[0].frame_size <= 4096  # its frame table still fits a result
    assert len([o for o in objects if o.phase == Phase.DATA]) == 2  # data objects: as before


def test_a_file_list_packs_to_the_same_text_whenever_it_is_packed(monkeypatch) -> None:
    """Packed lists are compared (a checkpoint's listing with a scan's): gzip's header time
    must not make the same list differ a second later."""
    import time

    from shardvault.contracts.models import FileEntry, pack_files, unpack_files

    files = [FileEntry(path="base/1/1259", size=8192), FileEntry(path="global/pg_control", size=1)]
    first = pack_files(files)
    later = time.time() + 5
    monkeypatch.setattr(time, "time", lambda: later)
    assert pack_files(files) == first
    assert unpack_files(first) == files


def test_the_upload_map_takes_each_node_in_turn_and_grows_with_the_nodes() -> None:
    """The Upload map starts items in plan order with a window of transfer_concurrency: objects
    grouped by shard would keep the window on one node while the others wait."""
    size = object_size_for(8 * MiB)
    objects = plan([listing("a", [3 * size]), listing("b", [2 * size])], part_size=8 * MiB)
    assert [o.node_id for o in objects] == ["node-a"] * 3 + ["node-b"] * 2  # by shard
    turns = interleave_by_node(objects)
    assert [(o.node_id, o.index) for o in turns] == [
        ("node-a", 0), ("node-b", 0), ("node-a", 1), ("node-b", 1), ("node-a", 2)
    ]  # fmt: skip
    assert sorted(turns, key=lambda o: o.key) == sorted(objects, key=lambda o: o.key)
    assert transfer_concurrency(objects) == TRANSFER_CONCURRENCY_FLOOR  # a small cluster: 8
    wide = [o.model_copy(update={"node_id": f"n{i}"}) for i, o in enumerate(objects * 120)]
    assert transfer_concurrency(wide[:200]) == 400  # two objects in flight a node
    assert transfer_concurrency(wide) == TRANSFER_CONCURRENCY_CEILING  # 600 nodes: the ceiling
