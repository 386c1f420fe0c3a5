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
from collections.abc import Callable
from typing import Any

from shardvault.aws.tables import RESTORE_PREFIX
from shardvault.contracts.commands import AbortRestoreArgs, ReleaseArgs
from shardvault.contracts.models import BackupStatus
from shardvault_agent.commands import Commands

log = logging.getLogger("shardvault.agent.reconcile")
StatusOf = Callable[[str], str | None]  # catalog sort key -> status (None: no such item)


def reconcile(commands: Commands, status_of: StatusOf) -> dict[str, list[str]]:
    """Releases ended backups and undoes failed restores this node still holds; returns what
    it did, by kind."""
    done: dict[str, list[str]] = {"released": [], "undone": [], "unstaged": []}
    for backup_id in sorted(commands.held_backups()):
        if status_of(backup_id) != BackupStatus.RUNNING:
            shard_ids = list(commands.shards())
            commands.backup.do_release(ReleaseArgs(backup_id=backup_id, shard_ids=shard_ids))
            done["released"].append(backup_id)
    for restore_id in sorted(commands.restorer.held_restores()):
        status = status_of(f"{RESTORE_PREFIX}{restore_id}")
        if status == BackupStatus.FAILED:
            commands.do_abort_restore(AbortRestoreArgs(backup_id=restore_id))
            done["undone"].append(restore_id)
        elif status == BackupStatus.COMPLETE and commands.restorer.drop_staging(restore_id):
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
