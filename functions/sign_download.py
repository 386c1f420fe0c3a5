"""Lambda: presigned GET URLs for a restore (agents hold no store keys): of one object of the
Download map, or of the objects a node prefetches as it prepares."""

from pydantic import BaseModel, model_validator

from shardvault.aws.lambda_support import logger, parse, services, tracer
from shardvault.contracts.models import DownloadItem
from shardvault.restore import download, planner


class SignDownloadRequest(BaseModel):
    object: DownloadItem | None = None
    prefetch_key: str | None = None  # a node's prefetched items in the work bucket

    @model_validator(mode="after")
    def _one_of(self) -> "SignDownloadRequest":
        if (self.object is None) == (self.prefetch_key is None):
            raise ValueError("give either object or prefetch_key")
        return self


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    request = parse(SignDownloadRequest, event)
    if request.object is not None:
        return download.sign_download(request.object, services())
    return planner.sign_prefetch(str(request.prefetch_key), services())
