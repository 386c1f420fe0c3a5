"""Lambda: record a validated restore in the catalog and notify."""

import time

from aws_lambda_powertools.metrics import MetricUnit
from pydantic import BaseModel

from shardvault.aws.lambda_support import log_outcome, logger, metrics, parse, services, tracer
from shardvault.contracts.models import RestoreContext
from shardvault.restore import failure


class FinalizeRestoreRequest(BaseModel):
    restore: RestoreContext
    results: list[dict]


@logger.inject_lambda_context
@tracer.capture_lambda_handler
@metrics.log_metrics
def lambda_handler(event: dict, context: object) -> dict:
    request = parse(FinalizeRestoreRequest, event)
    summary = failure.finalize(request.restore, request.results, services(), time.time())
    log_outcome("restore", request.restore.target_cluster, summary)
    metrics.add_metric(name="RestoresSucceeded", unit=MetricUnit.Count, value=1)
    return summary
