"""Lambda: create an object's multipart upload and sign one URL per part, bound to its checksum."""

from pydantic import BaseModel

from shardvault import backup
from shardvault.lambda_support import logger, parse, services, tracer
from shardvault.models import ObjectChecksums, ObjectPlan, PartChecksum


class SignRequest(BaseModel):
    object: ObjectPlan
    checksums: ObjectChecksums
    upload_id: str | None = None
    changed: list[PartChecksum] = []


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    request = parse(SignRequest, event)
    return backup.sign(
        request.object, request.checksums, request.upload_id, services(), request.changed
    )
