"""A restore request's flags are JSON booleans: ``"replace": "yes"`` (or ``"no"``, ``1``)
from a console or a script is refused by validation, naming the field, before anything is
read or changed. Pydantic's lax mode would have read those as true or false."""

from __future__ import annotations

from typing import Any

import pytest

import functions.validate_restore
from shardvault.local.lambda_bridge import LambdaBridge

VALIDATE = "shardvault-validate_restore"
REQUEST = {"cluster": "orders", "target_cluster": "orders-copy"}


@pytest.fixture
def validate(monkeypatch: pytest.MonkeyPatch) -> LambdaBridge:
    """The validation Lambda as Step Functions calls it; it must refuse before it reaches any
    service (catalog, registry, store)."""
    monkeypatch.setenv("POWERTOOLS_TRACE_DISABLED", "true")

    def no_services() -> Any:
        raise AssertionError("validation reached the services with a malformed request")

    monkeypatch.setattr(functions.validate_restore, "services", no_services)
    return LambdaBridge({VALIDATE: "functions.validate_restore"})


@pytest.mark.parametrize("field", ["replace", "plan_only"])
@pytest.mark.parametrize("value", ["yes", "no", "true", 1, 0])
def test_a_flag_that_is_not_a_boolean_is_an_invalid_request_naming_it(
    validate: LambdaBridge, field: str, value: object
) -> None:
    result, error = validate.invoke(VALIDATE, {"request": {**REQUEST, field: value}})
    assert error == "Unhandled"
    assert result["errorType"] == "InvalidRequest"
    assert f"{field}: Input should be a valid boolean" in result["errorMessage"]
    assert "Fix:" in result["errorMessage"]


@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_flag_passes_validation_of_its_type(validate: LambdaBridge, value: bool) -> None:
    # The request is well formed, so validation goes on to the services (refused here).
    result, _ = validate.invoke(VALIDATE, {"request": {**REQUEST, "replace": value}})
    assert result["errorType"] == "AssertionError"
