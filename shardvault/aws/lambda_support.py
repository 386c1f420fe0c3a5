"""What every Lambda handler shares: Powertools utilities, settings parsed once per cold
start, and parsing of events into typed models with errors a person can act on."""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, TypeVar

from aws_lambda_powertools import Logger, Metrics, Tracer
from pydantic import BaseModel, ValidationError

from shardvault.aws.services import Services
from shardvault.config.settings import Settings
from shardvault.errors import InvalidRequest

logger = Logger(service="shardvault")
tracer = Tracer(service="shardvault")
metrics = Metrics(namespace="ShardVault", service="shardvault")

M = TypeVar("M", bound=BaseModel)


_services: Services | None = None
# The local stack runs every function in one process: which one is running (the module of its
# handler, set by its Lambda bridge), and how that function's clients are bound to its role.
FUNCTION: ContextVar[str | None] = ContextVar("shardvault_function", default=None)
_bind_for: Callable[[str], Callable[[Any], Any]] | None = None
_by_function: dict[str, Services] = {}


def services() -> Services:
    """The clients of this process, built from the environment at the first call; on the
    local stack, the running function's own, bound to its role."""
    global _services  # noqa: PLW0603 - one Services per process, like Lambda's cold start
    if _services is None:
        _services = Services(Settings.from_env())
    function = FUNCTION.get()
    if _bind_for is None or function is None:
        return _services
    known = _by_function.get(function)
    if known is None or known.settings is not _services.settings:  # new, or settings replaced
        _by_function[function] = Services(_services.settings, bind=_bind_for(function))
    return _by_function[function]


def use_settings(
    settings: Settings, bind_for: Callable[[str], Callable[[Any], Any]] | None = None
) -> None:
    """Hands the handlers their settings directly (the local stack): secrets such as the
    store's keys then never enter the process environment, which child processes inherit.
    ``bind_for(module)`` binds the clients of the function ``module`` to its role."""
    global _services, _bind_for
    _services, _bind_for = Services(settings), bind_for
    _by_function.clear()


def log_outcome(workflow: str, cluster: str, summary: dict[str, Any]) -> None:
    """The one log line per finished run (message ``outcome``) that the dashboard's table
    counts by cluster (infra/components/monitoring.py: OUTCOMES_QUERY)."""
    logger.info(
        "outcome",
        extra={
            "workflow": workflow,
            "cluster": cluster,
            "outcome": str(summary.get("status", "")).lower(),
            "error": summary.get("error"),
            "bytes": summary.get("bytes", 0),
            "stored_bytes": summary.get("stored_bytes"),
            "duration_seconds": summary.get("duration_seconds"),
        },
    )


def execution_input(event: dict, example: str, fix: str) -> dict:
    """The execution's input as the state machine's Accept wrapped it (``request``): any JSON
    value reaches the function, and one that is not an object is ``InvalidRequest``."""
    request = event.get("request")
    if not isinstance(request, dict):
        raise InvalidRequest(
            f"the execution input must be a JSON object such as {example}.", fix=fix
        )
    return request


def parse(model: type[M], data: object) -> M:
    """Parses input into ``model``; a malformed input becomes ``InvalidRequest``."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'input'}: {e['msg']}" for e in error.errors()
        )
        raise InvalidRequest(
            f"malformed {model.__name__}: {problems}.",
            fix="correct the listed fields of the input (each workflow's input: docs/guide).",
        ) from None
