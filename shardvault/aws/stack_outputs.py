"""A deployed stack's outputs as the variables its clients read (the CLI's ``--stack``, the
agent's ``init --stack``): one ``DescribeStacks``, every output a client needs or a refusal
that names the missing ones."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardvault.errors import InvalidRequest


def stack_variables(stack: str, wanted: Mapping[str, str], cloudformation: Any) -> dict[str, str]:
    """``wanted`` maps an output's name to the variable it becomes; returns the variables."""
    (described,) = cloudformation.describe_stacks(StackName=stack)["Stacks"]
    outputs = {o["OutputKey"]: o["OutputValue"] for o in described.get("Outputs", [])}
    missing = [name for name in wanted if name not in outputs]
    if missing:
        raise InvalidRequest(
            f"stack {stack!r} has no output {', '.join(missing)}: it is not a ShardVault stack, "
            "or one deployed before these outputs.",
            fix="pass --stack with the name of the ShardVault stack (cdk deploy prints it), or "
            "redeploy it.",
        )
    return {variable: outputs[name] for name, variable in wanted.items()}
