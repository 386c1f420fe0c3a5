"""Backups whose part uploads meet S3's answers that MinIO never gives (issue 43).

A fault proxy (``shardvault.local.s3_answers``) stands in front of the stack's MinIO; the
store's presigned URLs name it for these tests only, while the functions' own store calls
go direct. Each backup's first PUT of every part meets 307 TemporaryRedirect (S3's global
host for a new bucket), 400 ExpiredToken (the signing role's session ended) or 400
RequestTimeout, and must still complete and restore: the first two by new URLs (the Upload
map's Sign runs again for the object), the third by the agent's own next try of the same URL
(one Sign, one upload command per object: neither a new URL nor the Map's retry). Parts
that meet RequestTimeout, or a redirect, on every try must fail the backup by name
(``UploadIncomplete``, with the agent's cause) and leave no upload open.

Terms: a *resign answer* is one the agent mends by asking for a new URL
(``transfer.RESIGN_CODES``); *signed* counts the Sign step's runs per object key, *transfers*
the upload commands posted to the agents per object key.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

import pytest
from shardvault_agent.transfer import MAX_RESIGNS

from shardvault import backup
from shardvault.client import operations as ops
from shardvault.local.demo import table_digests
from shardvault.local.s3_answers import (
    EXPIRED_TOKEN,
    PASS_THROUGH,
    REQUEST_TIMEOUT,
    TEMPORARY_REDIRECT,
    Answer,
    FaultPlan,
    S3AnswersProxy,
)
from shardvault.local.stack import LocalStack

from .conftest import record_posts

# Two nodes of about 10 MB each: objects of more than one part (parts are 5 MiB at least).
SIZE_MB = 20
RESIGN_ANSWERS = (TEMPORARY_REDIRECT, EXPIRED_TOKEN)


@pytest.fixture(scope="module")
def proxy(stack: LocalStack) -> Iterator[S3AnswersProxy]:
    with S3AnswersProxy(stack.settings.store_endpoint) as running:
        yield running


@pytest.fixture
def through_proxy(stack: LocalStack, proxy: S3AnswersProxy) -> Iterator[S3AnswersProxy]:
    """The shared stack's presigned store URLs name the proxy for one test, then the store
    again (other tests of the session must never meet it)."""
    proxy.plan = PASS_THROUGH
    stack.presign_store_through(proxy.endpoint)
    try:
        yield proxy
    finally:
        stack.presign_store_through(None)
        proxy.plan = PASS_THROUGH


@pytest.fixture
def signed(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How many times the Upload map's Sign step (the ``sign_parts`` Lambda, run in this
    process by the local stack) signed each object's URLs: from outside the agent, it tells
    a new URL (the object signed again) from another try of the same one."""
    calls: Counter[str] = Counter()
    sign = backup.sign

    def counting(item: Any, *args: Any) -> dict:
        calls[item.key] += 1
        return sign(item, *args)

    monkeypatch.setattr(backup, "sign", counting)
    return calls


@pytest.fixture
def transfers(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How many upload commands were posted per object key: a Transfer the Map tried again
    (the agent gave up on a part) posts the object's command once more."""
    posts: Counter[str] = Counter()

    def count(command: str, args: dict[str, Any]) -> None:
        if command == "upload":
            posts[args["object"]["key"]] += 1

    record_posts(monkeypatch, count)
    return posts


def answered_multipart_keys(proxy: S3AnswersProxy, bucket: str) -> set[str]:
    """The object keys of the multipart parts (a ``partNumber``) the proxy answered."""
    return {unquote(path).removeprefix(f"/{bucket}/") for path, part in proxy.answered if part}


@pytest.mark.parametrize(
    "answer", [TEMPORARY_REDIRECT, EXPIRED_TOKEN, REQUEST_TIMEOUT], ids=lambda a: a.code
)
def test_a_backup_whose_parts_first_meet_an_s3_answer_completes_and_restores(
    make_cluster,
    make_target,
    through_proxy: S3AnswersProxy,
    signed: Counter[str],
    transfers: Counter[str],
    answer: Answer,
):
    cluster = make_cluster(nodes=2, size_mb=SIZE_MB)
    through_proxy.plan = FaultPlan(answer)

    progress = cluster.backup()

    assert progress.status == "SUCCEEDED", progress.cause
    assert through_proxy.served[answer.code] > 0
    keys = answered_multipart_keys(through_proxy, cluster.stack.services().store.bucket)
    assert keys, "no multipart part met the answer"
    assert keys <= set(signed), (keys, signed)  # the proxy saw the URLs the Map signed
    if answer in RESIGN_ANSWERS:  # mended by new URLs: each such object signed again
        assert all(signed[key] > 1 for key in keys), signed
    else:  # mended by the agent's next try of the same URL: one URL, one command per object
        assert max(signed.values()) == 1, signed
        assert all(transfers[key] == 1 for key in keys), transfers
    log = cluster.agent_log(cluster.configs[0]["node_id"])
    assert answer.code in log  # the agent met the proxy's answer, not MinIO's
    assert cluster.open_uploads() == []
    (record,) = cluster.records()
    assert record["status"] == "COMPLETE"

    target = make_target(nodes=2)
    restored = target.restore(cluster.name)  # its GETs go through the proxy, unanswered
    assert restored.status == "SUCCEEDED", restored.cause
    for shard_id, source in cluster.sources.items():
        (db,) = list(target.restore_dir(0).parent.glob(f"*/{shard_id}/*.db"))
        assert table_digests(db) == table_digests(source), shard_id


@pytest.mark.parametrize("answer", [REQUEST_TIMEOUT, TEMPORARY_REDIRECT], ids=lambda a: a.code)
def test_parts_that_meet_an_answer_on_every_try_fail_the_backup_and_leave_no_upload_open(
    make_cluster, through_proxy: S3AnswersProxy, signed: Counter[str], answer: Answer
):
    """RequestTimeout: the agent's tries of the one URL run out. A redirect: new URLs mend
    nothing (a bucket in another region than the one signed for), so after ``MAX_RESIGNS`` of
    them the part fails instead of going round Sign and Transfer until the execution times
    out."""
    cluster = make_cluster(nodes=2, size_mb=SIZE_MB, agent={"part_attempts": 2})
    through_proxy.plan = FaultPlan(answer, every=True)

    execution = cluster.start_backup()
    progress = ops.wait_backup(cluster.client, execution, interval=0.2, timeout=600)

    assert progress.status == "FAILED"
    assert through_proxy.served[answer.code] > 0
    # The first URL, then one per new URL the agent asked for: never more than MAX_RESIGNS.
    assert max(signed.values()) == (1 + MAX_RESIGNS if answer in RESIGN_ANSWERS else 1), signed
    (record,) = cluster.records()
    assert record["status"] == "FAILED"
    # ARCHITECTURE.md, failure table: "parts keep failing to upload | UploadIncomplete, with
    # the agent's cause".
    assert record["error"] == "UploadIncomplete", record
    assert answer.code in record["cause"], record["cause"]
    assert cluster.open_uploads() == []
    assert cluster.store_keys() == []
