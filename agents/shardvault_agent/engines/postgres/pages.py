"""PostgreSQL's pages: what a page's header proves about it since a parent backup.

Terms:
- *page LSN* (``pd_lsn``, the first 8 bytes of every page of a relation file: two native
  32-bit halves, high then low): the WAL position of the last logged change to the page.
  Every change PostgreSQL makes to a relation's main fork is logged and sets it, except
  hint bits, which a restored page may lack (they are set again when read).
- *screen*: an incremental reads only each page's LSN, and reads and hashes only the pages
  whose LSN is at or after the parent's start (``start_lsn``, the redo point of the parent's
  checkpoint), or zero (a page never logged: new, or extended and not used yet). A page
  with an older LSN was last changed before that checkpoint, which wrote it to disk before
  the parent read it, so the parent (or the member before it) holds its bytes. This is
  pg_probackup's DELTA mode; pgBackRest and PostgreSQL 17 read or summarize instead.

What makes it safe, and when it is not used (the file is then read and hashed whole):
- only relation main forks (``base/<db>/<node>[.<segment>]``, ``global/<node>``, and in a
  tablespace ``pg_tblspc/<oid>/<version>/<db>/<node>[.<segment>]``). The free
  space map is not logged, and the visibility map's bits are cleared without moving its
  pages' LSNs: those forks are small and always read;
- only the file the parent read at the same path on the same node, by its device and inode
  (the scan checks; a device and inode name a file on one host only, so a parent another
  node made, a replica's, is not screened against): a file copied in with old LSNs
  (``CREATE DATABASE``'s file copy, a replaced data directory) is a new inode; a rewritten
  relation (``VACUUM FULL``, ``TRUNCATE``) a new file;
- only in the parent's database cluster (its ``system_identifier``, the first 8 bytes of
  ``global/pg_control``: an ``initdb`` in the same place makes another), on the parent's
  timeline, at or after its start, with 8 KiB pages (the block map's block size;
  ``block_size`` is read at the checkpoint);
- a torn read is no concern: a page written while the scan reads it was changed after this
  backup's checkpoint, and the backup's WAL holds its full image.
"""

from __future__ import annotations

import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from shardvault.contracts.pgwal import lsn_number
from shardvault_agent.backup.blockmap import BLOCK_SIZE

if TYPE_CHECKING:  # not at run time: the mapped screen's helper imports this module alone
    from shardvault_agent.engines.base import BlockScreen

# A relation's file: its database (or ``global``; in a tablespace, the database's directory
# in its version directory), its file node, its fork (none: the main fork) and its 1 GiB
# segment. The listing skips unlogged relations' forks by it too.
RELATION_FILE = re.compile(
    r"^(?P<db>base/\d+|global|pg_tblspc/\d+/PG_[^/]+/\d+)/"
    r"(?P<node>\d+)(?P<fork>_fsm|_vm|_init)?(\.\d+)?$"
)
LSN_SIZE = 8
LSN_HALVES = struct.Struct("=II")  # native order, high half first


@dataclass(frozen=True)
class PageLsnScreen:
    """Pages whose LSN is zero or at or after ``since`` may differ (see the module docstring)."""

    since: int

    def screens(self, path: str) -> bool:
        match = RELATION_FILE.match(path)
        return match is not None and match["fork"] is None

    def may_differ(self, blocks: memoryview, block_size: int) -> list[int]:
        whole = len(blocks) // block_size
        lsns = whole_page_lsns(blocks, block_size)
        differ = np.flatnonzero((lsns == 0) | (lsns >= self.since)).tolist()
        tail = memoryview(blocks)[whole * block_size :]
        if tail and not (len(tail) >= LSN_SIZE and 0 < _lsn(tail[:LSN_SIZE]) < self.since):
            differ.append(whole)  # a cut-short page, unless its LSN proves it unchanged
        return differ


def whole_page_lsns(blocks: memoryview | bytes, block_size: int = BLOCK_SIZE) -> np.ndarray:
    """The page LSNs of ``blocks``' whole pages (a cut-short last one left out), as unsigned
    64-bit numbers: each page's two native 32-bit halves read in place, in C, a MiB of
    pages in microseconds (a Python loop over them took a tenth of the scan's time)."""
    whole = len(blocks) // block_size
    halves = np.frombuffer(blocks, dtype=np.uint32, count=whole * block_size // 4)
    pages = halves.reshape(whole, block_size // 4)
    return pages[:, 0].astype(np.uint64) << np.uint64(32) | pages[:, 1]


def page_lsns(blocks: memoryview | bytes, block_size: int = BLOCK_SIZE) -> list[int | None]:
    """The page LSN of each block of ``blocks`` (consecutive blocks, the last possibly cut
    short); None for a block too short to hold one."""
    view = memoryview(blocks)
    whole = len(view) // block_size
    raw: list[int | None] = whole_page_lsns(view, block_size).tolist()
    tail = view[whole * block_size :]
    if tail:
        raw.append(_lsn(tail[:LSN_SIZE]) if len(tail) >= LSN_SIZE else None)
    return raw


def _lsn(header: bytes) -> int:
    high, low = LSN_HALVES.unpack(header)
    return high << 32 | low


def system_identifier(data_dir: Path) -> str:
    """The cluster's system identifier, from ``pg_control`` (read as a file: no privilege
    asked of the server); "" when it cannot be read (no screen then)."""
    try:
        with open(data_dir / "global" / "pg_control", "rb") as control:
            head = control.read(8)
    except OSError:
        return ""
    return str(int.from_bytes(head, sys.byteorder)) if len(head) == 8 else ""


def screen_since(marker: dict[str, str], parent_marker: dict[str, str]) -> BlockScreen | None:
    """The screen for a capture with ``marker`` against its parent's, or None when it cannot
    prove anything (see the module docstring)."""
    try:
        start, since = lsn_number(marker["start_lsn"]), lsn_number(parent_marker["start_lsn"])
        same_timeline = marker["start_wal"][:8] == parent_marker["start_wal"][:8]
        cluster = marker["system_identifier"]
        same_cluster = bool(cluster) and cluster == parent_marker["system_identifier"]
        pages_fit = int(marker.get("block_size", 0)) == BLOCK_SIZE
    except (KeyError, ValueError, TypeError):
        return None
    if not (same_cluster and same_timeline and pages_fit) or since > start:
        return None
    return PageLsnScreen(since)
