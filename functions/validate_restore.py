"""Lambda: validate a restore request, resolve its backup and place its shards on the target.

Input: ``{"request": <the execution's input>, "execution_id": "$$.Execution.Id"}``. Reads only:
a request that fails here changes nothing.
"""

import time

from shardvault.aws.lambda_support import execution_input, logger, parse, services, tracer
from shardvault.contracts.models import RestoreRequest
from shardvault.restore import admission


@logger.inject_lambda_context(log_event=True)
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    request = execution_input(
        event,
        '{"cluster": "demo", "target_cluster": "demo-restore"}',
        fix="start the execution with a JSON object naming the backup's cluster and the "
        "target cluster (docs/guide/restoring.md).",
    )
    request = parse(RestoreRequest, {**request, "execution_id": event.get("execution_id", "")})
    return admission.validate(request, services(), time.time()).model_dump(mode="json")
