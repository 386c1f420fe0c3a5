"""After a per-node Distributed Map, the backup fails with the first failed node's own error
(its name for Retry and Catch, its cause for the record), not the Map's."""

from __future__ import annotations

import json

import pytest

from functions.check_nodes import lambda_handler
from shardvault.local.lambda_bridge import LambdaContext
from shardvault.workflow.fanout import NodeStepFailed, raise_first_failure


def test_nodes_that_all_answered_pass() -> None:
    assert raise_first_failure([{"node_id": "n1", "flushed": ["s1"]}, {"node_id": "n2"}]) == {
        "nodes": 2
    }


def test_the_first_failed_node_fails_the_step_under_its_own_error_name() -> None:
    results = [
        {"node_id": "n1", "flushed": ["s1"]},
        {"node_id": "n2", "error": {"Error": "EngineError", "Cause": "pg_backup_start failed"}},
        {"node_id": "n3", "error": {"Error": "AgentUnavailable", "Cause": "silent"}},
    ]
    with pytest.raises(NodeStepFailed, match="pg_backup_start failed") as failed:
        raise_first_failure(results)
    assert type(failed.value).__name__ == "EngineError"  # what Lambda reports as the error


def test_a_dispatchers_error_payload_is_unwrapped_not_nested() -> None:
    payload = json.dumps({"errorMessage": "the agent of node n2 is unavailable", "trace": []})
    results = [{"node_id": "n2", "error": {"Error": "AgentUnavailable", "Cause": payload}}]
    with pytest.raises(NodeStepFailed) as failed:
        raise_first_failure(results)
    assert str(failed.value) == "the agent of node n2 is unavailable"


def test_the_handler_raises_for_step_functions_under_a_name_a_task_may_report() -> None:
    """States.* names are the interpreter's own: a node's timeout is raised as NodeTimeout,
    with a cause that names the node when the timeout had none."""
    event = {"results": [{"node_id": "n1", "error": {"Error": "States.Timeout", "Cause": ""}}]}
    with pytest.raises(NodeStepFailed) as failed:
        lambda_handler(event, LambdaContext("check_nodes"))
    assert type(failed.value).__name__ == "NodeTimeout"
    assert "the command to node n1 timed out (States.Timeout)" in str(failed.value)


def test_the_plan_step_fails_with_a_nodes_own_error_before_it_reads_any_answer() -> None:
    """The per-node Checkpoint, Scan and Stop maps are followed by the plan step, with no
    check of their own: it raises the first failed node's error, as CheckNodes would, before
    it reads an answer (nothing else is touched: no services are given)."""
    from shardvault.backup import plan
    from shardvault.contracts.models import Phase

    from .support import backup_context

    context = backup_context(engine="postgres")
    results = [
        {"node_id": "n1", "answer_bytes": 10, "answer_crc64nvme": "AAAAAAAAAAA="},
        {"node_id": "n2", "error": {"Error": "SourceLogFull", "Cause": "pg_wal has 1% free"}},
    ]
    for phase in (Phase.DATA, Phase.TAIL):
        with pytest.raises(NodeStepFailed, match="pg_wal has 1% free") as failed:
            plan(context, results, phase, svc=None)  # type: ignore[arg-type]
        assert type(failed.value).__name__ == "SourceLogFull"
