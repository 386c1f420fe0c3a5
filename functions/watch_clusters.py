"""Lambda: every WATCH_MINUTES (an EventBridge rule), each cluster's backup age and the
deployment's silent agents, published to CloudWatch for the alarms
(``shardvault.assurance.watch``)."""

import time

from shardvault.assurance import watch
from shardvault.aws.lambda_support import logger, services, tracer


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    observed = watch.watch(services(), time.time())
    logger.info("watched", extra=observed)
    return observed
