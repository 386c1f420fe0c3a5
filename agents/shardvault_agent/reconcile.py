"""Reconcile at start: what the agent's state directory holds against what is still running.

A starting agent may hold state of operations that ended while it was down or silent: the
snapshots and captures of a backup whose cleanup it never heard of, the staging of a restore
that failed. The control plane posts token-less releases and aborts for that (they wait in the
inbox), but an inbox item expires after a week and a lost one is never posted again; so the
agent also asks the catalog, item by item, whether each operation it holds is still running:

- a backup that is not RUNNING (complete, failed, expired or unknown) is released;
- a restore that FAILED is undone (what it placed is removed, what it replaced put back);
- a restore that is COMPLETE keeps its shards; only its staging leftovers are removed;
- a running or unknown restore is left alone (its shards may be someone's data).

The agent reads only the ``status`` of the items it names (its IAM grant allows nothing
else); when the catalog cannot be read, nothing is touched.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from typing import Any

from shardvault.models import BackupStatus
from shardvault.tables import RESTORE_PREFIX
from shardvault_agent.commands import Commands
from shardvault_agent.restore import INCOMING

log = logging.getLogger("shardvault.agent.reconcile")
StatusOf = Callable[[str], str | None]  # catalog sort key -> status (None: no such item)


def held_backups(commands: Commands) -> set[str]:
    """Backup ids this node holds state of: captures, and the engine's own (snapshots)."""
    state = commands.config.state_dir
    ids = {p.name for p in (state / "backups").glob("*") if p.is_dir()}
    return ids | commands.engine.held_backups()


def held_restores(commands: Commands) -> set[str]:
    state, restore_dir = commands.config.state_dir, commands.config.restore_dir
    ids = {p.name for p in (state / "restores").glob("*") if p.is_dir()}
    if restore_dir is not None:
        ids |= {p.name for p in (restore_dir / INCOMING).glob("*") if p.is_dir()}
    return ids


def reconcile(commands: Commands, status_of: StatusOf) -> dict[str, list[str]]:
    """Releases ended backups and undoes failed restores this node still holds; returns what
    it did, by kind."""
    done: dict[str, list[str]] = {"released": [], "undone": [], "unstaged": []}
    for backup_id in sorted(held_backups(commands)):
        if status_of(backup_id) != BackupStatus.RUNNING:
            shard_ids = list(commands.shards())
            commands.do_release({"backup_id": backup_id, "shard_ids": shard_ids})
            done["released"].append(backup_id)
    for restore_id in sorted(held_restores(commands)):
        status = status_of(f"{RESTORE_PREFIX}{restore_id}")
        if status == BackupStatus.FAILED:
            commands.do_abort_restore({"backup_id": restore_id})
            done["undone"].append(restore_id)
        elif status == BackupStatus.COMPLETE:
            staging = commands.restorer.restore_dir / INCOMING / restore_id
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
                done["unstaged"].append(restore_id)
    return done


def reconcile_safely(commands: Commands, status_of: StatusOf) -> dict[str, Any]:
    """``reconcile``, but an unreadable catalog changes nothing: the agent starts anyway."""
    try:
        done = reconcile(commands, status_of)
    except Exception as error:  # e.g. an older stack without the agent's catalog grant
        log.warning("reconcile skipped: the catalog could not be read: %s", error)
        return {"skipped": str(error)}
    if any(done.values()):
        log.info("reconciled state_dir against the catalog: %s", done)
    return done
