"""AWS's answers that MinIO never gives, and what the agent and the signer do with them:
the global host's redirect, an ended signing session, a slow body (aws-facts.md)."""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import pytest
from shardvault_agent.transfer import MAX_RESIGNS, PartSender

from shardvault.aws.store import s3_client
from shardvault.contracts.models import PartChecksum
from shardvault.errors import PartUploadFailed, PresignedUrlExpired

EXPIRED = (
    b"<Error><Code>ExpiredToken</Code><Message>The provided token has expired.</Message></Error>"
)
TIMEOUT = b"<Error><Code>RequestTimeout</Code><Message>Your socket connection...</Message></Error>"


@dataclass
class Answer:
    status: int
    data: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class ScriptedStore:
    """Answers each PUT with the next of ``answers``."""

    answers: list[Answer]
    puts: int = 0

    def request(self, method: str, url: str, **_: object) -> Answer:
        self.puts += 1
        return self.answers.pop(0)


def send(store: ScriptedStore) -> str:
    sender = PartSender(http=store, attempts=3, sleep=lambda _: None)
    part = PartChecksum(part_number=1, size=1, crc64nvme="AAAAAAAAAAA=")
    return sender.send("k", part, "https://url", lambda: io.BytesIO(b"x")).etag


@pytest.mark.parametrize(
    "answer",
    [
        Answer(400, EXPIRED),
        Answer(307, b"<Error><Code>TemporaryRedirect</Code></Error>", {"Location": "https://r"}),
        Answer(307, headers={"Location": "https://bucket.s3.eu-west-1.amazonaws.com/k"}),
    ],
    ids=["expired-token", "redirect", "redirect-without-body"],
)
def test_an_answer_a_new_url_mends_asks_to_sign_again_at_once(answer):
    store = ScriptedStore([answer])
    with pytest.raises(PresignedUrlExpired, match="sign again"):
        send(store)
    assert store.puts == 1  # not tried again with the same URL


def test_a_part_refused_again_after_every_new_url_fails_instead_of_signing_forever():
    """A bucket in another region than the one signed for answers 301 to every new URL:
    signing again mends nothing, so after MAX_RESIGNS new URLs the part fails by name (the
    Map's retries, then UploadIncomplete) instead of circling until the execution times out."""
    sender = PartSender(http=None, attempts=1, sleep=lambda _: None)
    part = PartChecksum(part_number=1, size=1, crc64nvme="AAAAAAAAAAA=")
    moved = Answer(301, b"<Error><Code>PermanentRedirect</Code></Error>")
    for _ in range(MAX_RESIGNS):
        sender.http = ScriptedStore([moved])
        with pytest.raises(PresignedUrlExpired):
            sender.send("k", part, "https://url", lambda: io.BytesIO(b"x"))
    sender.http = ScriptedStore([moved])
    with pytest.raises(PartUploadFailed, match="PermanentRedirect"):
        sender.send("k", part, "https://url", lambda: io.BytesIO(b"x"))
    other = PartChecksum(part_number=2, size=1, crc64nvme="AAAAAAAAAAA=")
    sender.http = ScriptedStore([moved])
    with pytest.raises(PresignedUrlExpired):  # another part's count is its own
        sender.send("k", other, "https://url", lambda: io.BytesIO(b"x"))


def test_a_request_timeout_is_tried_again():
    store = ScriptedStore([Answer(400, TIMEOUT), Answer(200, headers={"ETag": '"e"'})])
    assert send(store) == '"e"'
    assert store.puts == 2


def test_another_refusal_fails_the_part_by_name():
    store = ScriptedStore([Answer(400, b"<Error><Code>InvalidArgument</Code></Error>")])
    with pytest.raises(PartUploadFailed, match="InvalidArgument"):
        send(store)


@pytest.mark.parametrize("region", ["us-east-1", "eu-west-1", "ap-southeast-5"])
def test_urls_name_the_buckets_regional_host(monkeypatch, region):
    monkeypatch.setenv("AWS_DEFAULT_REGION", region)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    url = s3_client().generate_presigned_url(
        "put_object", Params={"Bucket": "my-bucket", "Key": "k"}
    )
    assert url.startswith(f"https://my-bucket.s3.{region}.amazonaws.com/k?")
