"""Lambda: delete every version of one expired backup's objects (batches of 1,000 keys,
manifest last) and mark it expired in the catalog."""

import time

from pydantic import BaseModel

from shardvault.aws.lambda_support import logger, parse, services, tracer
from shardvault.lifecycle import expire


class ExpireRequest(BaseModel):
    cluster: str
    backup_id: str


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    request = parse(ExpireRequest, event)
    return expire.expire_backup(request.cluster, request.backup_id, services(), time.time())
