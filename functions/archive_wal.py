"""Lambda: the WAL archive's three calls from an agent (``shardvault.wal.archive``): its cluster's
archive settings, a PUT URL for a packed batch, and the record of a stored one.

Agents invoke it directly (their role may invoke this function and no other). What it signs
or records is read from the node's own inbox partition, never taken from the invocation."""

import time

from shardvault.aws.lambda_support import logger, parse, services, tracer
from shardvault.contracts import wal_archive
from shardvault.wal import archive


@logger.inject_lambda_context
@tracer.capture_lambda_handler(capture_response=False)  # the answer holds a presigned URL
def lambda_handler(event: dict, context: object) -> dict:
    return archive.call(services(), parse(wal_archive.ArchiveCall, event), time.time())
