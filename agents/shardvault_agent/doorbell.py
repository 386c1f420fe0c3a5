"""The node's doorbell: an SQS queue the control plane rings after it posts a command to the
node's inbox, so that an idle agent hears of the command at once without reading its inbox.

Terms:
- *doorbell*: the queue ``shardvault-doorbell-<node_id>``
(``shardvault.contracts.models.doorbell_name``).
  The agent creates it itself at start: ``CreateQueue`` is idempotent for equal attributes,
  and a queue made with other attributes (an older agent's) is given these. Encrypted at
  rest with SQS-managed keys; a message lives ``RETENTION_SECONDS`` (a ring older than that
  is useless: the safety poll has read the inbox since).
- *ring*: one message, ``{"ring": <command id>}``: nothing secret, no URL; it only says "read
  your inbox".
- *listen*: one long poll (``ReceiveMessage``, up to ``doorbell_wait_seconds``, at most 20 s):
  it returns when a ring arrives or the wait ends; the rings it received are deleted.

Transient failures (network, throttling, 5xx) are tried again with the agent's one retry
policy (``retry.py``); what still fails, or cannot succeed by trying again (access denied, a
node id that is no queue name), raises ``DoorbellUnavailable``: the daemon then polls its
inbox as it did before doorbells.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError
from botocore.exceptions import ConnectionError as NetworkError

from shardvault.contracts.models import doorbell_name
from shardvault_agent.retry import RETRYABLE_STATUS, TryAgain, retrying

RETENTION_SECONDS = 300
QUEUE_ATTRIBUTES = {
    "SqsManagedSseEnabled": "true",
    "MessageRetentionPeriod": str(RETENTION_SECONDS),
}
ATTEMPTS = 3  # tries of one call, with backoff (botocore's own retries come on top)
MAX_RINGS = 10  # rings taken by one listen (SQS's most)
T = TypeVar("T")


class DoorbellUnavailable(Exception):
    """The doorbell cannot be created or read; the message says why."""


@dataclass
class Doorbell:
    sqs: Any  # a boto3 SQS client
    url: str
    wait_seconds: int

    @classmethod
    def open(cls, sqs: Any, node_id: str, wait_seconds: int) -> Doorbell:
        """Creates the node's queue, or finds it; raises ``DoorbellUnavailable``."""
        name = doorbell_name(node_id)
        if name is None:
            raise DoorbellUnavailable(
                f"node id {node_id!r} cannot name an SQS queue (it has a '.' or more than 60 "
                "characters); fix: a node id of a-z, 0-9, '-' and '_' gets a doorbell"
            )
        return cls(sqs, call(lambda: create_queue(sqs, name)), wait_seconds)

    def listen(self) -> bool:
        """Waits up to ``wait_seconds`` for rings; True if any came (each is deleted)."""
        received = call(
            lambda: self.sqs.receive_message(
                QueueUrl=self.url,
                MaxNumberOfMessages=MAX_RINGS,
                WaitTimeSeconds=self.wait_seconds,
            )
        )
        rings = received.get("Messages", [])
        if rings:
            # A ring left undeleted comes back after the visibility timeout: one needless read
            # of the inbox, no more, so a failed delete is not retried.
            entries = [
                {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(rings)
            ]
            call(lambda: self.sqs.delete_message_batch(QueueUrl=self.url, Entries=entries), 1)
        return bool(rings)


def create_queue(sqs: Any, name: str) -> str:
    """The queue's URL, after creating it with ``QUEUE_ATTRIBUTES`` or setting them on it."""
    try:
        return sqs.create_queue(QueueName=name, Attributes=QUEUE_ATTRIBUTES)["QueueUrl"]
    except ClientError as error:
        if error.response["Error"]["Code"] not in ("QueueNameExists", "QueueAlreadyExists"):
            raise
    url = sqs.get_queue_url(QueueName=name)["QueueUrl"]
    sqs.set_queue_attributes(QueueUrl=url, Attributes=QUEUE_ATTRIBUTES)
    return url


def call(request: Callable[[], T], attempts: int = ATTEMPTS) -> T:
    """``request()``, tried again on transient errors; ``DoorbellUnavailable`` when it fails."""
    try:
        for attempt in retrying(attempts):
            with attempt:
                try:
                    return request()
                except (BotoCoreError, ClientError) as error:
                    if transient(error):
                        raise TryAgain(str(error)) from error
                    raise DoorbellUnavailable(str(error)) from error
    except TryAgain as error:
        raise DoorbellUnavailable(error.why) from error
    raise AssertionError("unreachable: retrying() returns or raises")


def transient(error: BotoCoreError | ClientError) -> bool:
    """Whether another try may succeed: a network error, throttling or a server error; not a
    refusal (access denied, a missing queue, a bad parameter)."""
    if isinstance(error, BotoCoreError):
        return isinstance(error, (HTTPClientError, NetworkError))  # not e.g. no credentials
    response = error.response
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return status in RETRYABLE_STATUS or "Throttl" in response.get("Error", {}).get("Code", "")
