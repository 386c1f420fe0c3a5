"""Lambda: write the manifest of a verified backup and record it in the catalog."""

import time

from aws_lambda_powertools.metrics import MetricUnit
from pydantic import BaseModel

from shardvault import backup
from shardvault.aws.lambda_support import log_outcome, logger, metrics, parse, services, tracer
from shardvault.contracts.models import BackupContext


class FinalizeRequest(BaseModel):
    backup: BackupContext


@logger.inject_lambda_context
@tracer.capture_lambda_handler
@metrics.log_metrics
def lambda_handler(event: dict, context: object) -> dict:
    request = parse(FinalizeRequest, event)
    summary = backup.finalize(request.backup, services(), time.time())
    log_outcome("backup", request.backup.cluster, summary)
    metrics.add_metric(name="BackupsSucceeded", unit=MetricUnit.Count, value=1)
    metrics.add_metric(name="BackupBytes", unit=MetricUnit.Bytes, value=summary["bytes"])
    return summary
