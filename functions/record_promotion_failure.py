"""Lambda: record that a complete backup could not be promoted (it stays in the store)."""

import time

from pydantic import BaseModel

from shardvault.aws.lambda_support import logger, parse, services, tracer
from shardvault.contracts.models import BackupContext
from shardvault.lifecycle import promote


class PromotionFailureRequest(BaseModel):
    backup: BackupContext
    error: dict


@logger.inject_lambda_context(log_event=True)
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    request = parse(PromotionFailureRequest, event)
    return promote.record_failure(request.backup, request.error, services(), time.time())
