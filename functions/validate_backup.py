"""Lambda: validate a backup request, choose one source per shard, take the cluster's lock."""

import time

from shardvault import backup
from shardvault.lambda_support import logger, parse, services, tracer
from shardvault.models import BackupRequest


@logger.inject_lambda_context(log_event=True)
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    request = parse(BackupRequest, event)
    return backup.validate(request, services(), time.time()).model_dump(mode="json")
