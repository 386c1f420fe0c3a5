"""Lambda: copy the chain a synthesized full is made from into it, inside the store, for a
time budget; called again while copies remain (shardvault/backup/synthesis.py)."""

from pydantic import BaseModel

from shardvault.aws.lambda_support import logger, parse, services, tracer
from shardvault.backup import synthesis
from shardvault.contracts.models import BackupContext


class SynthesizeRequest(BaseModel):
    backup: BackupContext


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    request = parse(SynthesizeRequest, event)
    return synthesis.synthesize(request.backup, services())
