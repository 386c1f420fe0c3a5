"""The local stack's memoized moto hot spots answer as moto does, and follow a new stack."""

from __future__ import annotations

import os
from types import SimpleNamespace

import boto3
from moto import backends
from moto.moto_server.werkzeug_app import DomainDispatcherApplication
from moto.server import create_backend_app
from moto.stepfunctions.parser.asl.component.state.exec.state_task import lambda_eval_utils
from moto.stepfunctions.parser.asl.utils import json_path

from shardvault.local import moto_speedups


def test_memoized_answers_are_motos_and_a_new_session_gets_new_clients(monkeypatch) -> None:
    moto_speedups.install()
    moto_speedups.install()  # a second stack in the process: nothing wrapped twice
    path = os.path.dirname(backends.__file__)
    listed = sorted(
        name for name in os.listdir(path)
        if os.path.isdir(os.path.join(path, name)) and not name.startswith("__")
    )  # fmt: skip
    assert list(backends.list_of_moto_modules()) == listed

    dispatcher = DomainDispatcherApplication(create_backend_app)
    assert dispatcher.get_backend_for_host("dynamodb.us-east-1.amazonaws.com") == "dynamodb"
    assert dispatcher.get_backend_for_host("sqs.us-east-1.amazonaws.com") == "sqs"

    # A running stack's session (its Lambda bridge) is put back after the test.
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", boto3.DEFAULT_SESSION)
    monkeypatch.setenv("MOTO_PORT", "5999")
    boto3.setup_default_session()
    first = lambda_eval_utils.boto_client_for("us-east-1", "lambda")
    assert lambda_eval_utils.boto_client_for("us-east-1", "lambda") is first
    assert first.meta.endpoint_url == "http://localhost:5999"
    boto3.setup_default_session()  # what LambdaBridge.install does for a new stack
    assert lambda_eval_utils.boto_client_for("us-east-1", "lambda") is not first
    monkeypatch.setenv("MOTO_PORT", "6001")
    assert lambda_eval_utils.boto_client_for("us-east-1", "lambda").meta.endpoint_url == (
        "http://localhost:6001"
    )

    assert json_path.extract_json("$.a.b", {"a": {"b": 7}}) == 7
    assert json_path.extract_json("$.a.b", {"a": {"b": 8}}) == 8  # the parsed path, reused


def test_a_distributed_map_starts_no_more_workers_than_it_has_items(monkeypatch) -> None:
    """MaxConcurrency 1,000 (the per-node Maps) over 3 nodes: 3 workers, not 1,000 threads."""
    from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration import (
        distributed_iteration_component as distributed,
    )

    moto_speedups.install()
    component = distributed.DistributedIterationComponent
    launched: list[int] = []
    monkeypatch.setattr(distributed, "JobPool", FakeJobPool)
    none = SimpleNamespace(get=lambda: 0)  # moto_fidelity reads the failed items' counters
    counters = SimpleNamespace(failed=none, timed_out=none, total=none)
    record = SimpleNamespace(max_concurrency=1000, item_counter=counters)
    env = SimpleNamespace(stack=[["n1", "n2", "n3"]], is_running=lambda: True)
    this = SimpleNamespace(
        _get_iteration_program=lambda: None, _launch_worker=lambda **_: launched.append(1)
    )
    run = SimpleNamespace(
        map_run_record=record, tolerated_failure_count=0, tolerated_failure_percentage=0.0
    )
    component._map_run(this, env, run)
    assert len(launched) == 3
    assert record.max_concurrency == 3
    assert env.stack == [[]]  # the (fake) pool's outputs, as moto leaves them


class FakeJobPool:
    def __init__(self, job_program: object, job_inputs: list) -> None:
        self.inputs = job_inputs

    def await_jobs(self) -> None:
        pass

    def get_worker_exception(self) -> None:
        return None

    def get_closed_jobs(self) -> list:
        return []


def test_a_definition_is_parsed_once_and_each_execution_gets_its_own_program() -> None:
    from moto.stepfunctions.parser.asl.parse.asl_parser import (
        AmazonStateLanguageParser,
        ASLParserException,
    )

    moto_speedups.install()
    definition = '{"StartAt": "A", "States": {"A": {"Type": "Pass", "End": true}}}'
    first_program, first_tree = AmazonStateLanguageParser.parse(definition)
    second_program, second_tree = AmazonStateLanguageParser.parse(definition)
    assert second_tree is first_tree  # lexed and parsed once
    assert second_program is not first_program  # states keep per-run records: never shared
    assert second_program.states.states["A"] is not first_program.states.states["A"]
    assert list(second_program.states.states) == ["A"]

    broken = '{"StartAt": "A", "States": {"A": {"Type": "Nonsense"}}}'
    for _ in range(2):  # an error is not remembered as a tree
        try:
            AmazonStateLanguageParser.parse(broken)
        except ASLParserException:
            continue
        raise AssertionError("a definition with an unknown state type parsed")


def test_a_program_that_does_not_pickle_is_preprocessed_for_each_execution(monkeypatch) -> None:
    import pickle

    from moto.stepfunctions.parser.asl.parse.asl_parser import AmazonStateLanguageParser

    moto_speedups.install()

    def refuse(*_args, **_kwargs):
        raise pickle.PicklingError("not this one")

    monkeypatch.setattr(pickle, "dumps", refuse)
    definition = '{"StartAt": "B", "States": {"B": {"Type": "Pass", "End": true}}}'
    first_program, first_tree = AmazonStateLanguageParser.parse(definition)
    second_program, second_tree = AmazonStateLanguageParser.parse(definition)
    assert second_tree is first_tree
    assert second_program is not first_program
    assert second_program.states.states["B"] is not first_program.states.states["B"]
