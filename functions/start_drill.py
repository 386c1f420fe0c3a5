"""Lambda: start a restore drill: check it, pick its backup, find stale copies, record it.

Input: ``{"request": <the execution's input>, "execution_id": "$$.Execution.Id",
"restore_machine": <the restore state machine's ARN>}``. A drill refused here has changed nothing
(a scheduled one is recorded as refused and sent).
"""

import time

from shardvault.assurance import drills
from shardvault.aws.lambda_support import execution_input, logger, parse, services, tracer


@logger.inject_lambda_context(log_event=True)
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    request = execution_input(
        event,
        '{"cluster": "demo"}',
        fix="start the drill with a JSON object naming the cluster (docs/guide/drills.md).",
    )
    return drills.start(
        parse(drills.DrillRequest, request),
        services(),
        time.time(),
        execution_id=str(event.get("execution_id", "")),
        restore_machine=str(event.get("restore_machine", "")),
    )
