"""Dispatch: hand a command to one node's agent through its inbox.

The dispatcher runs as a ``.waitForTaskToken`` task: it writes the command with the task
token into the node's inbox and returns; the agent answers the token when the work is done.
A command id is derived from the work it names, so a retried dispatch replaces the earlier
inbox item and the agent finds any work it already did.

*Arguments by URL*: an inbox item is a DynamoDB item (at most 400 KB). Arguments kept in the
work bucket (``args_key``) are inlined when small; larger ones (a node's restore layout of a
shard of many files, the extents of a long chain of scattered changes) go as a presigned GET
URL of their work object (``args_url``, ``args_size``), which the agent reads before it runs
the command. A restore's prepare gets the same way (``prefetch``) the items and presigned URLs
of the chain's objects it downloads as it prepares (``shardvault.restore.planner.sign_prefetch``).

*Answers by URL*: the commands whose answers list a node's files (``ANSWERED``: checkpoint,
scan, stop) get a presigned PUT of one work object (``answer_url``, the key
``Services.answer_key`` names). The agent puts its answer there and answers its task token
with the answer's size and CRC64NVME alone, so that the execution's state, which a Map gathers
from every node, carries a few dozen bytes a node instead of every listing (256 KiB bound a
cluster at about 50 PostgreSQL nodes). The plan step reads the answers back and refuses one
that is not what the token vouched for (``shardvault.backup.answers``).

*Ring*: after the post, the dispatcher sends one small message (``{"ring": <command id>}``,
nothing secret) to the node's *doorbell* queue (``shardvault.contracts.models.doorbell_name``),
which an idle agent long-polls, so it reads its inbox at once instead of every few seconds. A ring
that fails does not fail the dispatch: the agent's safety poll finds the command (within its
``idle_inbox_poll_seconds``).
"""

from __future__ import annotations

import json
import logging
import weakref
from typing import Any

from pydantic import BaseModel

from shardvault.aws.services import Services
from shardvault.contracts.commands import ARGUMENTS, parse_args
from shardvault.contracts.models import NodeRecord, Phase, doorbell_name
from shardvault.errors import AgentUnavailable, InvalidRequest

log = logging.getLogger("shardvault.workflow.dispatch")

# Validation already refused silent nodes; mid-backup, a late heartbeat (a busy host) is
# tolerated this many times over, since the task's own heartbeat timeout catches a dead agent.
SILENCE_GRACE = 4
INLINE_ARGS_BYTES = 96 * 1024  # well under an inbox item's 400 KB, with the rest of the item
COMMANDS = frozenset(ARGUMENTS)  # one model per command (shardvault.contracts.commands)
# The listing commands, and the phase whose listing each answers.
ANSWERED = {"checkpoint": Phase.DATA, "scan": Phase.DATA, "stop": Phase.TAIL}
# As long as the listing commands' tasks wait (their TimeoutSeconds in backup.asl.json, which
# tests/infra holds equal): an answer put later than that is one nobody reads.
ANSWER_URL_TTL_SECONDS = 7200


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


def dispatch(
    request: DispatchRequest, svc: Services, now: float, sqs: Any | None = None
) -> dict[str, str]:
    """Posts the command to the node's inbox, then rings its doorbell with ``sqs`` (an SQS
    client; None: no ring, the agent's safety poll finds the command)."""
    if request.command not in COMMANDS:
        raise InvalidRequest(
            f"unknown agent command {request.command!r}.",
            fix=f"use one of {', '.join(sorted(COMMANDS))} in the state machine definition.",
        )
    node = svc.nodes.get(request.node_id)
    max_age = svc.settings.heartbeat_max_age_seconds * SILENCE_GRACE
    if node is None or node.status != "up" or node.is_silent(now, max_age):
        state = (
            "not registered" if node is None else f"last heard {now - node.heartbeat_at:.0f} s ago"
        )
        raise AgentUnavailable(
            f"the agent of node {request.node_id} is unavailable ({state}).",
            fix="start or restart shardvault-agent on that node, then retry the backup.",
        )
    args = dict(request.args)
    if key := args.pop("args_key", None):
        args |= work_args(svc, key)
    if key := args.pop("prefetch_urls_key", None):  # a restore's prepare: what it prefetches
        args["prefetch"] = work_args(svc, key)
    if key := args.pop("wal_urls_key", None):  # a restore's finish: the WAL it feeds recovery
        args["wal"] = work_args(svc, key)
    if args.pop("scan_args", False):  # a backup's Checkpoint or Scan: the node's parents
        args |= work_args(svc, svc.scan_args_key(request.backup_id, request.node_id))
    if phase := ANSWERED.get(request.command):
        answer_key = svc.answer_key(request.backup_id, phase, request.node_id)
        args["answer_url"] = svc.work_put_url(answer_key, ANSWER_URL_TTL_SECONDS)
    posted = {**args, "backup_id": request.backup_id}
    if "args_url" not in posted:  # by URL: the agent checks them once it has fetched them
        parse_args(request.command, posted)
    svc.inbox.post(request.node_id, request.command_id, request.command, posted, request.task_token)
    if sqs is not None:
        ring(sqs, node, request.command_id)
    return {"node_id": request.node_id, "command_id": request.command_id}


def work_args(svc: Services, key: str) -> dict[str, Any]:
    """A work object's arguments, inlined, or by URL when they are too large for an inbox
    item (see the module docstring)."""
    body = svc.get_work_bytes(key)
    if len(body) <= INLINE_ARGS_BYTES:
        return json.loads(body)
    return {"args_url": svc.work_url(key), "args_size": len(body)}


def post_untracked(
    svc: Services, node_id: str, command_id: str, command: str, args: dict[str, Any]
) -> None:
    """Posts a command without a task token (a cleanup's release or abort: the agent answers
    nobody) and rings the node's doorbell, so its agent runs it now rather than at its next
    safety poll."""
    parse_args(command, args)
    svc.inbox.post(node_id, command_id, command, args, "")
    ring_node(svc, node_id, command_id)


def ring_node(svc: Services, node_id: str, command_id: str) -> bool:
    """Rings a node's doorbell, looking its record up. Never raises: a cleanup must not fail
    for a ring."""
    try:
        node, sqs = svc.nodes.get(node_id), svc.doorbells
    except Exception as error:
        log.warning("doorbell of node %s not rung for %s (%s)", node_id, command_id, error)
        return False
    return node is not None and ring(sqs, node, command_id)


# Queue URLs by name, per SQS client (a Lambda function's process has one), for its life: a
# queue's URL never changes (a recreated queue gets the same one), and looking it up on every
# dispatch would double the doorbell's requests. Per client, not per process: the local stack
# runs every function in one process, and a function must look the URL up as it does on AWS
# (so its grant to do so is exercised there).
_queue_urls: weakref.WeakKeyDictionary[Any, dict[str, str]] = weakref.WeakKeyDictionary()


def ring(sqs: Any, node: NodeRecord, command_id: str) -> bool:
    """Rings the node's doorbell when its agent has one (its record says so); True if rung.
    Never raises: a failed ring only delays the command until the agent's safety poll. The
    queue is looked up by its name, not by the URL in the record, which the agent wrote."""
    name = doorbell_name(node.node_id)
    if not node.doorbell or name is None:
        return False
    urls = _queue_urls.setdefault(sqs, {})
    try:
        if name not in urls:
            urls[name] = sqs.get_queue_url(QueueName=name)["QueueUrl"]
        sqs.send_message(QueueUrl=urls[name], MessageBody=json.dumps({"ring": command_id}))
    except Exception as error:
        urls.pop(name, None)  # the queue may have gone: look it up again next time
        log.warning(
            "doorbell of node %s not rung for %s (%s): its agent's safety poll will find the "
            "command",
            node.node_id,
            command_id,
            error,
        )
        return False
    return True
