"""Lambda: count one downloaded object in the restore's progress."""

from pydantic import BaseModel

from shardvault.aws.lambda_support import logger, parse, services, tracer
from shardvault.contracts.models import DownloadItem
from shardvault.restore import download


class RecordDownloadRequest(BaseModel):
    object: DownloadItem
    bytes: int | None = None  # what the node wrote (None: a state machine before it said)


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> None:
    request = parse(RecordDownloadRequest, event)
    download.record_download(request.object, request.bytes, services())
