"""Lambda: after a drill's Teardown (or none): the copies that are gone are recorded; after
the drill's own, its target's lock is released."""

import time

from pydantic import BaseModel

from shardvault.assurance import drills
from shardvault.aws.lambda_support import logger, parse, services, tracer


class NoteTeardownRequest(BaseModel):
    drill: drills.DrillContext
    phase: str
    teardown: list[dict]  # the copies asked to be torn down: node, restore and drill ids
    torn_down: list[dict]  # what the Teardown map answered (a node's failure: torn_down false)


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    request = parse(NoteTeardownRequest, event)
    return drills.note_teardown(
        request.drill, request.phase, request.teardown, request.torn_down, services(), time.time()
    )
