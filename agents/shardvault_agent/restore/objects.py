"""One object of a restore, as a target node keeps it: ``ObjectRecord``, and where a chain
object's bytes go: ``Placements``.

An object's state lives under ``state_dir/restores/<restore_id>/objects/``, in files that
share a name (a digest of the object's key) and differ by suffix. ``ObjectRecord`` is the one
place that knows them:

- ``.parts``: the reads that arrived, one line each (read number, CRC64NVME), appended as
  they land, so a resumed download fetches only the rest;
- ``.ok``: the object is written whole, and checked;
- ``.spool``: the object's stored bytes at their offsets in a sparse file: a chain's newer
  object, fetched as its node prepares (*prefetched*), or whose frames patch the root's
  (``overlay``); ``.item``: its download item, which says how to open those frames;
  ``.spooled``: the spool is whole (its CRC64NVME is the manifest's);
- ``.placements``, ``.patches``: a chain object's placements and patches as prepare placed
  them (``Placements``), and ``.supplied``: the bytes of the restored stream it supplies.

Each is written whole or appended line by line, so a crash leaves an object either as it was
or one step further; a retried command reads the record back and goes on.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardvault.contracts.models import DownloadItem

Piece = tuple[int, int, int, int]  # frame, offset in the frame, length, offset in the stream


@dataclass(frozen=True)
class Placements:
    """Where an object's bytes go: pieces of its frames, each ``(frame, offset in the frame,
    length, offset in the restored stream)``, kept flat as 64-bit numbers
    (``chain_placement.object_placements``): a chain of scattered changes makes tens of
    thousands."""

    numbers: array  # type: ignore[type-arg]  # array("q"), four numbers a piece

    @classmethod
    def of(cls, numbers: array | list[int] | None = None) -> Placements:  # type: ignore[type-arg]
        return cls(array("q", numbers or []))

    def __iter__(self) -> Iterator[Piece]:
        n = self.numbers
        return zip(n[0::4], n[1::4], n[2::4], n[3::4], strict=True)

    def __bool__(self) -> bool:
        return bool(self.numbers)

    @property
    def frames(self) -> set[int]:
        """The frames that hold a piece."""
        return set(self.numbers[0::4])


@dataclass(frozen=True)
class ChainPart:
    """What a chain object writes (``placements``; none when newer backups replaced all of
    its bytes), what of it the root's frames take in its stead (``patches``), and the bytes
    of the restored stream it supplies."""

    placements: Placements
    patches: Placements
    supplied: int


@dataclass(frozen=True)
class ObjectRecord:
    """The state of one object of one restore on this node (see the module docstring)."""

    base: Path  # the files' shared path, without a suffix

    @classmethod
    def of(cls, objects_dir: Path, key: str) -> ObjectRecord:
        return cls(objects_dir / hashlib.sha256(key.encode()).hexdigest()[:32])

    def _file(self, suffix: str) -> Path:
        return self.base.with_suffix(suffix)

    def make_room(self) -> None:
        self.base.parent.mkdir(parents=True, exist_ok=True)

    # --- written --------------------------------------------------------------------------
    @property
    def is_written(self) -> bool:
        return self._file(".ok").exists()

    def mark_written(self) -> None:
        self._file(".ok").touch()

    @property
    def is_in(self) -> bool:
        """Written, or spooled whole (a prefetched object, whose bytes that no root frame
        takes may still be on their way from the spool)."""
        return self.is_written or self.is_spooled

    # --- reads that arrived ---------------------------------------------------------------
    def reads(self) -> dict[int, str]:
        """The reads that arrived: their CRC64NVME by read number."""
        path = self._file(".parts")
        if not path.exists():
            return {}
        arrived = {}
        for line in path.read_text().splitlines():
            number, _, crc = line.partition(" ")
            if crc:  # a line cut short by a crash is a read to fetch again
                arrived[int(number)] = crc
        return arrived

    def add_read(self, number: int, crc: str) -> None:
        """Notes one read that arrived; the caller keeps one writer at a time."""
        with self._file(".parts").open("a") as out:
            out.write(f"{number} {crc}\n")

    def forget_reads(self) -> None:
        """A damaged object: a retry fetches it all again."""
        self._file(".parts").unlink(missing_ok=True)

    # --- spool ----------------------------------------------------------------------------
    @property
    def spool(self) -> Path:
        return self._file(".spool")

    def keep_item(self, item: DownloadItem) -> None:
        """Keeps the item that says how to open the spool's frames (``overlay``)."""
        self.make_room()
        self._file(".item").write_text(item.model_dump_json())

    def open_spool(self) -> int:
        """The spool, opened for writing at any offset (what it holds stays)."""
        return os.open(self.spool, os.O_WRONLY | os.O_CREAT, 0o600)

    def spooled_item(self) -> DownloadItem:
        return DownloadItem.model_validate_json(self._file(".item").read_text())

    @property
    def is_spooled(self) -> bool:
        return self._file(".spooled").exists()

    def mark_spooled(self) -> None:
        self._file(".spooled").touch()

    def drop_spool(self) -> None:
        self.spool.unlink(missing_ok=True)

    # --- a chain's placements -------------------------------------------------------------
    def save_chain_part(
        self, placements: np.ndarray | None, patches: np.ndarray | None, supplied: int
    ) -> None:
        self.make_room()
        for suffix, numbers in ((".placements", placements), (".patches", patches)):
            if numbers is not None:  # int64 in the machine's order, as ``array("q")`` reads
                self._file(suffix).write_bytes(numbers.tobytes())
        self._file(".supplied").write_text(str(supplied))

    def chain_part(self) -> ChainPart:
        found = []
        for suffix in (".placements", ".patches"):
            numbers = array("q")
            if (path := self._file(suffix)).exists():
                numbers.frombytes(path.read_bytes())
            found.append(Placements(numbers))
        supplied = self._file(".supplied")
        return ChainPart(found[0], found[1], int(supplied.read_text()) if supplied.exists() else 0)
