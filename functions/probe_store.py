"""Lambda: the probe's two steps (``shardvault.assurance.probe``): plan each agent's round trip to
the store, then delete its objects and report each node."""

import time

from shardvault.assurance import probe
from shardvault.aws.lambda_support import logger, parse, services, tracer


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    step = parse(probe.ProbeStep, event)
    if step.phase == "plan":
        request = parse(probe.ProbeRequest, step.request)
        return probe.plan(request, services(), time.time())
    return probe.finish(step, services())
