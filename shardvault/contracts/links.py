"""Linked directories: a shard's directories that live outside its data directory, reached
through a symbolic link inside it (PostgreSQL's tablespaces: ``pg_tblspc/<oid>``, a link to a
directory on another disk).

Terms:
- *linked directory*: the link's path in the shard, the name an operator knows the directory
  by (the tablespace's), and where it was on the source. A capture's marker lists them
  (``LINKS_MARKER``, JSON); the backup stores their files under the link's path, as any other.
- *placement*: where a restore puts one on the target node. By default a directory of its own
  in the node's ``restore_dir`` (``.linked/<restore_id>/<shard_id>/<last part of the path>``:
  never a shard's directory, never another restore's); a request may *remap* one, by name,
  to a directory of the operator's (``RestoreRequest.tablespaces``: ``[SHARD:]NAME`` →
  an absolute directory). The node links the shard's path to it before any byte arrives, so
  the bytes are written where they stay, and removes it with the copy.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import PurePosixPath

from shardvault.errors import InvalidRequest

LINKS_MARKER = "links"  # the marker's key: a JSON list of LinkedDir
DEFAULT_AREA = ".linked"  # in restore_dir: the default placements, per restore and shard
# A remapped directory's path: absolute, printable, no "." or ".." part (it is created by a
# root agent, and PostgreSQL writes it into its catalog).
_PRINTABLE = re.compile(r"^/[^\x00-\x1f\x7f]*$")


# A link's path in a shard: plain names, one or more (a root agent links it in its staging).
LINK_PATH = re.compile(r"^[A-Za-z0-9_]+(/[A-Za-z0-9_]+)*$")


@dataclass(frozen=True)
class LinkedDir:
    path: str  # the link's path in the shard (``pg_tblspc/16385``)
    name: str  # the name an operator knows it by (the tablespace's)
    source: str  # the directory it was on the source node

    def __post_init__(self) -> None:
        if not LINK_PATH.fullmatch(self.path):
            raise InvalidRequest(
                f"linked directory {self.path!r} is not a plain path inside its shard.",
                fix="the backup's marker is damaged or forged: restore another backup.",
            )


def encode(linked: list[LinkedDir]) -> str:
    return json.dumps([vars(d) for d in sorted(linked, key=lambda d: d.path)])


def linked_dirs(marker: dict[str, str]) -> list[LinkedDir]:
    """The linked directories a capture's marker lists (none: the key absent)."""
    raw = marker.get(LINKS_MARKER)
    return [LinkedDir(**item) for item in json.loads(raw)] if raw else []


def default_placement(restore_id: str, shard_id: str, link_path: str) -> PurePosixPath:
    """Where a linked directory goes when the request does not remap it, relative to
    ``restore_dir``."""
    return PurePosixPath(DEFAULT_AREA, restore_id, shard_id, PurePosixPath(link_path).name)


def check_directory(directory: str) -> str:
    """A remapped directory as a request may name it: absolute and plain, or refused by name."""
    parts = PurePosixPath(directory).parts
    if not _PRINTABLE.fullmatch(directory) or ".." in parts or "." in directory.split("/"):
        raise InvalidRequest(
            f"tablespace directory {directory!r} is not a plain absolute path.",
            fix="give an absolute directory without '.', '..' or control characters.",
        )
    return str(PurePosixPath(directory))


def remaps(
    requested: dict[str, str], shards: dict[str, list[LinkedDir]]
) -> dict[str, dict[str, str]]:
    """The request's remaps (``[SHARD:]NAME`` → directory) by shard: link path → directory.
    A name without a shard remaps it in every shard that has it (a one-shard cluster's
    usual case; two shards given one directory are refused). Refuses by name a name no
    shard has, a shard the backup lacks, and one directory given twice."""
    placed: dict[str, dict[str, str]] = {}
    for key, given in requested.items():
        shard_id, _, name = key.rpartition(":")
        directory = check_directory(given)
        if shard_id and shard_id not in shards:
            raise InvalidRequest(
                f"tablespace {key!r}: the backup has no shard {shard_id!r}.",
                fix=f"name one of its shards: {', '.join(sorted(shards))}.",
            )
        hits = [
            (sid, d)
            for sid, dirs in sorted(shards.items())
            if sid == shard_id or not shard_id
            for d in dirs
            if d.name == name
        ]
        if not hits:
            known = sorted({f"{sid}:{d.name}" for sid, dirs in shards.items() for d in dirs})
            raise InvalidRequest(
                f"tablespace {key!r} is not in the backup.",
                fix="name one it holds: " + (", ".join(known) if known else "it holds none") + ".",
            )
        if len(hits) > 1:
            raise InvalidRequest(
                f"tablespace {name!r} is in shards {', '.join(sid for sid, _ in hits)}: one "
                f"directory cannot hold both.",
                fix=f"remap each by shard: --tablespace {hits[0][0]}:{name}=DIR, ...",
            )
        sid, linked = hits[0]
        placed.setdefault(sid, {})[linked.path] = directory
    given = [d for dirs in placed.values() for d in dirs.values()]
    if twice := sorted({d for d in given if given.count(d) > 1}):
        raise InvalidRequest(
            f"directory {twice[0]} is given to more than one tablespace.",
            fix="give each tablespace a directory of its own.",
        )
    return placed
