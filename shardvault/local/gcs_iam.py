"""GCS IAM, as the local stack's GCS answers it: each request needs the permissions GCS's
documentation lists for its JSON API method, and the caller holds only the custom role the
guide publishes (``shardvault.gcp.storage.COPY_WRITER_PERMISSIONS``). A call ShardVault makes
that the role lacks (a delete, say, or replacing an object) fails a test here, not a first
night on GCS.

- *needed*: the permissions of one request. An upload needs ``storage.objects.create``, and
  ``storage.objects.setRetention`` when it carries a retention; one that may replace an object
  (no ``ifGenerationMatch=0``) needs ``storage.objects.delete`` too, as GCS asks of an
  overwrite. A method this module does not know needs ``unmodelled``, which nobody holds.
- *admin*: a request with the ``ADMIN_HEADER`` (the harness creating buckets, a test writing
  behind ShardVault's back) is not checked; production code never sends it.
"""

from __future__ import annotations

from urllib.parse import SplitResult, parse_qs

API = "/storage/v1/b"
UPLOAD = "/upload/storage/v1/b/"
DOWNLOAD = "/download/storage/v1/b/"
ADMIN_HEADER = "x-shardvault-local-admin"
UNMODELLED = "unmodelled"


def needed(method: str, parts: SplitResult, body: bytes) -> frozenset[str]:
    """What GCS asks of the caller for one JSON API request."""
    path = parts.path
    if path.startswith(UPLOAD):
        return frozenset(upload(method, parse_qs(parts.query), body))
    if path.startswith(DOWNLOAD):
        return frozenset({"storage.objects.get"})
    if not path.startswith(API):
        return frozenset({UNMODELLED})
    return frozenset(resource(method, path[len(API) :].strip("/").split("/"), body))


def upload(method: str, query: dict[str, list[str]], body: bytes) -> set[str]:
    if method == "PUT":  # a resumable upload's chunk: its session was authorized
        return set()
    wanted = {"storage.objects.create"}
    if b'"retention"' in body:
        wanted.add("storage.objects.setRetention")
    if query.get("ifGenerationMatch") != ["0"]:
        wanted.add("storage.objects.delete")  # it may replace an object
    return wanted


def resource(method: str, rest: list[str], body: bytes) -> set[str]:
    """A bucket's or an object's JSON resource: ``rest`` is the path after ``/b``."""
    retention = {"storage.objects.setRetention"} if b'"retention"' in body else set()
    known = {
        (1, "GET"): {"storage.buckets.get"},
        (2, "GET"): {"storage.objects.list"},
        (3, "GET"): {"storage.objects.get"},
        (3, "PATCH"): {"storage.objects.update", *retention},
        (3, "PUT"): {"storage.objects.update", *retention},
        (3, "DELETE"): {"storage.objects.delete"},
    }
    if rest == [""]:
        return {"storage.buckets.create" if method == "POST" else "storage.buckets.list"}
    if len(rest) > 1 and rest[1] != "o":
        return {UNMODELLED}
    return known.get((len(rest), method), {UNMODELLED})


def denial(missing: str, path: str) -> str:
    """GCS's message for a caller without ``missing``."""
    return (
        f"the caller does not have {missing} access to {path} (the local stack holds the "
        "custom role docs/guide/vault-copies.md publishes)."
    )
