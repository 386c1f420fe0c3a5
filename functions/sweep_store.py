"""Lambda: abort multipart uploads and delete partial objects that no running backup owns and
no manifest names (``shardvault.lifecycle.sweep``); part of the daily retention run.

Input: ``{"dry_run": false}``.
"""

import time

from pydantic import BaseModel, ConfigDict, StrictBool

from shardvault.aws.lambda_support import logger, parse, services, tracer
from shardvault.lifecycle import sweep


class SweepRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dry_run: StrictBool = False


@logger.inject_lambda_context(log_event=True)
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    request = parse(SweepRequest, event)
    return sweep.sweep(services(), time.time(), dry_run=request.dry_run)
