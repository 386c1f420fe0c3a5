"""PostgreSQL WAL file names: their order across the high part's step, gaps, and a tail's
continuity as verify checks it."""

from __future__ import annotations

from shardvault.contracts.pgwal import gaps, segment_holding, tail_problems

MiB = 1024 * 1024


def test_segments_follow_each_other_across_the_high_parts_step() -> None:
    # 16 MiB segments: the low part runs to FF, then the high part steps.
    run = ["0000000100000000000000FE", "0000000100000000000000FF", "000000010000000100000000"]
    assert gaps(run) == []
    assert gaps([run[0], run[2]]) == [("0000000100000000000000FE", 1)]
    # 64 MiB segments step after 3F.
    assert gaps(["00000001000000000000003F", "000000010000000100000000"], 64 * MiB) == []


def test_each_timeline_is_a_run_of_its_own() -> None:
    names = ["000000010000000000000005", "000000020000000000000006", "000000020000000000000007"]
    assert gaps(names) == []


def test_a_tail_that_misses_a_segment_or_stops_short_of_its_cut_is_named() -> None:
    marker = {"start_wal": "000000010000000000000003", "stop_wal": "000000010000000000000005",
              "cut_lsn": "0/6000148"}  # fmt: skip
    whole = {f"00000001000000000000000{i}": 16 * MiB for i in range(3, 7)}
    assert tail_problems("s1", marker, whole) == []
    holed = {k: v for k, v in whole.items() if not k.endswith("4")}
    assert tail_problems("s1", marker, holed) == [
        "shard s1's tail misses 1 WAL segment(s) after 000000010000000000000003"
    ]
    short = {k: v for k, v in whole.items() if not k.endswith("6")}
    assert tail_problems("s1", marker, short) == [
        "shard s1's tail ends at 000000010000000000000005, before 000000010000000000000006"
    ]
    late = {k: v for k, v in whole.items() if not k.endswith("3")}
    assert tail_problems("s1", marker, late) == [
        "shard s1's tail begins at 000000010000000000000004, not at 000000010000000000000003"
    ]
    assert tail_problems("s1", marker, {"backup_label": 200}) == [
        "shard s1's tail holds no WAL segment"
    ]


def test_a_record_ending_on_a_boundary_ends_in_the_segment_before() -> None:
    assert segment_holding(1, "0/7000000", 16 * MiB) == "000000010000000000000006"
    assert segment_holding(2, "1/00000028", 16 * MiB) == "000000020000000100000000"
