"""Which MariaDB incremental moves fewer bytes: ShardVault's block-level one over a fresh
``mariabackup`` copy, or ``mariabackup --incremental-basedir`` (issue 12 asks to measure).

Terms:
- *block-level*: what a ShardVault incremental of a MariaDB shard sends before compression:
  the 16 KiB blocks (InnoDB's page size) of the new copy whose hash differs from the same
  block of the parent's copy (``scan`` hashes blocks the same way; the size here is InnoDB's).
- *mariabackup incremental*: the directory ``mariabackup --backup --incremental-basedir``
  writes: ``.delta`` files of the InnoDB pages newer than the base's LSN, the redo log it
  copied, and every non-InnoDB (Aria) table whole.

One server, a sysbench-like table of ``--rows`` rows, a full copy, an update of 1 % of the
rows in one contiguous key range, then both kinds of copy of the changed server. Prints the
bytes of each, per file.

    .venv/bin/python bench/mariadb_incremental.py --rows 1000000
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

from shardvault_agent.engines.mariadb.server import MariadbServer

from shardvault.local.mariadb import init_server, stop_server

BLOCK = 16 * 1024


def copy(server: MariadbServer, dest: Path, *extra: str) -> None:
    command = server.backup_command(f"--target-dir={dest}", *extra)
    subprocess.run(command, check=True, capture_output=True)


def block_hashes(root: Path) -> dict[tuple[str, int], bytes]:
    hashes = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        for offset in range(0, len(data), BLOCK):
            block = data[offset : offset + BLOCK]
            hashes[(path.relative_to(root).as_posix(), offset)] = hashlib.blake2b(
                block, digest_size=8
            ).digest()
    return hashes


def size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mariadb-incremental-"))
    server = init_server(work / "data")
    try:
        server.sql("CREATE DATABASE sb")
        server.sql(
            "CREATE TABLE t (id INT PRIMARY KEY, k INT, c CHAR(120), pad CHAR(60)) "
            "ENGINE=InnoDB; INSERT INTO t SELECT seq, seq % 1000, REPEAT('c', 120), "
            f"REPEAT('p', 60) FROM seq_1_to_{args.rows}",
            database="sb",
        )
        copy(server, work / "full")
        low = args.rows * 40 // 100
        server.sql(
            f"UPDATE t SET k = k + 1 WHERE id BETWEEN {low} AND {low + args.rows // 100}",
            database="sb",
        )
        copy(server, work / "second")
        copy(server, work / "incremental", f"--incremental-basedir={work / 'full'}")
        parent, child = block_hashes(work / "full"), block_hashes(work / "second")
        changed = Counter(f for (f, o), h in child.items() if parent.get((f, o)) != h)
        mib = 1024 * 1024
        print(f"rows {args.rows:,}; full copy {size(work / 'second') / mib:.1f} MiB")
        print(f"block-level ({BLOCK // 1024} KiB): {sum(changed.values()) * BLOCK / mib:.1f} MiB")
        for name, blocks in changed.most_common():
            print(f"  {name}: {blocks * BLOCK / mib:.2f} MiB")
        print(f"mariabackup --incremental-basedir: {size(work / 'incremental') / mib:.1f} MiB")
        files = sorted(
            ((p.stat().st_size, p.relative_to(work / "incremental").as_posix())
             for p in (work / "incremental").rglob("*") if p.is_file()),
            reverse=True,
        )  # fmt: skip
        for length, name in files[:8]:
            print(f"  {name}: {length / mib:.2f} MiB")
    finally:
        stop_server(server.data_dir)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
