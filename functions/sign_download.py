"""Lambda: a presigned GET URL for one object of a restore (agents hold no store keys)."""

from pydantic import BaseModel

from shardvault import restore
from shardvault.lambda_support import logger, parse, services, tracer
from shardvault.models import DownloadItem


class SignDownloadRequest(BaseModel):
    object: DownloadItem


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    return restore.sign_download(parse(SignDownloadRequest, event).object, services())
