"""A restored shard's linked directories on its target node (``shardvault.contracts.links``):
placed before any byte arrives, removed with the copy.

- *placement*: the request's remap for the link's path (``ShardLayout.links``), or the
  default in ``restore_dir`` (``links.default_placement``). A remapped directory must lie
  under one of the agent's ``restore_link_dirs`` (the agent runs as root: a request must not
  choose where it writes), outside ``restore_dir`` and the agent's state, and be empty or
  absent; it is checked for every link before any is made.
- *record*: the restore's placements are saved (``Places.links_record``: beside the restore's
  state directory, which an abort's late download removes) before the first is made, so an
  abort removes exactly what the restore placed, even after a crash halfway through: a
  remapped directory's contents (the directory too, if the restore created it) and the
  restore's default area (``.linked/<restore_id>``). A finished restore drops it.
- a *replaced* copy's linked directories go with it when they are in the default area; one
  elsewhere is the operator's, and is left, with a warning naming it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path

from shardvault.contracts.commands import ShardLayout
from shardvault.contracts.links import DEFAULT_AREA, default_placement, linked_dirs
from shardvault.errors import InvalidRequest, TargetNotEmpty, TargetUnsupported
from shardvault_agent.config import AgentConfig, overlaps
from shardvault_agent.statefiles import write_json

log = logging.getLogger("shardvault.agent.restore")


def placements(config: AgentConfig, restore_id: str, shard: ShardLayout) -> dict[str, Path]:
    """Where each of the shard's linked directories goes (link path → directory), checked."""
    restore_dir = config.restore_dir
    assert restore_dir is not None  # a node without one refused the prepare already
    placed = {}
    for linked in linked_dirs(shard.marker):
        remapped = shard.links.get(linked.path)
        if remapped is None:
            placed[linked.path] = restore_dir / default_placement(
                restore_id, shard.shard_id, linked.path
            )
            continue
        placed[linked.path] = allowed_place(config, shard.shard_id, linked.name, Path(remapped))
    return placed


def allowed_place(config: AgentConfig, shard_id: str, name: str, directory: Path) -> Path:
    """``directory`` with its links resolved (as far as it exists: the place checked is the
    place used), if it lies under the agent's ``restore_link_dirs`` and apart from its own
    directories; else refused by name."""
    where = f"tablespace {name} of shard {shard_id} on node {config.node_id}: {directory}"
    resolved = directory.resolve()
    allowed = [d.resolve() for d in config.restore_link_dirs]
    if not any(resolved == d or d in resolved.parents for d in allowed):
        raise InvalidRequest(
            f"{where} is not under the agent's restore_link_dirs "
            f"({', '.join(map(str, allowed)) or 'none'}).",
            fix="add its parent to restore_link_dirs in the node's agent configuration (and "
            "restart the agent), or restore without remapping it (into restore_dir).",
        )
    taken = [config.state_dir.resolve()]
    if config.restore_dir is not None:
        taken.append(config.restore_dir.resolve())
    if clash := [t for t in taken if overlaps(resolved, t)]:
        raise InvalidRequest(
            f"{where} overlaps the agent's {clash[0]}.",
            fix="give the tablespace a directory of its own.",
        )
    return resolved


def refuse_created(shard: ShardLayout, node_id: str) -> None:
    """A point-in-time restore that may replay the creation of a linked directory made after
    its base (``Recovery.created_links``, from the archive's batches: path -> location) is
    refused where that location exists on this node: the replay links the copy to it and
    writes into it (on the source's host, the source's own tablespace). Where it does not
    exist, recovery stops at the creation if it gets there (the engine names that)."""
    created = shard.recovery.created_links if shard.recovery else {}
    shard_id = shard.shard_id
    for path, location in sorted(created.items()):
        if os.path.lexists(location):
            raise TargetUnsupported(
                f"shard {shard_id}: tablespace {path} was created after the base backup, in "
                f"{location}, which exists on node {node_id}: replaying its creation would "
                "write into that directory (on the source's host, the source's own tablespace).",
                fix="restore from a backup taken after the tablespace was created, or onto a "
                f"node where {location} does not exist.",
            )


def to_make(root: Path, shard_id: str, placed: dict[str, Path]) -> dict[str, Path]:
    """The placements not linked yet in ``root`` (the shard's staging: a retried prepare
    keeps links already made); refuses one whose directory holds data."""
    fresh = {
        path: directory
        for path, directory in placed.items()
        if not ((root / path).is_symlink() and Path(os.readlink(root / path)) == directory)
    }
    for path, directory in fresh.items():
        if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
            raise TargetNotEmpty(
                f"{directory}, where the tablespace {path} of shard {shard_id} goes, already "
                "holds data.",
                fix="empty it, or remap the tablespace to another directory (--tablespace).",
            )
    return fresh


def lay_out(record: Path, root: Path, shard_id: str, placed: dict[str, Path]) -> None:
    """Links each of the shard's paths in ``root`` to its directory, making that, once the
    placements are in ``record`` (the restore's, beside its state: ``to_make`` checks them
    first)."""
    fresh = to_make(root, shard_id, placed)
    if not fresh:
        return
    recorded = _read(record)
    for directory in fresh.values():
        recorded.setdefault(str(directory), {"made": not directory.exists()})
    write_json(record, recorded)
    for path, directory in fresh.items():
        directory.mkdir(parents=True, exist_ok=True)
        link = root / path
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink():
            link.unlink()
        link.symlink_to(directory, target_is_directory=True)


def remove_placed(record: Path, restore_dir: Path | None, restore_id: str) -> None:
    """Removes what a restore placed in linked directories (an abort): each recorded
    directory's contents, the directory too if the restore made it, and its default area;
    then the record."""
    for directory, how in _read(record).items():
        empty(Path(directory), remove=how.get("made", False))
    if restore_dir is not None:
        shutil.rmtree(restore_dir / DEFAULT_AREA / restore_id, ignore_errors=True)
        prune([restore_dir / DEFAULT_AREA])
    record.unlink(missing_ok=True)


def remove_with_copy(copy: Path, restore_dir: Path) -> None:
    """Removes a copy (a replaced shard's) with the linked directories placed in the default
    area; warns of those elsewhere (the operator's)."""
    area = (restore_dir / DEFAULT_AREA).resolve()
    for link in links_in(copy):
        target = link.resolve()
        if area in target.parents:
            shutil.rmtree(target, ignore_errors=True)
        else:
            log.warning(
                "the replaced copy %s linked %s to %s, which is left in place: remove it when "
                "it is no longer needed",
                copy, link.relative_to(copy), target,
            )  # fmt: skip
    shutil.rmtree(copy, ignore_errors=True)
    prune([*area.glob("*/*"), *area.glob("*"), area])  # emptied shards, restores, the area


def links_in(root: Path) -> list[Path]:
    """The links to directories in a copy (it is walked without following them)."""
    found = []
    for directory, names, _ in os.walk(root):
        found += [Path(directory, n) for n in names if Path(directory, n).is_symlink()]
    return found


def empty(directory: Path, *, remove: bool) -> None:
    if not directory.is_dir() or directory.is_symlink():
        return
    if remove:
        shutil.rmtree(directory, ignore_errors=True)
        return
    for child in directory.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def prune(directories: list[Path]) -> None:
    """Removes each of ``directories`` that is empty, in order."""
    for directory in directories:
        with contextlib.suppress(OSError):
            directory.rmdir()


def _read(path: Path) -> dict[str, dict[str, bool]]:
    return json.loads(path.read_text()) if path.exists() else {}
