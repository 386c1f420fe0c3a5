"""Lambda (``.waitForTaskToken``): post a command and its task token to a node's inbox."""

import time

from shardvault.dispatch import DispatchRequest, dispatch
from shardvault.lambda_support import logger, parse, services, tracer


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    return dispatch(parse(DispatchRequest, event), services(), time.time())
