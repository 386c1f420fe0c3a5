"""What a copy target's failure leaves on record (``shardvault.lifecycle.copies``): no session
URI, and a transient error tried again before the target is settled FAILED."""

from __future__ import annotations

from types import SimpleNamespace

from google.api_core import exceptions as gcs_errors

from shardvault.lifecycle import copies


def test_an_errors_urls_lose_their_query_before_any_record_or_log():
    text = (
        "503 PUT https://storage.example/upload/storage/v1/b/v/o?uploadType=resumable&"
        "upload_id=ABCsecret: Service Unavailable"
    )
    scrubbed = copies.scrubbed(text)
    assert "ABCsecret" not in scrubbed
    assert "upload_id" not in scrubbed
    assert scrubbed.startswith("503 PUT https://storage.example/upload/storage/v1/b/v/o?...")


CONTEXT = SimpleNamespace(backup_id="b1", cluster="c")
TARGET = SimpleNamespace(name="offsite", kind="gcs", bucket="acme-b")


def test_a_transient_error_is_tried_again_then_settled_failed(monkeypatch):
    kept: dict = {}
    monkeypatch.setattr(copies, "load_progress", lambda svc, b, n: dict(kept))
    monkeypatch.setattr(copies, "save_progress", lambda svc, b, n, p: kept.update(p))
    monkeypatch.setattr(copies, "failed", lambda context, target, error, reason, svc: "FAILED")
    busy = gcs_errors.ServiceUnavailable("busy")

    tries = [
        copies.retried_or_failed(CONTEXT, TARGET, busy, "busy", None)  # type: ignore[arg-type]
        for _ in range(copies.COPY_ATTEMPTS)
    ]

    assert tries == [1] * (copies.COPY_ATTEMPTS - 1) + ["FAILED"]


def test_a_refusal_fails_the_target_at_once(monkeypatch):
    monkeypatch.setattr(copies, "failed", lambda context, target, error, reason, svc: "FAILED")
    missing = gcs_errors.NotFound("no such bucket")
    outcome = copies.retried_or_failed(CONTEXT, TARGET, missing, "gone", None)  # type: ignore[arg-type]
    assert outcome == "FAILED"


def test_only_a_busy_or_unreachable_provider_is_worth_another_call():
    from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

    def aws(code: str) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": code}}, "PutObject")

    for error in (
        EndpointConnectionError(endpoint_url="https://s3"),
        ReadTimeoutError(endpoint_url="https://s3"),
        aws("SlowDown"),
        aws("503"),
        gcs_errors.TooManyRequests("busy"),
    ):
        assert copies.transient(error), error
    for error in (aws("AccessDenied"), aws("AccessDeniedException"), gcs_errors.Forbidden("no")):
        assert not copies.transient(error), error


def test_progress_kept_by_an_earlier_release_keeps_its_generations():
    """A promotion resumed across an upgrade: its progress names GCS generations and no
    class; the copy's manifest must still name each object's generation."""
    earlier = {"generation": 1733, "crc32c": "x", "md5": "y", "retain_until": None}
    assert copies.version_of(earlier) == "1733"
    assert copies.version_of({"version": "v-2", "generation": 1}) == "v-2"
    assert copies.version_of({"crc32c": "x"}) is None
