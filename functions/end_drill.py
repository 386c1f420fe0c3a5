"""Lambda: a drill's copy (and any stale copy before it) torn down: recorded."""

import time

from pydantic import BaseModel

from shardvault import drills
from shardvault.lambda_support import logger, parse, services, tracer


class EndDrillRequest(BaseModel):
    drill: drills.DrillContext


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    request = parse(EndDrillRequest, event)
    return drills.end(request.drill, services(), time.time())
