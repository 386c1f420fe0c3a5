"""Lambda (``.waitForTaskToken``): post a command and its task token to a node's inbox, then
ring the node's doorbell queue."""

import time

from shardvault.aws.lambda_support import logger, parse, services, tracer
from shardvault.workflow.dispatch import DispatchRequest, dispatch


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    svc = services()
    return dispatch(parse(DispatchRequest, event), svc, time.time(), svc.doorbells)
