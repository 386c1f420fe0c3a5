"""Where moto answers differently from AWS in a way the local stack would notice, mended.

- *Item writes are atomic.* DynamoDB applies each write to an item whole (an ``ADD`` of a
  counter, a conditional put that takes a lock), whoever else writes the item meanwhile.
  moto's backend reads, changes and stores the item in Python with no lock, so two threads
  writing one item at once can lose one write: a restore's progress counter (every download's
  ``ADD`` lands on the restore's one catalog item, eight at a time) came out at half its total
  on a loaded machine. A read sees no item half written either; moto's ``Query`` walked an
  item's attributes while another thread's write changed them and failed ("dictionary
  changed size during iteration"). :func:`install` serializes moto's DynamoDB requests, each
  whole from parsing to its answer (a transaction's writes with it), in this process, where
  the local stack's Lambdas and its moto server (the agents' requests) both run.
- *Nested executions speak AWS's field names.* A ``states:startExecution.sync:2`` task (the
  drill starts a restore) passes ``StateMachineArn``, ``Name`` and ``Input`` and reads back
  ``ExecutionArn``, ``Output``, ``StartDate`` (milliseconds since the epoch)... as AWS names
  them. moto's interpreter hands the ASL's names to boto3 as they are (which wants
  ``stateMachineArn``: the task failed with ``KeyError``) and returns boto3's names and
  ``datetime`` objects. :func:`install` renames both ways.
"""

from __future__ import annotations

import datetime
import functools
import threading
from typing import Any


@functools.cache  # once per process: a second call would wrap the wrappers
def install() -> None:
    from moto.dynamodb.responses import DynamoHandler

    # Every DynamoDB request reaches moto's backend through its handler's call_action (over
    # HTTP, in-process or under mock_aws): one lock there covers reads and writes.
    DynamoHandler.call_action = _serialized(DynamoHandler.call_action, threading.Lock())
    _name_nested_executions_as_aws()


def _name_nested_executions_as_aws() -> None:
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import (
        state_task_service_sfn as sfn,
    )

    service = sfn.StateTaskServiceSfn
    to_boto = service._normalise_parameters

    def normalise_parameters(self: Any, parameters: dict, *args: Any, **kwargs: Any) -> None:
        to_boto(self, parameters, *args, **kwargs)  # serializes Input, as AWS does
        for key in list(parameters):
            parameters[key[:1].lower() + key[1:]] = parameters.pop(key)

    def normalise_response(self: Any, response: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(response, dict):
            for key in list(response):
                value = response.pop(key)
                if isinstance(value, datetime.datetime):
                    value = int(value.timestamp() * 1000)
                response[key[:1].upper() + key[1:]] = value

    service._normalise_parameters = normalise_parameters
    service._normalise_response = normalise_response


def _serialized(call: Any, lock: threading.Lock) -> Any:
    @functools.wraps(call)
    def serialized(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return call(*args, **kwargs)

    return serialized
