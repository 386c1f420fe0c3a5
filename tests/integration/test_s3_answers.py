"""Backups whose part uploads meet S3's answers that MinIO never gives (issue 43).

A fault proxy (``shardvault.local.s3_answers``) stands in front of the stack's MinIO; the
store's presigned URLs name it for these tests only, while the functions' own store calls
go direct. Each backup's first PUT of every part meets 307 TemporaryRedirect (S3's global
host for a new bucket), 400 ExpiredToken (the signing role's session ended) or 400
RequestTimeout, and must still complete and restore; one meeting RequestTimeout on every try
must fail by name and leave no upload open.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shardvault import operations as ops
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

# Two nodes of about 10 MB each: objects of more than one part (parts are 5 MiB at least).
SIZE_MB = 20


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


@pytest.mark.parametrize(
    "answer", [TEMPORARY_REDIRECT, EXPIRED_TOKEN, REQUEST_TIMEOUT], ids=lambda a: a.code
)
def test_a_backup_whose_parts_first_meet_an_s3_answer_completes_and_restores(
    make_cluster, make_target, through_proxy: S3AnswersProxy, answer: Answer
):
    cluster = make_cluster(nodes=2, size_mb=SIZE_MB)
    through_proxy.plan = FaultPlan(answer)

    progress = cluster.backup()

    assert progress.status == "SUCCEEDED", progress.cause
    assert through_proxy.served[answer.code] > 0
    assert any(part for _, part in through_proxy.answered), "no multipart part met the answer"
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


def test_parts_that_time_out_on_every_try_fail_the_backup_and_leave_no_upload_open(
    make_cluster, through_proxy: S3AnswersProxy
):
    cluster = make_cluster(nodes=2, size_mb=SIZE_MB, agent={"part_attempts": 2})
    through_proxy.plan = FaultPlan(REQUEST_TIMEOUT, every=True)

    execution = cluster.start_backup()
    progress = ops.wait_backup(cluster.client, execution, interval=0.2, timeout=600)

    assert progress.status == "FAILED"
    assert through_proxy.served[REQUEST_TIMEOUT.code] > 0
    (record,) = cluster.records()
    assert record["status"] == "FAILED"
    assert record["error"] in ("UploadIncomplete", "PartUploadFailed"), record
    assert cluster.open_uploads() == []
    assert cluster.store_keys() == []
