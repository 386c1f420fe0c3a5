"""Answers: what the agents' listing commands (checkpoint, scan, stop) answered, read back.

An agent given an ``answer_url`` (``shardvault.workflow.dispatch``) puts its *answer* (its shards'
listings) in the work bucket there, and answers its task token with a *receipt*
(``contracts.commands.AnswerReceipt``: its node, the answer's size and CRC64NVME). The
receipt comes through Step Functions, sent with the agent's own credentials; the object
through a URL that whoever holds it could use until it expires. So an answer is taken only
when the object is the one its receipt describes (size and checksum) and names the node that
sent it. Every listing is answered so (agent protocol 4): a task result that is not a receipt
is refused.
"""

from __future__ import annotations

import json
from typing import Any

from botocore.exceptions import ClientError

from shardvault.aws.services import Services
from shardvault.aws.store import is_missing
from shardvault.contracts.commands import AnswerReceipt, parse_result
from shardvault.contracts.models import Phase
from shardvault.data.checksums import crc64nvme_of_bytes
from shardvault.errors import AnswerMismatch

# A packed listing is about 4.5 bytes a file: this is room for ten million files on a node,
# and keeps the plan step (which holds every node's answer) far inside its memory.
MAX_ANSWER_BYTES = 64 * 1024 * 1024


def read_answers(
    svc: Services, operation_id: str, phase: Phase, results: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The nodes' answers for ``phase``: each receipt replaced by the answer it vouches for."""
    return [read_answer(svc, operation_id, phase, receipt_of(result)) for result in results]


def receipt_of(result: dict[str, Any]) -> AnswerReceipt:
    return parse_result(AnswerReceipt, str(result.get("node_id", "?")), result)


def read_answer(
    svc: Services, operation_id: str, phase: Phase, receipt: AnswerReceipt
) -> dict[str, Any]:
    node_id, size, crc = receipt.node_id, receipt.answer_bytes, receipt.answer_crc64nvme
    key = svc.answer_key(operation_id, phase, node_id)
    fix = "retry the backup; if it happens again, look for another writer of the work bucket."
    if size > MAX_ANSWER_BYTES:
        raise AnswerMismatch(
            f"node {node_id} answered with {size} bytes of listings, more than the plan step "
            f"reads ({MAX_ANSWER_BYTES}).",
            fix="split the node's shards across more nodes, or raise MAX_ANSWER_BYTES with "
            "the plan function's memory.",
        )
    try:
        stored = svc.work_bucket.get(key)
    except ClientError as error:
        if not is_missing(error):
            raise
        raise AnswerMismatch(
            f"node {node_id} answered its {phase} command, but its answer is not in the "
            "work bucket.",
            fix=fix,
        ) from None
    # The size first: an object replaced by a larger one is refused before it is read.
    length = stored["ContentLength"]
    body = stored["Body"].read() if length == size else b""
    if length != size or crc64nvme_of_bytes(body) != crc:
        stored["Body"].close()
        raise AnswerMismatch(
            f"the {phase} answer of node {node_id} in the work bucket is not the one its "
            f"agent sent ({length} bytes where it sent {size}, or another checksum).",
            fix=fix,
        )
    answer = json.loads(body)
    if answer.get("node_id") != node_id:
        raise AnswerMismatch(
            f"the {phase} answer kept for node {node_id} names node {answer.get('node_id')}.",
            fix=fix,
        )
    return answer
