"""Lambda: create an object's multipart upload and sign one URL per part, bound to its checksum
(the URLs go to the work bucket, never into execution history)."""

from pydantic import BaseModel

from shardvault import backup
from shardvault.aws.lambda_support import logger, parse, services, tracer
from shardvault.contracts.models import ObjectChecksums, ObjectPlan


class SignRequest(BaseModel):
    object: ObjectPlan
    checksums: ObjectChecksums
    upload_id: str | None = None


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    request = parse(SignRequest, event)
    return backup.sign(request.object, request.checksums, request.upload_id, services())
