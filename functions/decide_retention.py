"""Lambda: decide which backups expire, per the policy's keep counts (all clusters, or one).

Input: ``{"request": {"cluster": "demo" (optional), "dry_run": false}}``.
"""

import time

from pydantic import BaseModel, ConfigDict, StrictBool

from shardvault.aws.lambda_support import logger, parse, services, tracer
from shardvault.lifecycle import expire


class RetentionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cluster: str | None = None
    dry_run: StrictBool = False


class DecideRequest(BaseModel):
    request: RetentionRequest


@logger.inject_lambda_context(log_event=True)
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    request = parse(DecideRequest, event).request
    return {
        **expire.decide_all(request.cluster, services(), time.time(), dry_run=request.dry_run),
        "dry_run": request.dry_run,
    }
