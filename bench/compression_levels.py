"""zstd levels, frame sizes, incompressible-frame detection and xxh3-128 block hashing, measured
on a pgbench data directory, to choose ShardVault's default compression level.

Usage::

    PYTHONPATH=.:agents .venv/bin/python bench/compression_levels.py [--scale 100] \\
        [--out bench/results]
    PYTHONPATH=.:agents .venv/bin/python bench/compression_levels.py --scale 100 \\
        --changes 3 --levels 1,2,3 --large-frames-every-level
    PYTHONPATH=.:agents .venv/bin/python bench/compression_levels.py --untuned 2.7 \\
        --levels 1,2,3

Terms:

* *stream*: the concatenation, in listing order, of the files a backup sends: the agent's own
  PostgreSQL listing (``shardvault_agent.engines.postgres.listing``: ``base/``, ``global/``,
  ``pg_xact`` and the other small files; ``pg_wal`` and the skipped files left out).
* *frame*: a consecutive 1 MiB (``--frame-mib``) slice of the stream, compressed on its own with
  one ``zstandard.ZstdCompressor`` per level reused across frames, as the product does. Its
  last frame may be shorter. *Large frames* are ``--large-frame-mib`` (4 MiB) slices, joined
  from consecutive frames: measured for the recommended level only, or for every level with
  ``--large-frames-every-level``.
* *levels*: ``--levels`` (default ``-3,-1,1,2,3,6``); a level this zstandard build rejects is
  listed as unsupported and skipped.
* *changes*: ``--changes N`` (0 to 3, default 0) rounds of the changes
  ``bench/incremental_vs_peers.py`` makes between its incrementals, applied after ``pgbench -i``
  with its own functions: per round, its 1 % update (``UPDATE pgbench_accounts SET abalance =
  abalance + 1`` over one contiguous 1 % of the aids, round n at its n-th range, so each round
  updates other rows), then its 10,000 transactions (``pgbench -n -c 4 -j 2 -t 2500``), each
  followed by a ``CHECKPOINT`` as there. Why: the data a backup meets after updates compresses
  differently from freshly loaded pgbench data: an update keeps the old row version and writes
  the new one on another page (``pgbench -i`` fills its pages, fillfactor 100), so the tables
  grow and mix dead and live rows, and the transactions add rows to ``pgbench_history``.
* *stored*: what the product keeps of a frame: the zstd output, or the raw frame when
  compression does not *pay*, i.e. the output is at least :data:`PAYS_BELOW` (90 %) of the
  frame. *ratio* is raw bytes / stored bytes (higher is better).
* *MiB/s*: MiB of uncompressed frame data per second, single-threaded (one core, the zstd
  library's own threads off); *wall* from ``perf_counter``, *CPU* from ``thread_time`` (on a
  shared machine CPU time is the steadier figure).
* *pre-check*: compress only the frame's first 64 KiB (``--precheck-kib``) with the same
  compressor; if that does not pay, store the frame raw without compressing the rest.
  *Misjudged* frames are pgbench frames the pre-check calls incompressible although the whole
  frame compresses below 90 %.
* *best of N*: each level passes over the frames ``--repeats`` (3) times; sizes are the same
  each time, and each time figure is the smallest of the passes (noise from other work on the
  machine only ever adds time).
* *recommended level*: the level with the fewest stored bytes among those whose CPU compress
  rate is at least ``--min-mibps``; sizes within ``--same-size-pct`` (1 %) of the smallest
  count as equal, and then the fastest of them wins. The default rate, 640 MiB/s, lets
  compression at most double the agent's CPU per GiB: the cores are what limits a backup on
  a small host, and the agent sends at about 1.6 CPU s/GiB (docs/BENCHMARKS.md; 1 GiB / 1.6 s
  = 640 MiB/s).

Steps: start a PostgreSQL 15 instance (``shardvault.local.postgres``, as the postgres OS user),
``pgbench -i -s SCALE``, the ``--changes`` rounds, ``CHECKPOINT``, stop it (so the files are
stable), read the stream into memory as frames, then measure each level (compress, then
decompress and compare), the recommended level (or every level) with 4 MiB frames,
``--random-mib`` (256) MiB of ``os.urandom`` in 1 MiB frames, the pre-check, and xxh3-128 over
8 KiB blocks (one ``xxh3_128_digest`` call per block, sliced from a memoryview of each 1 MiB
frame). The server is stopped and the work directory removed on the way out, also on failure,
Ctrl-C or SIGTERM (``--keep`` keeps the directory).

Results go to ``--out`` as ``compression_levels-<time>.json`` and ``.md`` (``setup.changes`` is
N, ``setup.change_rounds`` what each round did); the tables are printed to stdout. Caveat:
pgbench's tables are unusually compressible (blank-padded ``filler`` columns), so ratios here
are an upper bound for typical data, and the size gaps between levels may be wider on other
data.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import untuned
import xxhash
import zstandard
from incremental_vs_peers import (
    UPDATE_AT,
    contiguous_update,
    pgbench_transactions,
    wal_lsn,
    wal_since,
)
from shardvault_agent.engines.postgres.adapter import listing

from shardvault.local.postgres import (
    PostgresInstance,
    find_pg_bin_dir,
    init_instance,
    pgbench_init,
    stop_server,
)

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
PAYS_BELOW = 0.90  # a frame is stored raw unless zstd makes it smaller than this fraction
LEVELS = (-3, -1, 1, 2, 3, 6)  # negative ("fast") levels only if the library accepts them
INCOMPRESSIBLE_LEVELS = (1, 3)
HASH_BLOCK = 8 * KiB  # a PostgreSQL page


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- arguments ----------------------------------------------------------------------------------
def level_list(text: str) -> tuple[int, ...]:
    """``--levels``: comma-separated zstd levels, e.g. ``1,2,3``."""
    try:
        levels = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers; write e.g. 1,2,3"
        ) from None
    if len(set(levels)) != len(levels):
        raise argparse.ArgumentTypeError(f"{text!r} names a level twice; name each once")
    return levels


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=int, default=100, help="pgbench scale (100 ≈ 1.5 GiB)")
    parser.add_argument(
        "--untuned",
        type=float,
        default=None,
        metavar="GB",
        help="measure bench/untuned.py's dataset of this size instead of pgbench -i",
    )
    parser.add_argument(
        "--changes",
        type=int,
        default=0,
        help=f"rounds (0 to {len(UPDATE_AT)}) of incremental_vs_peers.py's changes after "
        "pgbench -i: a 1 %% contiguous update, then 10,000 pgbench transactions",
    )
    parser.add_argument(
        "--levels",
        type=level_list,
        default=LEVELS,
        help=f"zstd levels to measure (default {','.join(map(str, LEVELS))})",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="results dir")
    parser.add_argument("--frame-mib", type=int, default=1, help="frame size (MiB)")
    parser.add_argument(
        "--large-frame-mib", type=int, default=4, help="the larger frame size compared (MiB)"
    )
    parser.add_argument(
        "--large-frames-every-level",
        action="store_true",
        help="measure --large-frame-mib frames for every level, not only the recommended one",
    )
    parser.add_argument("--random-mib", type=int, default=256, help="MiB of os.urandom")
    parser.add_argument("--precheck-kib", type=int, default=64, help="pre-check prefix (KiB)")
    parser.add_argument(
        "--min-mibps",
        type=float,
        default=640.0,
        help="CPU compress rate (MiB/s, one core) the recommended level must reach",
    )
    parser.add_argument(
        "--same-size-pct",
        type=float,
        default=1.0,
        help="stored sizes within this %% of the smallest are a tie (the faster level wins)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="passes per level (best time)")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="parent of the work directory (default: TMP)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args(argv)
    if min(args.scale, args.frame_mib, args.random_mib, args.precheck_kib, args.repeats) < 1:
        parser.error(
            "--scale, --frame-mib, --random-mib, --precheck-kib and --repeats must be at least 1"
        )
    if args.untuned is not None and (args.untuned <= 0 or args.changes):
        parser.error("--untuned takes a positive size and no --changes")
    if not 0 <= args.changes <= len(UPDATE_AT):
        parser.error(
            f"--changes must be 0 to {len(UPDATE_AT)}: each round updates its own 1 % of the "
            f"accounts at one of incremental_vs_peers.py's {len(UPDATE_AT)} ranges (UPDATE_AT)"
        )
    if args.large_frame_mib % args.frame_mib:
        parser.error("--large-frame-mib must be a multiple of --frame-mib (frames are joined)")
    if args.precheck_kib * KiB >= args.frame_mib * MiB:
        parser.error("--precheck-kib must be smaller than a frame")
    return args


# --- the data -----------------------------------------------------------------------------------
def change_round(pg: PostgresInstance, scale: int, nth: int) -> dict[str, Any]:
    """Round ``nth`` (0-based) of ``--changes``: incremental_vs_peers.py's 1 % update at its
    ``nth`` range, then its 10,000 pgbench transactions, each followed by a CHECKPOINT as there.
    """
    started, lsn = time.monotonic(), wal_lsn(pg)
    update = contiguous_update(pg, scale, nth)
    pg.psql("CHECKPOINT")
    transactions = pgbench_transactions(pg)
    pg.psql("CHECKPOINT")
    return {
        "round": nth + 1,
        "update": update,
        "transactions": transactions,
        "wal_bytes": wal_since(pg, lsn),
        "seconds": round(time.monotonic() - started, 1),
    }


def build_data_dir(
    data_dir: Path, scale: int, changes: int, untuned_gb: float | None = None
) -> dict[str, Any]:
    """initdb, ``pgbench -i -s scale`` (or ``untuned.build`` of ``untuned_gb``), ``changes``
    rounds of changes, CHECKPOINT, stop; the caller stops it on failure."""
    what = f"the untuned dataset of {untuned_gb} GB" if untuned_gb else f"pgbench -i -s {scale}"
    say(f"initdb and {what} in {data_dir}")
    pg: PostgresInstance = init_instance(data_dir)
    started = time.monotonic()
    if untuned_gb:
        untuned.build(pg, scale_gb=untuned_gb, say=say)
    else:
        pgbench_init(pg, scale)
    filled = time.monotonic()
    loaded_bytes = int(pg.psql("SELECT pg_database_size('postgres')"))
    rounds = []
    for nth in range(changes):
        rounds.append(change_round(pg, scale, nth))
        say(f"  change round {nth + 1} of {changes}: {rounds[-1]}")
    pg.psql("CHECKPOINT")
    database_bytes = int(pg.psql("SELECT pg_database_size('postgres')"))
    version = pg.psql("SHOW server_version")
    pg.stop()
    return {
        "postgres": version,
        "pgbench_init_seconds": round(filled - started, 1),
        "changes": changes,
        "change_rounds": rounds,
        "loaded_database_bytes": loaded_bytes,
        "database_bytes": database_bytes,
    }


def backup_paths(data_dir: Path) -> list[str]:
    """The regular files a backup of ``data_dir`` sends, in listing order (the agent's list)."""
    return [entry.path for entry in listing(data_dir) if not entry.path.endswith("/")]


def stream_frames(root: Path, paths: Sequence[str], frame_size: int) -> Iterator[bytes]:
    """The concatenation of ``paths`` as consecutive ``frame_size`` slices (the last shorter)."""
    pending = bytearray()
    for path in paths:
        with open(root / path, "rb") as source:
            while chunk := source.read(frame_size - len(pending)):
                pending += chunk
                if len(pending) == frame_size:
                    yield bytes(pending)
                    pending.clear()
    if pending:
        yield bytes(pending)


def join_frames(frames: Sequence[bytes], factor: int) -> Iterator[bytes]:
    """Frames ``factor`` times larger over the same stream."""
    for start in range(0, len(frames), factor):
        yield b"".join(frames[start : start + factor])


def random_frames(total: int, frame_size: int) -> list[bytes]:
    return [os.urandom(frame_size) for _ in range(total // frame_size)]


# --- compression --------------------------------------------------------------------------------
def level_supported(level: int) -> bool:
    """Whether this zstandard build accepts ``level`` and round-trips data with it."""
    sample = b"shardvault " * 1000
    try:
        compressed = zstandard.ZstdCompressor(level=level).compress(sample)
        return zstandard.ZstdDecompressor().decompress(compressed) == sample
    except (zstandard.ZstdError, ValueError):
        return False


def pays(compressed_size: int, raw_size: int) -> bool:
    return compressed_size < PAYS_BELOW * raw_size


@dataclass
class LevelResult:
    """One level over one frame size: sizes, and time spent in the library calls only."""

    level: int
    frame_bytes: int
    frames: int = 0
    raw_bytes: int = 0
    compressed_bytes: int = 0  # zstd output of every frame
    stored_bytes: int = 0  # zstd output, or the raw frame where compression does not pay
    raw_frames: int = 0
    compress_wall_s: float = 0.0
    compress_cpu_s: float = 0.0
    decompress_wall_s: float = 0.0
    decompress_cpu_s: float = 0.0

    def add(self, raw: int, compressed: int) -> None:
        self.frames += 1
        self.raw_bytes += raw
        self.compressed_bytes += compressed
        if pays(compressed, raw):
            self.stored_bytes += compressed
        else:
            self.stored_bytes += raw
            self.raw_frames += 1

    def summary(self) -> dict[str, Any]:
        mib = self.raw_bytes / MiB
        return {
            **asdict(self),
            "ratio": round(self.raw_bytes / self.stored_bytes, 3),
            "stored_pct": round(100 * self.stored_bytes / self.raw_bytes, 2),
            "compress_mibps_wall": round(mib / self.compress_wall_s, 1),
            "compress_mibps_cpu": round(mib / self.compress_cpu_s, 1),
            "decompress_mibps_wall": round(mib / self.decompress_wall_s, 1),
            "decompress_mibps_cpu": round(mib / self.decompress_cpu_s, 1),
        }


def timed(call: Callable[[], bytes]) -> tuple[bytes, float, float]:
    """``call()``, its wall and CPU seconds (this thread's)."""
    wall, cpu = time.perf_counter(), time.thread_time()
    result = call()
    return result, time.perf_counter() - wall, time.thread_time() - cpu


def measure_level(
    frames: Iterable[bytes], level: int, frame_bytes: int
) -> tuple[LevelResult, list[int]]:
    """Compresses every frame with one reused compressor, decompresses and compares it.

    Returns the totals and each frame's compressed size (for the pre-check's verdicts).
    """
    compressor = zstandard.ZstdCompressor(level=level)
    decompressor = zstandard.ZstdDecompressor()
    result = LevelResult(level, frame_bytes)
    sizes: list[int] = []
    for frame in frames:
        compressed, wall, cpu = timed(lambda f=frame: compressor.compress(f))
        result.compress_wall_s += wall
        result.compress_cpu_s += cpu
        restored, wall, cpu = timed(lambda c=compressed: decompressor.decompress(c))
        result.decompress_wall_s += wall
        result.decompress_cpu_s += cpu
        if restored != frame:
            raise RuntimeError(f"zstd level {level}: a frame did not round-trip")
        result.add(len(frame), len(compressed))
        sizes.append(len(compressed))
    return result, sizes


TIMES = ("compress_wall_s", "compress_cpu_s", "decompress_wall_s", "decompress_cpu_s")


def measure_best_of(
    make_frames: Callable[[], Iterable[bytes]], level: int, frame_bytes: int, repeats: int
) -> tuple[LevelResult, list[int]]:
    """:func:`measure_level` ``repeats`` times; each time figure is the smallest of the passes."""
    passes = [measure_level(make_frames(), level, frame_bytes) for _ in range(repeats)]
    best, sizes = passes[0]
    fastest = {name: min(getattr(result, name) for result, _ in passes) for name in TIMES}
    return replace(best, **fastest), sizes


def recommend(results: Sequence[dict[str, Any]], min_mibps: float, same_size_pct: float) -> int:
    """The level storing the fewest bytes among those compressing at ``min_mibps`` or faster,
    sizes within ``same_size_pct`` counting as equal (then the faster wins); the fastest level
    when none is fast enough."""
    fast_enough = [r for r in results if r["compress_mibps_cpu"] >= min_mibps] or [
        max(results, key=lambda r: r["compress_mibps_cpu"])
    ]
    smallest = min(r["stored_bytes"] for r in fast_enough)
    ties = [r for r in fast_enough if r["stored_bytes"] <= smallest * (1 + same_size_pct / 100)]
    return max(ties, key=lambda r: r["compress_mibps_cpu"])["level"]


# --- incompressible frames ----------------------------------------------------------------------
def precheck_pays(
    compressor: zstandard.ZstdCompressor, frame: bytes, prefix: int
) -> tuple[bool, float]:
    """Whether the frame's first ``prefix`` bytes compress (the pre-check), and its CPU time."""
    head = memoryview(frame)[:prefix]
    compressed, _, cpu = timed(lambda: compressor.compress(head))
    return pays(len(compressed), len(head)), cpu


def measure_precheck(
    level: int,
    pgbench: Sequence[bytes],
    pgbench_sizes: Sequence[int],
    pgbench_cpu_s: float,
    random: Sequence[bytes],
    prefix: int,
) -> dict[str, Any]:
    """Full-frame zstd on random frames against the pre-check, and its misjudgements."""
    full, _ = measure_level(random, level, len(random[0]))
    compressor = zstandard.ZstdCompressor(level=level)
    random_verdicts = [precheck_pays(compressor, frame, prefix) for frame in random]
    pgbench_verdicts = [precheck_pays(compressor, frame, prefix) for frame in pgbench]
    random_cpu = sum(cpu for _, cpu in random_verdicts)
    pgbench_cpu = sum(cpu for _, cpu in pgbench_verdicts)
    whole_pays = [pays(size, len(f)) for size, f in zip(pgbench_sizes, pgbench, strict=True)]
    verdicts = [says for says, _ in pgbench_verdicts]
    random_mib = full.raw_bytes / MiB
    return {
        "level": level,
        "random_full": full.summary(),
        "random_full_us_per_frame_cpu": round(1e6 * full.compress_cpu_s / full.frames, 1),
        "random_precheck_us_per_frame_cpu": round(1e6 * random_cpu / len(random), 1),
        "random_precheck_mibps_cpu": round(random_mib / random_cpu, 1),
        "random_precheck_said_incompressible": sum(not says for says, _ in random_verdicts),
        "random_frames": len(random),
        "pgbench_precheck_extra_pct_cpu": round(100 * pgbench_cpu / pgbench_cpu_s, 2),
        "pgbench_misjudged_frames": sum(
            not says and whole for says, whole in zip(verdicts, whole_pays, strict=True)
        ),
        "pgbench_precheck_said_incompressible": sum(not says for says in verdicts),
        "pgbench_frames_not_paying": sum(not whole for whole in whole_pays),
        "pgbench_frames": len(pgbench),
    }


# --- hashing ------------------------------------------------------------------------------------
def hash_blocks(frames: Sequence[bytes], block: int, length: int) -> tuple[int, float, float]:
    """One ``xxh3_128_digest`` per ``block`` of each frame, each call hashing ``length`` bytes
    of a memoryview slice (``length`` 0 measures the loop and call alone)."""
    digest = xxhash.xxh3_128_digest
    calls = 0
    wall, cpu = time.perf_counter(), time.thread_time()
    for frame in frames:
        view = memoryview(frame)
        for offset in range(0, len(view), block):
            digest(view[offset : offset + length])
        calls += (len(view) + block - 1) // block
    return calls, time.perf_counter() - wall, time.thread_time() - cpu


def hash_frames(frames: Sequence[bytes]) -> tuple[float, float]:
    """One call per whole frame: xxh3's own speed, with next to no Python overhead."""
    wall, cpu = time.perf_counter(), time.thread_time()
    for frame in frames:
        xxhash.xxh3_128_digest(frame)
    return time.perf_counter() - wall, time.thread_time() - cpu


def measure_hashing(frames: Sequence[bytes]) -> dict[str, Any]:
    total = sum(len(f) for f in frames)
    blocks, wall, cpu = hash_blocks(frames, HASH_BLOCK, HASH_BLOCK)
    empty_calls, empty_wall, empty_cpu = hash_blocks(frames, HASH_BLOCK, 0)
    whole_wall, whole_cpu = hash_frames(frames)
    return {
        "bytes": total,
        "block_bytes": HASH_BLOCK,
        "blocks": blocks,
        "mibps_wall": round(total / MiB / wall, 1),
        "mibps_cpu": round(total / MiB / cpu, 1),
        "seconds_per_gib_cpu": round(cpu * GiB / total, 3),
        "blocks_per_second_cpu": round(blocks / cpu),
        "ns_per_block_cpu": round(1e9 * cpu / blocks),
        "ns_per_empty_call_cpu": round(1e9 * empty_cpu / empty_calls),
        "empty_calls_wall_s": round(empty_wall, 3),
        "overhead_pct_of_block": round(100 * empty_cpu / cpu, 1),
        "whole_frame_mibps_cpu": round(total / MiB / whole_cpu, 1),
        "whole_frame_wall_s": round(whole_wall, 3),
    }


# --- the machine --------------------------------------------------------------------------------
def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def machine_info() -> dict[str, Any]:
    postgres = find_pg_bin_dir() / "postgres"
    version = subprocess.run([postgres, "--version"], capture_output=True, text=True, check=False)
    return {
        "nproc": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "cpu_model": _cpu_model(),
        "load_average": os.getloadavg(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "zstandard": zstandard.__version__,
        "zstandard_backend": zstandard.backend,
        "libzstd": ".".join(map(str, zstandard.ZSTD_VERSION)),
        "xxhash": xxhash.VERSION,
        "libxxhash": xxhash.XXHASH_VERSION,
        "postgres_bin": version.stdout.strip(),
    }


# --- the report ---------------------------------------------------------------------------------
def _level_row(r: dict[str, Any], recommended: int) -> str:
    mark = " (recommended)" if r["level"] == recommended else ""
    cells = [
        f"{r['level']}{mark}",
        f"{r['frame_bytes'] // MiB} MiB",
        f"{r['stored_bytes'] / MiB:,.0f}",
        f"{r['ratio']:.2f}",
        f"{r['stored_pct']:.1f} %",
        f"{r['raw_frames']} / {r['frames']}",
        f"{r['compress_mibps_cpu']:,.0f}",
        f"{r['compress_mibps_wall']:,.0f}",
        f"{r['decompress_mibps_cpu']:,.0f}",
        f"{r['decompress_mibps_wall']:,.0f}",
    ]
    return "| " + " | ".join(cells) + " |"


def _precheck_row(p: dict[str, Any]) -> str:
    full = p["random_full"]
    cells = [
        str(p["level"]),
        f"{full['compress_mibps_cpu']:,.0f}",
        f"{100 * full['compressed_bytes'] / full['raw_bytes']:.3f} %",
        f"{p['random_full_us_per_frame_cpu']:,.0f}",
        f"{p['random_precheck_us_per_frame_cpu']:,.0f}",
        f"{p['random_precheck_said_incompressible']} / {p['random_frames']}",
        f"{p['pgbench_precheck_extra_pct_cpu']:.1f} %",
        f"{p['pgbench_misjudged_frames']} / {p['pgbench_frames']}",
        f"{p['pgbench_frames_not_paying']}",
    ]
    return "| " + " | ".join(cells) + " |"


def _rounds(count: int) -> str:
    return f"{count} round" if count == 1 else f"{count} rounds"


def _changes_text(setup: dict[str, Any]) -> str:
    """What ``--changes`` did to the data, for the report."""
    if not setup["changes"]:
        return "Data: as loaded by pgbench -i (--changes 0)."
    transactions = sum(r["transactions"]["transactions"] or 0 for r in setup["change_rounds"])
    return (
        f"Data: after pgbench -i, {_rounds(setup['changes'])} of incremental_vs_peers.py's changes "
        "(a 1 % contiguous UPDATE of pgbench_accounts, then pgbench -n -c 4 -j 2 -t 2500), "
        f"{transactions:,} transactions in all; database "
        f"{setup['loaded_database_bytes'] / GiB:.2f} GiB loaded, "
        f"{setup['database_bytes'] / GiB:.2f} GiB after the changes."
    )


def markdown(result: dict[str, Any]) -> str:
    setup, machine, hashing = result["setup"], result["machine"], result["hashing"]
    recommended = result["recommended_level"]
    changed = f" after {_rounds(setup['changes'])} of changes" if setup["changes"] else ""
    data = (
        f"the untuned dataset ({setup['untuned_gb']} GB)"
        if setup.get("untuned_gb")
        else f"pgbench -s {setup['scale']}{changed}"
    )
    lines = [
        f"# zstd levels on {data} "
        f"({setup['stream_bytes'] / GiB:.2f} GiB stream, {setup['files']} files)",
        "",
        _changes_text(setup),
        "",
        f"{machine['cpu_model']}, {machine['nproc']} CPUs (shared), Python {machine['python']}, "
        f"zstandard {machine['zstandard']} (libzstd {machine['libzstd']}), xxhash "
        f"{machine['xxhash']} (libxxhash {machine['libxxhash']}), {setup['postgres']}.",
        "",
        "Single-threaded; MiB/s of uncompressed data; ratio = raw / stored, where a frame is "
        f"stored raw unless zstd makes it smaller than {PAYS_BELOW:.0%}.",
        "",
        "| level | frame | stored MiB | ratio | stored % | raw frames | compress MiB/s CPU "
        "| compress MiB/s wall | decompress MiB/s CPU | decompress MiB/s wall |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *(_level_row(r, recommended) for r in result["levels"]),
        *(_level_row(r, recommended) for r in result["large_frame_levels"]),
        "",
        f"Recommended level (the fewest stored bytes among levels compressing at "
        f"≥ {result['args']['min_mibps']:.0f} MiB/s CPU, sizes within "
        f"{result['args']['same_size_pct']:g} % a tie won by the faster): **{recommended}**. "
        f"Times: best of {result['args']['repeats']} passes. Levels not supported by this "
        "build: "
        f"{result['unsupported_levels'] or 'none'}.",
        "",
        f"## Incompressible frames ({result['args']['random_mib']} MiB of os.urandom, 1 MiB "
        f"frames; pre-check = zstd of the first {result['args']['precheck_kib']} KiB)",
        "",
        "| level | random: full MiB/s CPU | random: output / input | random: full µs/frame "
        "| random: pre-check µs/frame | random: pre-check says raw | pgbench: pre-check extra "
        "CPU | pgbench: misjudged | pgbench: frames not paying |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *(_precheck_row(p) for p in result["incompressible"]),
        "",
        "## xxh3-128 over 8 KiB blocks (one call per block, memoryview slices of 1 MiB frames)",
        "",
        "| MiB/s CPU | MiB/s wall | s/GiB | blocks/s | ns/block | ns per empty call "
        "| call overhead | one call per 1 MiB frame: MiB/s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {hashing['mibps_cpu']:,.0f} | {hashing['mibps_wall']:,.0f} "
        f"| {hashing['seconds_per_gib_cpu']:.3f} | {hashing['blocks_per_second_cpu']:,} "
        f"| {hashing['ns_per_block_cpu']:,} | {hashing['ns_per_empty_call_cpu']:,} "
        f"| {hashing['overhead_pct_of_block']:.1f} % | {hashing['whole_frame_mibps_cpu']:,.0f} |",
        "",
    ]
    return "\n".join(lines)


# --- the run ------------------------------------------------------------------------------------
def measure_levels(
    args: argparse.Namespace, frames: list[bytes], frame_bytes: int
) -> tuple[list[dict[str, Any]], dict[int, list[int]], list[int]]:
    """Every supported level of ``--levels`` over the frames: summaries, per-frame sizes,
    unsupported levels."""
    summaries, sizes, unsupported = [], {}, []
    for level in args.levels:
        if not level_supported(level):
            unsupported.append(level)
            continue
        say(f"level {level}, {frame_bytes // MiB} MiB frames")
        result, sizes[level] = measure_best_of(lambda: frames, level, frame_bytes, args.repeats)
        summaries.append(result.summary())
        say(f"  {summaries[-1]}")
    return summaries, sizes, unsupported


def measure_large_frames(
    args: argparse.Namespace, frames: list[bytes], levels: Sequence[int]
) -> list[dict[str, Any]]:
    """``levels`` over ``--large-frame-mib`` frames joined from ``frames``: their summaries."""
    factor = args.large_frame_mib // args.frame_mib
    summaries = []
    for level in levels:
        say(f"level {level}, {args.large_frame_mib} MiB frames")
        result, _ = measure_best_of(
            lambda: join_frames(frames, factor), level, args.large_frame_mib * MiB, args.repeats
        )
        summaries.append(result.summary())
        say(f"  {summaries[-1]}")
    return summaries


def run(args: argparse.Namespace, data_dir: Path) -> dict[str, Any]:
    built = build_data_dir(data_dir, args.scale, args.changes, args.untuned)
    setup = {"scale": args.scale, "untuned_gb": args.untuned, **built}
    paths = backup_paths(data_dir)
    frame_bytes = args.frame_mib * MiB
    say(f"reading {len(paths)} files into {frame_bytes // MiB} MiB frames")
    frames = list(stream_frames(data_dir, paths, frame_bytes))
    setup |= {"files": len(paths), "stream_bytes": sum(map(len, frames)), "frames": len(frames)}
    levels, sizes, unsupported = measure_levels(args, frames, frame_bytes)
    recommended = recommend(levels, args.min_mibps, args.same_size_pct)
    large_levels = [r["level"] for r in levels] if args.large_frames_every_level else [recommended]
    large = measure_large_frames(args, frames, large_levels)
    random = random_frames(args.random_mib * MiB, frame_bytes)
    by_level = {r["level"]: r for r in levels}
    incompressible = []
    for level in (level for level in INCOMPRESSIBLE_LEVELS if level in by_level):
        say(f"incompressible frames and the pre-check, level {level}")
        pgbench_cpu = by_level[level]["compress_cpu_s"]
        incompressible.append(
            measure_precheck(
                level, frames, sizes[level], pgbench_cpu, random, args.precheck_kib * KiB
            )
        )
    say("xxh3-128 over 8 KiB blocks")
    return {
        "setup": setup,
        "levels": levels,
        "unsupported_levels": unsupported,
        "recommended_level": recommended,
        "large_frames": next(r for r in large if r["level"] == recommended),
        "large_frame_levels": large,
        "incompressible": incompressible,
        "hashing": measure_hashing(frames),
    }


def write_results(out: Path, result: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    path = out / f"compression_levels-{stamp}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    path.with_suffix(".md").write_text(markdown(result))
    return path


def _terminate(signum: int, _frame: object) -> None:
    say(f"signal {signum}: stopping PostgreSQL")
    raise SystemExit(128 + signum)  # unwinds the finally: the server is stopped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    started = time.time()
    root = Path(tempfile.mkdtemp(prefix="shardvault-levels-", dir=args.workdir)).absolute()
    root.chmod(0o711)  # the postgres OS user must traverse it
    data_dir = root / "pg" / "data"
    try:
        machine = machine_info()
        measured = run(args, data_dir)
    finally:
        stop_server(data_dir)  # a no-op once build_data_dir stopped it
        if args.keep:
            say(f"work directory kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    args_out = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "started_at": datetime.fromtimestamp(started, UTC).isoformat(),
        "wall_seconds": round(time.time() - started, 1),
        "args": args_out,
        "machine": machine | {"load_average_end": os.getloadavg()},
        **measured,
    }
    path = write_results(args.out, result)
    print(markdown(result))
    print(f"Raw results: {path}; wall time {time.time() - started:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
