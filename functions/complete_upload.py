"""Lambda: complete an object's multipart upload (if it has one) and verify the stored object
against the agent's checksum."""

from aws_lambda_powertools.metrics import MetricUnit
from pydantic import BaseModel

from shardvault import backup
from shardvault.aws.lambda_support import logger, metrics, parse, services, tracer
from shardvault.contracts.models import ObjectChecksums, ObjectPlan, UploadedPart


class CompleteRequest(BaseModel):
    object: ObjectPlan
    checksums: ObjectChecksums
    upload_id: str | None  # None: a single PUT (nothing to complete, only to verify)
    uploaded: list[UploadedPart]


@logger.inject_lambda_context
@tracer.capture_lambda_handler
@metrics.log_metrics
def lambda_handler(event: dict, context: object) -> dict:
    request = parse(CompleteRequest, event)
    result = backup.complete(
        request.object, request.checksums, request.upload_id, request.uploaded, services()
    )
    metrics.add_metric(name="BytesUploaded", unit=MetricUnit.Bytes, value=result.length)
    return {"key": result.key, "verified_by": result.verified_by}
