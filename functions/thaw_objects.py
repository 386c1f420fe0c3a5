"""Lambda: request the thaw of archived objects; report how many are still frozen."""

from pydantic import BaseModel

from shardvault.aws.lambda_support import logger, parse, services, tracer
from shardvault.contracts.models import RestoreContext
from shardvault.restore import thaw


class ThawRequest(BaseModel):
    restore: RestoreContext
    attempt: int = 0


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    request = parse(ThawRequest, event)
    return thaw.thaw(request.restore, request.attempt, services())
