"""Lambda: the scheduled cut's two steps (``shardvault.backup.cuts``): plan the cut (its id, its
nodes), then record what the nodes' restore points made of it."""

import time

from shardvault.aws.lambda_support import logger, parse, services, tracer
from shardvault.backup import cuts


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    step = parse(cuts.CutStep, event)
    if step.phase == "plan":
        return cuts.plan(parse(cuts.CutClusterRequest, step.request), services(), time.time())
    return cuts.record(step, services(), time.time())
