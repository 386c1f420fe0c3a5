"""Lambda (EventBridge rule): clean up after a backup execution that was aborted or timed out.

Such an execution ends without reaching its failure path, so nothing released its checkpoints,
aborted its uploads or released the cluster's lock. The event is Step Functions' "Execution
Status Change" with ``detail.status`` ABORTED or TIMED_OUT.
"""

import json
import time

from pydantic import BaseModel

from shardvault import backup
from shardvault.lambda_support import logger, parse, services, tracer


class StatusChange(BaseModel):
    executionArn: str  # Step Functions' own field name
    status: str
    input: str | None = None


class StatusChangeEvent(BaseModel):
    detail: StatusChange


@logger.inject_lambda_context(log_event=True)
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    detail = parse(StatusChangeEvent, event).detail
    try:
        request = json.loads(detail.input or "{}")
    except ValueError:
        request = {}
    cluster = request.get("cluster", "") if isinstance(request, dict) else ""
    if not cluster:
        return {"reaped": False, "why": "the execution's input names no cluster"}
    return backup.reap(detail.executionArn, detail.status, cluster, services(), time.time())
