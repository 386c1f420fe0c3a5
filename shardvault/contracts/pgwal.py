"""PostgreSQL's WAL as files: segment names, their order, and what a run of them is missing.

Terms:
- *segment name*: 24 hex digits, the timeline (8), then the segment number's high and low
  parts (8 each); the low part counts up to ``0x100000000 // segment size`` before the high
  part steps (256 segments of 16 MiB per high step).
- *timeline*: a promotion (a failover, a restore in place) starts a new timeline, numbered
  after the newest one the server knows; its *history file* (``<timeline>.history``) names
  the timelines before it and where it branched from each. Segments of a new timeline are
  named after it, from the segment the promotion happened in.
- *continuity*: a run of segments of one timeline misses none between its first and last.
  A backup's tail must hold every segment from its start (the backup label's ``START WAL``,
  the marker's ``start_wal``) to where recovery stops (the cut's segment, or ``stop_wal``);
  a missing one means the shard cannot be recovered, however whole each object is.
"""

from __future__ import annotations

import re
from itertools import pairwise

from shardvault.errors import InvalidRequest

SEGMENT_NAME = re.compile(r"^[0-9A-F]{24}$")
HISTORY_NAME = re.compile(r"^[0-9A-F]{8}\.history$")  # a timeline's history file
LSN = re.compile(r"^[0-9A-Fa-f]{1,8}/[0-9A-Fa-f]{1,8}$")  # a WAL position, as PostgreSQL writes it
# What PostgreSQL allows in a restore point's name (fewer than 64 bytes), and what can be
# written into a configuration file without quoting: a backup id is far inside it.
RESTORE_POINT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,62}$")
DEFAULT_SEGMENT_SIZE = 16 * 1024 * 1024


def check_restore_point_name(name: str) -> str:
    if not RESTORE_POINT_NAME.fullmatch(name):
        raise InvalidRequest(
            f"{name!r} cannot name a restore point: letters, digits and . _ : - only, at most "
            "63 characters.",
            fix="restore to a backup's own restore point (its backup id).",
        )
    return name


def timeline(name: str) -> int:
    return int(name[:8], 16)


def segment_number(name: str, segment_size: int = DEFAULT_SEGMENT_SIZE) -> int:
    """The segment's number within its timeline (its first byte's LSN ÷ the segment size)."""
    return int(name[8:16], 16) * (0x100000000 // segment_size) + int(name[16:24], 16)


def gaps(names: list[str], segment_size: int = DEFAULT_SEGMENT_SIZE) -> list[tuple[str, int]]:
    """Where a run of segment names misses segments: the name before each gap and how many
    are missing after it. Names of several timelines are checked one timeline at a time."""
    found: list[tuple[str, int]] = []
    by_timeline: dict[int, list[str]] = {}
    for name in sorted(n for n in names if SEGMENT_NAME.fullmatch(n)):
        by_timeline.setdefault(timeline(name), []).append(name)
    for run in by_timeline.values():
        for before, after in pairwise(run):
            missing = segment_number(after, segment_size) - segment_number(before, segment_size)
            if missing > 1:
                found.append((before, missing - 1))
    return found


def tail_problems(shard_id: str, marker: dict[str, str], wal: dict[str, int]) -> list[str]:
    """What keeps a PostgreSQL tail (``wal``: its ``pg_wal`` files by name, with their sizes)
    from recovering: a segment missing inside the run, or a run that does not begin at the
    backup's first segment or stops short of its last."""
    segments = sorted(n for n in wal if SEGMENT_NAME.fullmatch(n))
    if not segments:
        return [f"shard {shard_id}'s tail holds no WAL segment"]
    size = max(wal[n] for n in segments) or DEFAULT_SEGMENT_SIZE
    problems = [
        f"shard {shard_id}'s tail misses {count} WAL segment(s) after {before}"
        for before, count in gaps(segments, size)
    ]
    first = marker.get("start_wal")
    if first and segments[0] != first:
        problems.append(f"shard {shard_id}'s tail begins at {segments[0]}, not at {first}")
    last = marker.get("stop_wal")
    if first and marker.get("cut_lsn"):  # recovery goes on to the cut's restore point
        last = max(last or "", segment_holding(timeline(first), marker["cut_lsn"], size))
    if last and segments[-1] < last:
        problems.append(f"shard {shard_id}'s tail ends at {segments[-1]}, before {last}")
    return problems


def lsn_number(lsn: str) -> int:
    """An LSN as PostgreSQL writes it (``X/Y``, hex) as one number: LSNs compare as these."""
    high, low = lsn.split("/")
    return int(high, 16) << 32 | int(low, 16)


def lsn_text(number: int) -> str:
    """``lsn_number``'s inverse."""
    return f"{number >> 32:X}/{number & 0xFFFFFFFF:X}"


def segment_holding(on_timeline: int, lsn: str, segment_size: int) -> str:
    """The name of the segment that holds the byte before ``lsn`` (``X/Y``): where a record
    ending at ``lsn`` ends."""
    return segment_name(on_timeline, (lsn_number(lsn) - 1) // segment_size, segment_size)


def segment_name(on_timeline: int, number: int, segment_size: int = DEFAULT_SEGMENT_SIZE) -> str:
    """The name of segment ``number`` of a timeline (``segment_number``'s inverse)."""
    per_step = 0x100000000 // segment_size
    return f"{on_timeline:08X}{number // per_step:08X}{number % per_step:08X}"
