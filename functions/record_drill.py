"""Lambda: a drill's verdict and RTO from its restore's outcome, recorded and sent."""

import time

from pydantic import BaseModel

from shardvault.assurance import drills
from shardvault.aws.lambda_support import log_outcome, logger, parse, services, tracer


class RecordDrillRequest(BaseModel):
    drill: drills.DrillContext
    restored: dict | None = None  # the nested restore's result ({"output": its summary})
    error: dict | None = None  # or its failure


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    request = parse(RecordDrillRequest, event)
    result = drills.record(request.drill, request.restored, request.error, services(), time.time())
    # No metric of its own: a drill that did not pass fails its execution, and the drill
    # state machine's ExecutionsFailed alarm is the one to watch.
    log_outcome("drill", request.drill.cluster, {"status": result["verdict"], **result})
    return {"drill": request.drill.model_dump(mode="json"), "result": result}
