"""Lambda (``.waitForTaskToken``): post a command and its task token to a node's inbox, then
ring the node's doorbell queue."""

import time
from functools import cache
from typing import Any

import boto3

from shardvault.dispatch import DispatchRequest, dispatch
from shardvault.lambda_support import logger, parse, services, tracer


@cache
def doorbells() -> Any:
    """The SQS client that rings doorbells, made once per container."""
    return boto3.client("sqs")


@logger.inject_lambda_context
@tracer.capture_lambda_handler
def lambda_handler(event: dict, context: object) -> dict:
    return dispatch(parse(DispatchRequest, event), services(), time.time(), doorbells())
