"""Lambda: turn the agents' listings into objects and parts, written as a plan (work bucket)."""

from pydantic import BaseModel

from shardvault import backup
from shardvault.aws.lambda_support import logger, parse, services, tracer
from shardvault.contracts.models import BackupContext, Phase


class PlanRequest(BaseModel):
    backup: BackupContext
    phase: Phase
    results: list[dict]


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    request = parse(PlanRequest, event)
    return backup.plan(request.backup, request.results, request.phase, services())
