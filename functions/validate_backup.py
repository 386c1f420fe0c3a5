"""Lambda: validate a backup request, choose one source per shard, take the cluster's lock.

Input: ``{"request": <the execution's input>, "execution_id": "$$.Execution.Id"}``.
"""

import time

from shardvault import backup
from shardvault.aws.lambda_support import execution_input, logger, parse, services, tracer
from shardvault.contracts.models import BackupRequest
from shardvault.errors import ShardVaultError


@logger.inject_lambda_context(log_event=True)
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    request = execution_input(
        event,
        '{"cluster": "demo"}',
        fix="start the execution with a JSON object naming the cluster.",
    )
    request = parse(BackupRequest, {**request, "execution_id": event.get("execution_id", "")})
    try:
        return backup.validate(request, services(), time.time()).model_dump(mode="json")
    except ShardVaultError as error:
        backup.report_refusal(request, error, services(), time.time())  # wakes someone
        raise
