"""Lambda: verify a backup and its chain in the store without a restore, and record the
outcome in its catalog record (``shardvault.assurance.verify``)."""

import time

from shardvault.assurance import verify
from shardvault.aws.lambda_support import logger, parse, services, tracer


@logger.inject_lambda_context(log_event=True)
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    request = parse(verify.VerifyRequest, event.get("request"))
    return verify.verify(request, services(), time.time())
