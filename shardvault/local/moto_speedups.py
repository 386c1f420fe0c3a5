"""Work moto's server repeats on every request, done once: the local stack's control plane, faster.

A py-spy profile of the local stack's process over incremental backups (``bench/``) found a
fifth of its CPU in answers that never change while it runs:

- ``moto.backends.list_of_moto_modules``: lists moto's package directory, one ``stat`` per
  service (about 200), on every HTTP request, to see whether the host names a service;
- ``DomainDispatcherApplication.get_backend_for_host``: matches the request's host against
  every service's URL patterns, again per request;
- ``boto_client_for`` in moto's Step Functions interpreter: a new boto3 client for every Task
  state that calls Lambda (creating a client copies its configuration and loads the model);
- jsonpath_ng's ``parse``, as the interpreter calls it: a new parser, with its grammar tables,
  for every path it evaluates (``InputPath``, ``ResultPath``, each ``.$`` parameter);
- ``AmazonStateLanguageParser.parse``: ANTLR's pure-Python lexer and parser over the whole
  definition (39 kB for the backup) at the start of every execution, 0.1 to 0.2 s of CPU on
  the path from ``StartExecution`` to the first state, then moto's preprocessor, which
  builds the execution's program from the parse tree (21 ms for the backup's definition).

And one that grows with the ASL rather than the requests: moto starts a Distributed Map's
``MaxConcurrency`` worker threads whatever its item count, so a 3-node backup's per-node step
(``MaxConcurrency`` 1,000: ``shardvault.workflow.fanout``) started 1,000 threads, five times a
backup. :func:`install` starts no more workers than there are items, as AWS runs no more children.

On the local stack that CPU is taken from the agents, which share the machine (two cores in
the benchmarks); on AWS none of it exists. :func:`install` memoizes them. The results are
the same objects moto would compute again: the module list and URL patterns are fixed once
moto is imported; each execution still gets a program of its own (its states keep per-run
records, so no two executions share one), unpickled from the one its definition's first
parse made before anything ran it (1.5 ms; a program that does not pickle is preprocessed
from the cached parse tree, as moto would); boto3 clients are safe to share between
threads, and one is kept per boto3 default session, so a stack started again in the same
process (the tests) gets clients with its own Lambda bridge (``LambdaBridge.install`` makes
a new default session); parsed JSONPath expressions are not changed by evaluating them.
"""

from __future__ import annotations

import functools
import pickle
import threading
from typing import Any

import boto3


@functools.cache  # once per process: a second call would wrap the wrappers
def install() -> None:
    """Memoizes the hot spots above, and caps a Distributed Map's workers at its items."""
    _cache_module_list()
    _cache_backend_for_host()
    _cache_step_functions_clients()
    _cache_json_paths()
    _cache_parse_trees()
    _cap_map_workers()


def _cache_module_list() -> None:
    from moto import backends

    modules = tuple(backends.list_of_moto_modules())
    backends.list_of_moto_modules = lambda: modules  # type: ignore[assignment]


def _cache_backend_for_host() -> None:
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication

    uncached = DomainDispatcherApplication.get_backend_for_host
    found: dict[str | None, Any] = {}  # hosts are service endpoints: a few dozen at most

    def get_backend_for_host(self: DomainDispatcherApplication, host: str | None) -> Any:
        if host not in found:
            found[host] = uncached(self, host)
        return found[host]

    DomainDispatcherApplication.get_backend_for_host = get_backend_for_host  # type: ignore[method-assign]


def _cache_step_functions_clients() -> None:
    from moto.core.models import botocore_stubber
    from moto.settings import moto_server_port
    from moto.stepfunctions.parser.asl.component.state.exec.state_task import lambda_eval_utils
    from moto.stepfunctions.parser.asl.utils import boto_client

    uncached = boto_client.boto_client_for
    clients: dict[tuple[str, str, str | None], Any] = {}
    made_for: list[Any] = [None]  # the (session, port, stubbed) the clients were made for
    lock = threading.Lock()

    def boto_client_for(region: str, service: str, state_credentials: Any = None) -> Any:
        # moto signs with fixed test credentials: a client depends on these alone (stubbed:
        # moto answers in-process, with no endpoint; else the server's port), and on the
        # role the state runs as, should moto ever use it (5.2.5 does not).
        now = (boto3.DEFAULT_SESSION, moto_server_port(), botocore_stubber.enabled)
        key = (region, service, getattr(state_credentials, "role_arn", None))
        with lock:
            if made_for[0] != now:
                clients.clear()
                made_for[0] = now
            if key not in clients:
                clients[key] = uncached(region, service, state_credentials)
            return clients[key]

    boto_client.boto_client_for = boto_client_for
    lambda_eval_utils.boto_client_for = boto_client_for  # imported by name there


def _cache_json_paths() -> None:
    from moto.stepfunctions.parser.asl.component.common.path import result_path
    from moto.stepfunctions.parser.asl.utils import json_path

    json_path.parse = functools.lru_cache(maxsize=1024)(json_path.parse)
    result_path.parse = functools.lru_cache(maxsize=1024)(result_path.parse)


def _cache_parse_trees() -> None:
    from moto.stepfunctions.parser.asl.parse import asl_parser

    uncached = asl_parser.AmazonStateLanguageParser.parse

    @functools.lru_cache(maxsize=64)  # a stack has five definitions; tests start many stacks
    def parsed(definition: str) -> tuple[Any, bytes | None]:
        program, tree = uncached(definition)  # a syntax error raises, and is not cached
        try:  # pickled before any execution ran it: a fresh program
            return tree, pickle.dumps(program)
        except (pickle.PicklingError, TypeError, AttributeError):
            return tree, None

    def parse(definition: str) -> tuple[Any, Any]:
        tree, program = parsed(definition)
        if program is None:
            return asl_parser.Preprocessor().visit(tree), tree
        return pickle.loads(program), tree  # pickled above, in this process

    asl_parser.AmazonStateLanguageParser.parse = staticmethod(parse)  # type: ignore[method-assign]


def _cap_map_workers() -> None:
    from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration import (
        distributed_iteration_component as distributed,
    )

    component = distributed.DistributedIterationComponent
    uncapped = component._map_run

    def _map_run(self: Any, env: Any, eval_input: Any) -> None:
        items = env.stack[-1]  # what _map_run pops: the Map's items
        record = eval_input.map_run_record
        if isinstance(items, list) and record.max_concurrency > len(items):
            record.max_concurrency = max(1, len(items))
        uncapped(self, env, eval_input)

    component._map_run = _map_run  # type: ignore[method-assign]
