"""Serve Lambda invocations in-process, for the local stack.

moto's Step Functions interpreter calls Lambda through a boto3 client. A ``before-call``
handler on the default boto3 session answers those calls by running the Python handler of
the named function directly, with the same payload and the same error shape Lambda uses
(``FunctionError`` plus ``{"errorType", "errorMessage"}``), so Retry and Catch by error name
behave as they do on AWS. No Docker is needed.

Agents invoke one function themselves (the WAL archive's), over HTTP from their own processes:
``serve_http`` answers those invocations in moto's server the same way.
"""

from __future__ import annotations

import importlib
import io
import json
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import boto3
from botocore.awsrequest import AWSResponse
from botocore.response import StreamingBody

from shardvault.aws import lambda_support

Handler = Callable[[dict, Any], Any]


@dataclass
class LambdaContext:
    """The attributes of Lambda's context object that Powertools reads."""

    function_name: str
    memory_limit_in_mb: int = 512
    invoked_function_arn: str = ""
    aws_request_id: str = field(default_factory=lambda: str(uuid.uuid4()))

    def get_remaining_time_in_millis(self) -> int:
        return 300_000


def function_name(url_path: str) -> str:
    """``/2015-03-31/functions/<name or ARN>/invocations`` to the bare function name."""
    target = unquote(url_path.split("/functions/", 1)[1].split("/invocations", 1)[0])
    return target.split(":function:", 1)[-1].split(":", 1)[0]


class LambdaBridge:
    def __init__(self, functions: dict[str, str]) -> None:
        """``functions`` maps a function name to its handler's module (``functions.dispatch``)."""
        self.modules = functions
        self.handlers: dict[str, Handler] = {}

    def handler(self, name: str) -> Handler:
        if name not in self.handlers:
            self.handlers[name] = importlib.import_module(self.modules[name]).lambda_handler
        return self.handlers[name]

    def invoke(self, name: str, payload: dict) -> tuple[dict, str | None]:
        """Runs a handler as its function (``lambda_support.FUNCTION``: its clients are its
        role's); returns (payload, FunctionError) as Lambda would."""
        running = lambda_support.FUNCTION.set(self.modules[name].rsplit(".", 1)[-1])
        try:
            return self.handler(name)(payload, LambdaContext(function_name=name)), None
        except Exception as error:
            return {
                "errorType": type(error).__name__,
                "errorMessage": str(error),
                "stackTrace": traceback.format_exception(error)[-5:],
            }, "Unhandled"
        finally:
            lambda_support.FUNCTION.reset(running)

    def before_call(self, params: dict, model: Any, **_: Any) -> tuple[AWSResponse, dict] | None:
        if model.name != "Invoke":
            return None
        name = function_name(params["url_path"])
        if name not in self.modules:
            return None
        body = params.get("body") or b"{}"
        payload = json.loads(body if isinstance(body, (bytes, str)) else body.read())
        result, error = self.invoke(name, payload)
        raw = json.dumps(result).encode()
        response: dict[str, Any] = {
            "StatusCode": 200,
            "ExecutedVersion": "$LATEST",
            "Payload": StreamingBody(io.BytesIO(raw), len(raw)),
            "ResponseMetadata": {"HTTPStatusCode": 200, "RequestId": str(uuid.uuid4())},
        }
        if error:
            response["FunctionError"] = error
        return AWSResponse(params.get("url", ""), 200, {}, None), response

    def serve_http(self) -> None:
        """Answers ``Invoke`` requests that reach moto's server (from other processes) for the
        functions served here, instead of moto's Lambda, which would need Docker."""
        from moto.awslambda.models import LambdaBackend

        bridge, original = self, LambdaBackend.invoke

        def invoke(backend: Any, function_name: str, qualifier: Any, body: Any, *rest: Any):
            name = function_name.split(":function:", 1)[-1].split(":", 1)[0]
            if name not in bridge.modules:
                return original(backend, function_name, qualifier, body, *rest)
            payload = json.loads(body or "{}")
            result, error = bridge.invoke(name, payload)
            if error:
                rest[-1]["x-amz-function-error"] = error  # the response headers
            return json.dumps(result).encode()

        LambdaBackend.invoke = invoke

    def install(self) -> None:
        """Registers on the default boto3 session: every client created from now on uses it."""
        boto3.setup_default_session()
        boto3.DEFAULT_SESSION.events.register("before-call.lambda.Invoke", self.before_call)
