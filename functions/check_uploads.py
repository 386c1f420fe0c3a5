"""Lambda: check that every planned object of a phase was uploaded and verified."""

from pydantic import BaseModel

from shardvault import backup
from shardvault.aws.lambda_support import logger, parse, services, tracer
from shardvault.contracts.models import BackupContext, Phase


class CheckRequest(BaseModel):
    backup: BackupContext
    phase: Phase


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    request = parse(CheckRequest, event)
    return backup.check_uploads(request.backup, request.phase, services())
