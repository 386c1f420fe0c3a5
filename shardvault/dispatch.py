"""Dispatch: hand a command to one node's agent through its inbox.

The dispatcher runs as a ``.waitForTaskToken`` task: it writes the command with the task
token into the node's inbox and returns; the agent answers the token when the work is done.
A command id is derived from the work it names, so a retried dispatch replaces the earlier
inbox item and the agent finds any work it already did.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from shardvault.errors import AgentUnavailable, InvalidRequest
from shardvault.services import Services

# Validation already refused silent nodes; mid-backup, a late heartbeat (a busy host) is
# tolerated this many times over, since the task's own heartbeat timeout catches a dead agent.
SILENCE_GRACE = 4
BACKUP_COMMANDS = {"flush", "checkpoint", "scan", "pack", "upload", "stop", "release"}
RESTORE_COMMANDS = {"prepare_restore", "download", "finish_restore", "abort_restore"}
COMMANDS = frozenset(BACKUP_COMMANDS | RESTORE_COMMANDS)


class DispatchRequest(BaseModel):
    """``backup_id`` names the operation: a backup's id, or a restore's. Arguments too large
    for the state (a node's restore layout) are in the work bucket at ``args["args_key"]``."""

    task_token: str
    node_id: str
    command: str
    backup_id: str
    args: dict[str, Any] = {}

    @property
    def command_id(self) -> str:
        key = self.args.get("object", {}).get("key", "")
        return ":".join(part for part in (self.command, self.backup_id, key) if part)


def dispatch(request: DispatchRequest, svc: Services, now: float) -> dict[str, str]:
    if request.command not in COMMANDS:
        raise InvalidRequest(
            f"unknown agent command {request.command!r}.",
            fix=f"use one of {', '.join(sorted(COMMANDS))} in the state machine definition.",
        )
    node = svc.nodes.get(request.node_id)
    max_age = svc.settings.heartbeat_max_age_seconds * SILENCE_GRACE
    if node is None or node.status != "up" or now - node.heartbeat_at > max_age:
        state = (
            "not registered" if node is None else f"last heard {now - node.heartbeat_at:.0f} s ago"
        )
        raise AgentUnavailable(
            f"the agent of node {request.node_id} is unavailable ({state}).",
            fix="start or restart shardvault-agent on that node, then retry the backup.",
        )
    args = dict(request.args)
    if key := args.pop("args_key", None):
        args |= svc.get_work(key)
    svc.inbox.post(
        request.node_id,
        request.command_id,
        request.command,
        {**args, "backup_id": request.backup_id},
        request.task_token,
    )
    return {"node_id": request.node_id, "command_id": request.command_id}
