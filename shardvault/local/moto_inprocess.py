"""Answer the local stack's own AWS calls in its process, without a round trip over TCP.

The local stack's control plane (the Lambda handlers, moto's Step Functions interpreter, the
reaper's watcher) runs in the process that serves moto, and reached moto over HTTP like any
other client: every call a new TCP connection (werkzeug's server closes each one after its
answer), a new server thread, and an HTTP request parsed on both sides. Measured here: about
8 ms of CPU a call over HTTP against about 4 ms answered in-process (a DynamoDB GetItem, both
sides in one process); a full backup makes a few hundred such calls, on the two cores the
agents and databases share (docs/BENCHMARKS.md).

:func:`install` registers a ``before-send`` handler on boto3's default session: a request to
moto's endpoint is handed to moto's own WSGI application, the one its server runs, as the
server would hand it (a WSGI environ built from the request), and its answer goes back to
botocore as the HTTP response would have. Requests to any other endpoint (MinIO, the store)
go out as before. Agents run in their own processes and still reach moto over HTTP.
"""

from __future__ import annotations

from typing import Any

import boto3
from botocore.awsrequest import AWSPreparedRequest, AWSResponse
from moto.core.botocore_stubber import MockRawResponse
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from werkzeug.test import EnvironBuilder


class InProcessMoto:
    """A ``before-send`` handler answering requests to moto's ``port`` on this host (as
    ``127.0.0.1`` or ``localhost``: moto's interpreter names the latter) with moto's WSGI
    app."""

    def __init__(self, port: int) -> None:
        self.bases = tuple(f"http://{host}:{port}" for host in ("127.0.0.1", "localhost"))
        self.app = DomainDispatcherApplication(create_backend_app)

    def __call__(self, request: AWSPreparedRequest, **_: Any) -> AWSResponse | None:
        base = self.base_of(request.url)
        if base is None:
            return None  # another service (the store's MinIO): over the network as before
        path, _, query = request.url[len(base) :].partition("?")
        environ = EnvironBuilder(
            method=request.method,
            base_url=base,
            path=path or "/",
            query_string=query,
            headers={name: _text(value) for name, value in request.headers.items()},
            data=_body(request.body),
        ).get_environ()
        answer: dict[str, Any] = {}

        def start_response(status: str, headers: list[tuple[str, str]], *_: Any) -> None:
            answer["status"], answer["headers"] = int(status[:3]), dict(headers)

        chunks = self.app(environ, start_response)
        try:
            body = b"".join(chunks)
        finally:
            if hasattr(chunks, "close"):
                chunks.close()
        return AWSResponse(request.url, answer["status"], answer["headers"], MockRawResponse(body))

    def base_of(self, url: str) -> str | None:
        """The moto base ``url`` starts with (a host and port of its own, not a prefix of
        another port's), if any."""
        for base in self.bases:
            if url.startswith(base) and url[len(base) : len(base) + 1] in ("", "/", "?"):
                return base
        return None


def _text(value: str | bytes) -> str:
    return value.decode("latin-1") if isinstance(value, bytes) else value


def _body(body: Any) -> bytes:
    """A request body as bytes: botocore sends bytes, text or a file-like object (which it
    rewinds itself before a retry)."""
    if body is None:
        return b""
    if isinstance(body, str):
        return body.encode()
    if isinstance(body, (bytes, bytearray)):
        return bytes(body)
    return body.read()


def install(port: int) -> InProcessMoto:
    """Answers the default session's requests to moto's ``port`` in-process: every client
    made from it from now on (``LambdaBridge.install`` makes a new default session per
    stack)."""
    handler = InProcessMoto(port)
    boto3.DEFAULT_SESSION.events.register("before-send", handler)
    return handler
