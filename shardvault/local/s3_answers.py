"""S3's answers, served locally: a fault proxy in front of MinIO.

MinIO never answers as AWS S3 does in a few cases an agent must survive; this proxy does.

- *Proxy*: a threaded HTTP server that forwards every request to the *upstream* (MinIO)
  unchanged, the ``Host`` header included, and streams bodies both ways. MinIO checks a
  presigned URL's SigV4 signature against the Host it receives, so a URL presigned for the
  proxy's host:port (``LocalStack.presign_store_through``) verifies at MinIO.
- *Answer*: an S3 error answer (``Answer``): its HTTP status and its XML document
  ``<Error><Code>…</Code><Message>…</Message></Error>``; a 307 also names a ``Location``
  (here the same URL: the signature covers the host, so the agent cannot follow it anyway).
  ``TEMPORARY_REDIRECT`` is S3's global host for a bucket whose name has not spread yet,
  ``EXPIRED_TOKEN`` a URL signed by a role session that ended (the signing Lambda's),
  ``REQUEST_TIMEOUT`` a body S3 waited for too long.
- *Fault plan* (``FaultPlan``): which requests get an answer instead of MinIO's: those of a
  method (PUT), either the first of each distinct *part* (the path and its ``partNumber``
  query parameter, so a single PUT is a part too) or every one. The proxy reads and discards
  the body of a request it answers, as S3 does before it answers.
- *Served*: how many answers of each code the proxy gave (``served``), for a test to check
  its faults were met.
"""

from __future__ import annotations

import functools
import http.client
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import SplitResult, parse_qs, urlsplit, urlunsplit
from xml.sax.saxutils import escape

CHUNK = 1024 * 1024  # bodies are relayed in pieces this large: parts are MiBs
# Connection-level headers: they describe one hop, not the request (RFC 9110 section 7.6.1);
# Expect is answered by this hop (its 100 Continue), not passed on.
HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "upgrade"}
)
NO_BODY_STATUSES = (204, 304)


@dataclass(frozen=True)
class Answer:
    """One S3 error answer: ``status``, and the ``code`` and ``message`` of its document."""

    status: int
    code: str
    message: str

    def document(self, resource: str, host: str) -> bytes:
        extra = f"<Endpoint>{escape(host)}</Endpoint>" if self.status == 307 else ""
        return (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{self.code}</Code><Message>{escape(self.message)}</Message>"
            f"{extra}<Resource>{escape(resource)}</Resource>"
            "<RequestId>SHARDVAULTFAULT0</RequestId><HostId>shardvault-s3-answers</HostId>"
            "</Error>"
        ).encode()


# S3's own wording (its error responses reference).
TEMPORARY_REDIRECT = Answer(
    307,
    "TemporaryRedirect",
    "Please re-send this request to the specified temporary endpoint. Continue to use the "
    "original request endpoint for future requests.",
)
EXPIRED_TOKEN = Answer(400, "ExpiredToken", "The provided token has expired.")
REQUEST_TIMEOUT = Answer(
    400,
    "RequestTimeout",
    "Your socket connection to the server was not read from or written to within the "
    "timeout period. Idle connections will be closed.",
)


@dataclass(frozen=True)
class FaultPlan:
    """Which requests get ``answer`` (None: none, every request reaches the upstream):
    those of ``method``, the first of each distinct part (``every``: all of them)."""

    answer: Answer | None = None
    method: str = "PUT"
    every: bool = False


PASS_THROUGH = FaultPlan()


def part_of(path: str) -> tuple[str, str]:
    """The part a request writes: its path and its ``partNumber`` ("" for a single PUT)."""
    url = urlsplit(path)
    return url.path, parse_qs(url.query).get("partNumber", [""])[0]


class S3AnswersProxy:
    """The proxy (see the module): ``with S3AnswersProxy(upstream) as proxy``, then point
    presigned URLs at ``proxy.endpoint`` and set ``proxy.plan``."""

    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 0) -> None:
        target = urlsplit(upstream)
        if target.scheme != "http" or not target.hostname:
            raise ValueError(f"upstream {upstream!r} is not an http://host:port endpoint")
        self.upstream = (target.hostname, target.port or 80)
        self.served: Counter[str] = Counter()
        self.answered: list[tuple[str, str]] = []  # the parts (``part_of``) answered, in order
        self._plan = PASS_THROUGH
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer((host, port), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="s3-answers", daemon=True
        )

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def plan(self) -> FaultPlan:
        return self._plan

    @plan.setter
    def plan(self, plan: FaultPlan) -> None:
        """A new plan starts afresh: no part seen, nothing served."""
        with self._lock:
            self._plan, self._seen = plan, set()
            self.served.clear()
            self.answered.clear()

    def fault_for(self, method: str, path: str) -> Answer | None:
        """The answer this request gets instead of the upstream's, if the plan says so."""
        with self._lock:
            plan = self._plan
            if plan.answer is None or method != plan.method:
                return None
            part = part_of(path)
            if not plan.every and part in self._seen:
                return None
            self._seen.add(part)
            self.served[plan.answer.code] += 1
            self.answered.append(part)
            return plan.answer

    def start(self) -> S3AnswersProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> S3AnswersProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _handler_for(proxy: S3AnswersProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(_ProxyHandler):
        owner = proxy

    return Handler


class _ProxyHandler(BaseHTTPRequestHandler):
    owner: S3AnswersProxy
    protocol_version = "HTTP/1.1"  # keep-alive, as the agents' connection pools expect

    def do_GET(self) -> None:
        self._serve()

    do_PUT = do_POST = do_HEAD = do_DELETE = do_GET

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: a request per part would bury the test's own output."""

    def _serve(self) -> None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            # The agents always send Content-Length; relaying chunks is not worth the code.
            self._answer_plain(501, b"chunked request bodies are not relayed")
            return
        length = int(self.headers.get("Content-Length") or 0)
        answer = self.owner.fault_for(self.command, self.path)
        if answer is not None:
            self._discard(length)
            self._answer_fault(answer)
        else:
            self._forward(length)

    def _discard(self, length: int) -> None:
        """Reads the body the client sends: S3 reads it before it answers, and a client
        still sending would otherwise meet a closed connection, not the answer."""
        while length > 0:
            piece = self.rfile.read(min(CHUNK, length))
            if not piece:
                break
            length -= len(piece)

    def _answer_fault(self, answer: Answer) -> None:
        host = self.headers.get("Host", "")
        body = answer.document(urlsplit(self.path).path, host)
        self.send_response(answer.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        if answer.status == 307:
            self.send_header("Location", f"http://{host}{self.path}")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _answer_plain(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def _forward(self, length: int) -> None:
        """The request to the upstream as received (Host included), its answer back."""
        upstream = http.client.HTTPConnection(*self.owner.upstream, timeout=300)
        try:
            upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in HOP_HEADERS and name.lower() != "expect":
                    upstream.putheader(name, value)
            upstream.endheaders()
            self._relay_body(upstream, length)
            self._relay_response(upstream.getresponse())
        finally:
            upstream.close()

    def _relay_body(self, upstream: http.client.HTTPConnection, length: int) -> None:
        while length > 0:
            piece = self.rfile.read(min(CHUNK, length))
            if not piece:
                raise ConnectionError("the client closed before sending its whole body")
            upstream.send(piece)
            length -= len(piece)

    def _relay_response(self, response: http.client.HTTPResponse) -> None:
        # http.client undoes chunking: such a body goes back chunked again, piece by piece.
        chunked = response.getheader("Content-Length") is None and self._has_body(response)
        self.send_response_only(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in HOP_HEADERS:
                self.send_header(name, value)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if not self._has_body(response):
            return
        while piece := response.read(CHUNK):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
        if chunked:
            self.wfile.write(b"0\r\n\r\n")

    def _has_body(self, response: http.client.HTTPResponse) -> bool:
        return self.command != "HEAD" and response.status not in NO_BODY_STATUSES


def presign_through(endpoint: str) -> Callable[[Any], Any]:
    """A client binding (``Services.bind``) that points the URLs an S3 client presigns at
    ``endpoint`` (the proxy) before they are signed; its own calls still go where they went."""
    place = urlsplit(endpoint)

    def bind(client: Any) -> Any:
        client.meta.events.register_last("before-sign.s3", functools.partial(_presign_to, place))
        return client

    return bind


def _presign_to(endpoint: SplitResult, request: Any, **_: Any) -> None:
    """The signature covers the host: a URL signed for the proxy's, which passes the Host
    header through unchanged, verifies at a store that checks it against the Host it gets."""
    if request.context.get("is_presign_request"):
        url = urlsplit(request.url)
        request.url = urlunsplit(url._replace(scheme=endpoint.scheme, netloc=endpoint.netloc))
