"""Lambda: the failure path of a restore, after the nodes removed what they wrote: mark it
failed with its cause and notify."""

import time

from aws_lambda_powertools.metrics import MetricUnit
from pydantic import BaseModel

from shardvault.aws.lambda_support import log_outcome, logger, metrics, parse, services, tracer
from shardvault.contracts.models import RestoreContext
from shardvault.restore import failure


class CleanupRestoreRequest(BaseModel):
    restore: RestoreContext
    error: dict


@logger.inject_lambda_context(log_event=True)
@tracer.capture_lambda_handler
@metrics.log_metrics
def lambda_handler(event: dict, context: object) -> dict:
    request = parse(CleanupRestoreRequest, event)
    outcome = failure.cleanup(request.restore, request.error, services(), time.time())
    log_outcome("restore", request.restore.target_cluster, outcome)
    metrics.add_metric(name="RestoresFailed", unit=MetricUnit.Count, value=1)
    return outcome
