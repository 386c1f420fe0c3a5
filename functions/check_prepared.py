"""Lambda: after a restore's Prepare map, fail with the first node's own error, refuse an
agent too old to prefetch, and count what the nodes prefetched in the restore's progress."""

from pydantic import BaseModel

from shardvault import restore
from shardvault.lambda_support import logger, parse, services, tracer
from shardvault.models import RestoreContext


class CheckPreparedRequest(BaseModel):
    restore: RestoreContext
    results: list[dict]
    nodes: list[dict]


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    request = parse(CheckPreparedRequest, event)
    return restore.check_prepared(request.restore, request.results, request.nodes, services())
