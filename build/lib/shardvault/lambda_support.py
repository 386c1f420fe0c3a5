"""What every Lambda handler shares: Powertools utilities, settings parsed once per cold
start, and parsing of events into typed models with errors a person can act on."""

from __future__ import annotations

from typing import TypeVar

from aws_lambda_powertools import Logger, Metrics, Tracer
from pydantic import BaseModel, ValidationError

from shardvault.errors import InvalidRequest
from shardvault.services import Services
from shardvault.settings import Settings

logger = Logger(service="shardvault")
tracer = Tracer(service="shardvault")
metrics = Metrics(namespace="ShardVault", service="shardvault")

M = TypeVar("M", bound=BaseModel)


_services: Services | None = None


def services() -> Services:
    """The clients of this process, built from the environment at the first call."""
    global _services  # noqa: PLW0603 - one Services per process, like Lambda's cold start
    if _services is None:
        _services = Services(Settings.from_env())
    return _services


def use_settings(settings: Settings) -> None:
    """Hands the handlers their settings directly (the local stack): secrets such as the
    store's keys then never enter the process environment, which child processes inherit."""
    global _services  # noqa: PLW0603
    _services = Services(settings)


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
            fix="correct the listed fields of the input (see the README for its format).",
        ) from None
