"""Lambda: after a restore's Prepare map, fail with the first node's own error, or refuse an
agent too old to prefetch a chain's newer objects."""

from pydantic import BaseModel

from shardvault.aws.lambda_support import logger, parse, tracer
from shardvault.restore import planner


class CheckPreparedRequest(BaseModel):
    results: list[dict]
    nodes: list[dict]


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    request = parse(CheckPreparedRequest, event)
    return planner.check_prepared(request.results, request.nodes)
