"""Lambda: after a per-node Distributed Map, fail with the first node's own error
(``shardvault.workflow.fanout``)."""

from pydantic import BaseModel

from shardvault.aws.lambda_support import logger, parse, tracer
from shardvault.workflow import fanout


class CheckNodesRequest(BaseModel):
    results: list[dict]


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    return fanout.raise_first_failure(parse(CheckNodesRequest, event).results)
