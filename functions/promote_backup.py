"""Lambda: copy a verified backup into the vault (class, Object Lock), for a time budget;
called again while objects remain; writes the vault's manifest last."""

import time

from pydantic import BaseModel

from shardvault.aws.lambda_support import logger, parse, services, tracer
from shardvault.contracts.models import BackupContext
from shardvault.lifecycle import promote


class PromoteRequest(BaseModel):
    backup: BackupContext
    summary: dict


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    request = parse(PromoteRequest, event)
    return promote.promote(request.backup, request.summary, services(), time.time())
