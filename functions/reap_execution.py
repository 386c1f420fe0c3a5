"""Lambda (EventBridge rule): clean up after a backup or restore execution that was aborted or
timed out.

Such an execution ends without reaching its failure path. For a backup nothing released its
checkpoints, aborted its uploads or released the cluster's lock; for a restore nothing stopped
the servers it started or removed what it placed. The event is Step Functions' "Execution
Status Change" with ``detail.status`` ABORTED or TIMED_OUT; the execution's input tells the
two apart (a restore request names its ``target_cluster``).
"""

import json
import time

from pydantic import BaseModel

from shardvault import backup
from shardvault.aws.lambda_support import logger, parse, services, tracer
from shardvault.restore import failure


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
    if not isinstance(request, dict):
        request = {}
    if target := request.get("target_cluster"):
        return failure.reap(detail.executionArn, detail.status, target, services(), time.time())
    if cluster := request.get("cluster"):
        return backup.reap(detail.executionArn, detail.status, cluster, services(), time.time())
    return {"reaped": False, "why": "the execution's input names no cluster"}
