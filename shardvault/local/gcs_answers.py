"""GCS's answers about retention, served locally: a proxy in front of fake-gcs-server.

fake-gcs-server keeps an object's retention (mode and retain-until) and reports it, but it
does not hold an object to it: it deletes and replaces a retained object on request, and it
refuses every change to a ``Locked`` retention, extensions included. GCS does the opposite on
all three counts. A vault target's tests must see GCS's answers, so this proxy gives them, as
``moto_fidelity`` does for moto's Object Lock:

- *held*: an object whose retain-until is still ahead. A DELETE of it, and an upload that would
  replace it, are refused: 403, ``retentionPolicyNotMet``, GCS's code.
- *extension*: a PATCH that moves a ``Locked`` retention's retain-until later is accepted, and
  the proxy keeps the new date (the *overlay*). It reports the date in every answer that
  describes the object. A PATCH that removes, unlocks or shortens a ``Locked`` retention is
  refused (403).

- *object retention*: a bucket created with ``enableObjectRetention=true`` reports
  ``objectRetention.mode: Enabled``, which the fake leaves out; an upload that carries a
  retention into a bucket created without it is refused (400), as GCS refuses it.

Everything else is forwarded to the *upstream* (the fake) unchanged, media downloads streamed
as they come. The proxy reads retention from the upstream's metadata of the object, with the
overlay's dates on top. A bucket's retention policy is not modelled: the fake has none, and a
vault target locks each object (docs/design/vault-targets.md).
"""

from __future__ import annotations

import http.client
import json
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.parser import BytesParser
from email.policy import HTTP
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

from shardvault.local import gcs_iam

API = "/storage/v1/b/"
UPLOAD = "/upload/storage/v1/b/"
LOCKED = "Locked"
CHUNK = 1024 * 1024
HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "upgrade"}
)


@dataclass
class Overlay:
    """Retain-until dates the proxy extended, by (bucket, object)."""

    dates: dict[tuple[str, str], str] = field(default_factory=dict)
    guard: threading.Lock = field(default_factory=threading.Lock)

    def get(self, bucket: str, name: str) -> str | None:
        with self.guard:
            return self.dates.get((bucket, name))

    def set(self, bucket: str, name: str, until: str) -> None:
        with self.guard:
            self.dates[(bucket, name)] = until

    def apply(self, bucket: str, resource: dict[str, Any]) -> dict[str, Any]:
        """An object resource as GCS would describe it: the extended date in place."""
        until = self.get(bucket, str(resource.get("name", "")))
        if until is not None and isinstance(resource.get("retention"), dict):
            resource["retention"]["retainUntilTime"] = until
        return resource


def _when(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


def _held(retention: dict[str, Any] | None) -> bool:
    until = _when((retention or {}).get("retainUntilTime"))
    return until is not None and until > datetime.now(UTC)


class GcsAnswersProxy:
    """The proxy: start it, point the client at :attr:`endpoint`, stop it."""

    def __init__(
        self,
        upstream: str,
        host: str = "127.0.0.1",
        port: int = 0,
        permissions: frozenset[str] | None = None,
    ) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.overlay = Overlay()
        self.refused: list[str] = []  # what was refused, for a test to read
        self.rotted: set[tuple[str, str]] = set()  # objects served with a byte flipped
        self.retaining: set[str] = set()  # buckets created with object retention enabled
        # What the caller holds (None: anything): each request is checked (gcs_iam).
        self.permissions = permissions
        self.denied: list[str] = []
        self.server = ThreadingHTTPServer((host, port), _handler_for(self))
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> GcsAnswersProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> GcsAnswersProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def rot(self, bucket: str, name: str) -> None:
        """Tests: bitrot under the lock, which no call can cause: the object's bytes are
        served with their first byte flipped from now on, its metadata unchanged."""
        self.rotted.add((bucket, name))

    # --- what GCS says of an object ---------------------------------------------------------
    def metadata(self, bucket: str, name: str) -> dict[str, Any] | None:
        """The object's resource as GCS reports it (the overlay applied), or None."""
        connection = http.client.HTTPConnection(*self.upstream, timeout=30)
        try:
            connection.request("GET", f"{API}{quote(bucket, safe='')}/o/{quote(name, safe='')}")
            response = connection.getresponse()
            body = response.read()
        finally:
            connection.close()
        if response.status != 200:
            return None
        return self.overlay.apply(bucket, json.loads(body))

    def refusal(self, method: str, bucket: str, name: str, body: bytes) -> str | None:
        """Why GCS would refuse this request on a retained object, or None."""
        current = self.metadata(bucket, name)
        retention = (current or {}).get("retention")
        if method in {"DELETE", "UPLOAD"}:
            if _held(retention):
                until = retention["retainUntilTime"]  # type: ignore[index]
                verb = "deleted" if method == "DELETE" else "replaced"
                return f"Object '{bucket}/{name}' is retained until {until} and cannot be {verb}."
            return None
        asked = json.loads(body or b"{}")
        if "retention" not in asked or not retention or retention.get("mode") != LOCKED:
            return None
        wanted = asked["retention"] or {}
        new, old = _when(wanted.get("retainUntilTime")), _when(retention.get("retainUntilTime"))
        if wanted.get("mode") != LOCKED or new is None or (old is not None and new < old):
            return (
                f"Object '{bucket}/{name}' has a Locked retention until "
                f"{retention.get('retainUntilTime')}: it can be extended, never removed, "
                "unlocked or shortened."
            )
        return None


def _handler_for(proxy: GcsAnswersProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(_Handler):
        pass

    Handler.proxy = proxy
    return Handler


class _Handler(BaseHTTPRequestHandler):
    proxy: GcsAnswersProxy
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._serve()

    do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        parts = urlsplit(self.path)
        method = self.headers.get("X-HTTP-Method-Override") or self.command
        if self.proxy.permissions is not None and not self.headers.get(gcs_iam.ADMIN_HEADER):
            missing = sorted(gcs_iam.needed(method, parts, body) - self.proxy.permissions)
            if missing:
                why = gcs_iam.denial(missing[0], parts.path)
                self.proxy.denied.append(why)
                return self._send(403, _error(403, why, "forbidden"))
        target = _object_of(parts.path.removeprefix("/download"))
        if target is not None and method in ("DELETE", "PATCH", "PUT"):
            bucket, name = target
            why = self.proxy.refusal(method, bucket, name, body)
            if why is not None:
                return self._refuse(why)
            if method in ("PATCH", "PUT") and b'"retention"' in body:
                return self._extend(bucket, name, body)
        if parts.path.rstrip("/") == API.rstrip("/") and self.command == "POST":
            return self._create_bucket(body, parts.query)
        if parts.path.startswith(UPLOAD) and self.command == "POST":
            into = unquote(parts.path[len(UPLOAD) :].split("/", 1)[0])
            if b'"retention"' in body and into not in self.proxy.retaining:
                return self._send(400, _error(400, f"Object retention is not enabled on {into}."))
            written = _upload_name(parts.query, self.headers.get("Content-Type", ""), body)
            if written and "ifGenerationMatch=0" not in parts.query:
                why = self.proxy.refusal("UPLOAD", into, written, b"")
                if why is not None:
                    return self._refuse(why)
        self._forward(body, target, parts.query)

    def _create_bucket(self, body: bytes, query: str) -> None:
        """A bucket created, and whether with object retention (which the fake ignores)."""
        name = json.loads(body or b"{}").get("name", "")
        enabled = [v.lower() for v in parse_qs(query).get("enableObjectRetention", [])] == ["true"]
        self._forward(body, None, query)
        if enabled and name:
            self.proxy.retaining.add(name)

    def _extend(self, bucket: str, name: str, body: bytes) -> None:
        """A Locked retention moved later: kept in the overlay, answered as GCS would."""
        until = json.loads(body)["retention"]["retainUntilTime"]
        current = self.proxy.metadata(bucket, name)
        if current is None:
            return self._send(404, {"error": {"code": 404, "message": "No such object"}})
        retention = current.get("retention") or {}
        if retention.get("mode") != LOCKED:  # the fake takes changes to what is not Locked
            return self._forward(body, (bucket, name), "")
        self.proxy.overlay.set(bucket, name, until)
        self._send(200, self.proxy.overlay.apply(bucket, current))

    def _refuse(self, why: str) -> None:
        self.proxy.refused.append(why)
        error = {"code": 403, "message": why, "errors": [{"reason": "retentionPolicyNotMet"}]}
        self._send(403, {"error": error})

    def _send(self, status: int, document: dict[str, Any]) -> None:
        payload = json.dumps(document).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _forward(self, body: bytes, target: tuple[str, str] | None, query: str) -> None:
        upstream = http.client.HTTPConnection(*self.proxy.upstream, timeout=300)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
            upstream.request(self.command, self.path, body=body or None, headers=headers)
            response = upstream.getresponse()
            json_answer = response.getheader("Content-Type", "").startswith("application/json")
            if self.command == "HEAD" or "alt=media" in query or not json_answer:
                # Media and the like, streamed as they come.
                return self._relay(response, rotted=target in self.proxy.rotted)
            payload = response.read()
            document = json.loads(payload) if payload else None
            if isinstance(document, dict):
                bucket = target[0] if target else _bucket_of(self.path)
                if isinstance(document.get("items"), list):  # a listing
                    document["items"] = [
                        self.proxy.overlay.apply(bucket, item) for item in document["items"]
                    ]
                elif document.get("kind") == "storage#object":
                    self.proxy.overlay.apply(bucket, document)
                    self._media_here(document)
                elif document.get("name") in self.proxy.retaining:  # a bucket's resource
                    document["objectRetention"] = {"mode": "Enabled"}
                payload = json.dumps(document).encode()
            self._send_as(response, payload)
        finally:
            upstream.close()

    def _media_here(self, document: dict[str, Any]) -> None:
        """GCS's media link names the API the client called: here, the proxy, not the fake
        behind it (whose -external-url it would name)."""
        link = document.get("mediaLink")
        if isinstance(link, str):
            host, port = self.server.server_address[:2]
            parts = urlsplit(link)
            document["mediaLink"] = parts._replace(netloc=f"{host!s}:{port}").geturl()

    def _relay(self, response: http.client.HTTPResponse, *, rotted: bool = False) -> None:
        self.send_response(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in HOP_HEADERS:
                self.send_header(name, value)
        self.end_headers()
        first = rotted and response.status < 300
        while chunk := response.read(CHUNK):
            if first:
                chunk, first = bytes([chunk[0] ^ 0xFF]) + chunk[1:], False
            self.wfile.write(chunk)

    def _send_as(self, response: http.client.HTTPResponse, payload: bytes) -> None:
        self.send_response(response.status, response.reason)
        for name, value in response.getheaders():
            if name.lower() not in HOP_HEADERS and name.lower() != "content-length":
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def _error(code: int, message: str, reason: str = "invalid") -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "errors": [{"reason": reason}]}}


def _object_of(path: str) -> tuple[str, str] | None:
    """(bucket, object) of a JSON API object path, or None (a listing, an ACL, a copy). The
    client sends an object's name with its slashes encoded: a bare slash after it starts a
    sub-resource."""
    if not path.startswith(API) or "/o/" not in path:
        return None
    bucket, _, name = path[len(API) :].partition("/o/")
    if not name or "/" in name:
        return None
    return unquote(bucket), unquote(name)


def _bucket_of(path: str) -> str:
    rest = path.split("/b/", 1)[1] if "/b/" in path else ""
    return unquote(rest.split("/", 1)[0])


def _upload_name(query: str, content_type: str, body: bytes) -> str | None:
    """The object an upload writes: its ``name`` parameter, else its metadata's ``name`` (a
    resumable upload's JSON, a multipart upload's first part)."""
    if names := parse_qs(query).get("name"):
        return names[0]
    try:
        if content_type.startswith("application/json"):
            return json.loads(body or b"{}").get("name")
        if content_type.startswith("multipart/related"):
            message = BytesParser(policy=HTTP).parsebytes(
                b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body
            )
            first = next(iter(message.iter_parts()), None)
            payload = first.get_payload(decode=True) if first is not None else None
            if isinstance(payload, bytes):
                return json.loads(payload or b"{}").get("name")
    except (ValueError, StopIteration):
        return None
    return None
