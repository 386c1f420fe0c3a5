"""The plan step takes an agent's answer from the work bucket only when it is the one the
agent's receipt (its task output) vouches for."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from shardvault.aws.services import Services
from shardvault.backup.answers import MAX_ANSWER_BYTES, read_answers
from shardvault.contracts.models import Phase
from shardvault.data.checksums import crc64nvme_of_bytes
from shardvault.errors import AnswerMismatch

from .support import moto_services

ANSWER = {"node_id": "n1", "shards": [{"shard_id": "s1", "files": "", "marker": {}}]}


@pytest.fixture
def svc(monkeypatch: pytest.MonkeyPatch) -> Iterator[Services]:
    with moto_services(monkeypatch, work_bucket="work") as services:
        services.work_s3.create_bucket(Bucket=services.settings.work_bucket)
        yield services


def hand(svc: Services, answer: dict[str, Any], kept: bytes | None = None) -> dict[str, Any]:
    """Keeps ``kept`` (by default: the answer itself) where node n1's data answer goes, and
    returns the receipt of ``answer``."""
    body = json.dumps(answer).encode()
    key = svc.answer_key("b1", Phase.DATA, "n1")
    svc.work_s3.put_object(Bucket=svc.settings.work_bucket, Key=key, Body=kept or body)
    return {
        "node_id": "n1",
        "answer_bytes": len(body),
        "answer_crc64nvme": crc64nvme_of_bytes(body),
    }


def test_a_receipt_is_replaced_by_the_answer_it_vouches_for(svc: Services) -> None:
    receipt = hand(svc, ANSWER)
    assert svc.answer_key("b1", Phase.DATA, "n1") == "_work/b1/answers/data/n1.json"
    assert read_answers(svc, "b1", Phase.DATA, [receipt]) == [ANSWER]


def test_an_answer_sent_inline_is_refused_as_no_receipt(svc: Services) -> None:
    """Only an agent older than protocol 4 answered a listing inline: it is refused by name,
    never planned unchecked."""
    with pytest.raises(
        AnswerMismatch, match=r"node n1 .* cannot read as AnswerReceipt: answer_bytes"
    ):
        read_answers(svc, "b1", Phase.DATA, [ANSWER])


def test_an_answer_replaced_in_the_work_bucket_is_refused(svc: Services) -> None:
    other = json.dumps({**ANSWER, "shards": []}).encode()
    receipt = hand(svc, ANSWER, kept=other)
    with pytest.raises(AnswerMismatch, match="node n1 in the work bucket is not the one"):
        read_answers(svc, "b1", Phase.DATA, [receipt])


def test_an_answer_of_the_same_size_and_another_content_is_refused(svc: Services) -> None:
    body = json.dumps(ANSWER).encode()
    receipt = hand(svc, ANSWER, kept=body.replace(b"s1", b"s2"))
    with pytest.raises(AnswerMismatch, match="another checksum"):
        read_answers(svc, "b1", Phase.DATA, [receipt])


def test_an_answer_naming_another_node_is_refused(svc: Services) -> None:
    receipt = hand(svc, {**ANSWER, "node_id": "n2"})
    with pytest.raises(AnswerMismatch, match="kept for node n1 names node n2"):
        read_answers(svc, "b1", Phase.DATA, [receipt])


def test_a_missing_answer_is_refused_by_name(svc: Services) -> None:
    receipt = hand(svc, ANSWER)
    with pytest.raises(AnswerMismatch, match="its answer is not in the work bucket"):
        read_answers(svc, "b1", Phase.TAIL, [receipt])  # the tail's was never put


def test_an_answer_too_large_to_plan_is_refused_before_it_is_read(svc: Services) -> None:
    receipt = {"node_id": "n1", "answer_bytes": MAX_ANSWER_BYTES + 1, "answer_crc64nvme": "x"}
    with pytest.raises(AnswerMismatch, match="more than the plan step reads") as refused:
        read_answers(svc, "b1", Phase.DATA, [receipt])  # nothing is kept: nothing was read
    assert "split the node's shards" in refused.value.fix
