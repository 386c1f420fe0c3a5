"""Where moto answers differently from AWS in a way the local stack would notice, mended.

- *Item writes are atomic.* DynamoDB applies each write to an item whole (an ``ADD`` of a
  counter, a conditional put that takes a lock), whoever else writes the item meanwhile.
  moto's backend reads, changes and stores the item in Python with no lock, so two threads
  writing one item at once can lose one write: a restore's progress counter (every download's
  ``ADD`` lands on the restore's one catalog item, eight at a time) came out at half its total
  on a loaded machine. :func:`install` serializes moto's DynamoDB writes in this process, where
  the local stack's Lambdas and its moto server (the agents' requests) both run.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

WRITES = ("put_item", "update_item", "delete_item", "transact_write_items")


@functools.cache  # once per process: a second call would wrap the wrappers
def install() -> None:
    from moto.dynamodb.models import DynamoDBBackend

    lock = threading.RLock()  # a transaction's writes may call the others
    for name in WRITES:
        setattr(DynamoDBBackend, name, _serialized(getattr(DynamoDBBackend, name), lock))


def _serialized(write: Any, lock: threading.RLock) -> Any:
    @functools.wraps(write)
    def serialized(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return write(*args, **kwargs)

    return serialized
