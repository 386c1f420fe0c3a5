"""Lambda: per source node, the parent block maps its scan compares with (URLs in _work/)."""

from pydantic import BaseModel

from shardvault.aws.lambda_support import logger, parse, services, tracer
from shardvault.backup.scanning import prepare_scan
from shardvault.contracts.models import BackupContext


class PrepareScanRequest(BaseModel):
    backup: BackupContext


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    return prepare_scan(parse(PrepareScanRequest, event).backup, services())
