"""Lambda: write the restore's download items and each node's layout; record it as running."""

from pydantic import BaseModel

from shardvault.aws.lambda_support import logger, parse, services, tracer
from shardvault.contracts.models import RestoreContext
from shardvault.restore import planner


class PlanRequest(BaseModel):
    restore: RestoreContext


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    return planner.plan(parse(PlanRequest, event).restore, services())
