"""Lambda: the failure path of a backup: abort uploads, remove partial objects, mark it failed."""

import time

from aws_lambda_powertools.metrics import MetricUnit
from pydantic import BaseModel

from shardvault import backup
from shardvault.aws.lambda_support import log_outcome, logger, metrics, parse, services, tracer
from shardvault.contracts.models import BackupContext


class CleanupRequest(BaseModel):
    backup: BackupContext
    error: dict


@logger.inject_lambda_context(log_event=True)
@tracer.capture_lambda_handler
@metrics.log_metrics
def lambda_handler(event: dict, context: object) -> dict:
    request = parse(CleanupRequest, event)
    outcome = backup.cleanup(request.backup, request.error, services(), time.time())
    log_outcome("backup", request.backup.cluster, outcome)
    metrics.add_metric(name="BackupsFailed", unit=MetricUnit.Count, value=1)
    return outcome
