"""``shardvault-agent init``: the agent's environment file, written from the deployment.

The agent finds its tables by name (``SHARDVAULT_NODES_TABLE``, ``SHARDVAULT_INBOX_TABLE``,
``SHARDVAULT_CATALOG_TABLE``), and the stack gives them generated names: typed by hand they are
where a first agent goes wrong. ``init`` reads them from where the deployment says them:

- *a stack* (``--stack``, default ``ShardVault``): CloudFormation ``DescribeStacks`` of that
  stack, in the region of the host's AWS configuration (the agent role may describe its own
  stack); the region is written too, so the daemon needs no other setting.
- *a local stack* (``--stack-env``): the ``stack.env`` a local stack writes, of which the agent
  takes its tables and the control plane's endpoint (never the store's: agents hold no store
  credentials).

It writes ``KEY=value`` lines (a systemd ``EnvironmentFile``, see ``agents/systemd/``), mode
0640, and refuses to replace an existing file without ``--force``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import boto3

from shardvault.aws.stack_outputs import stack_variables
from shardvault.errors import InvalidRequest

DEFAULT_STACK = "ShardVault"
DEFAULT_ENV_FILE = Path("/etc/shardvault/agent.env")
# Stack output -> the variable the agent reads.
OUTPUTS = {
    "NodesTableName": "SHARDVAULT_NODES_TABLE",
    "InboxTableName": "SHARDVAULT_INBOX_TABLE",
    "CatalogTableName": "SHARDVAULT_CATALOG_TABLE",
    "ArchiveFunctionName": "SHARDVAULT_ARCHIVE_FUNCTION",
}
# What an agent takes of a local stack's stack.env: its tables and how to reach the control
# plane (moto's endpoint and its placeholder credentials), nothing of the store.
LOCAL_KEYS = (
    *OUTPUTS.values(),
    "AWS_ENDPOINT_URL",
    "AWS_DEFAULT_REGION",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
)


# The key an agent set up by hand from a local stack's stack.env uses (the stack.env's own
# AWS_ACCESS_KEY_ID is the operator's, for the CLI).
LOCAL_AGENT_KEY = "SHARDVAULT_LOCAL_AGENT_ACCESS_KEY_ID"


def from_stack(stack: str, cloudformation: Any = None) -> dict[str, str]:
    """The agent's variables from the outputs of a deployed stack."""
    client = cloudformation or boto3.client("cloudformation")
    values = stack_variables(stack, OUTPUTS, client)
    return {**values, "AWS_DEFAULT_REGION": client.meta.region_name}


def from_stack_env(path: Path) -> dict[str, str]:
    """The agent's variables from a local stack's ``stack.env``."""
    try:
        text = path.read_text()
    except OSError as error:
        raise InvalidRequest(
            f"{path} cannot be read: {error.strerror}.",
            fix="pass the stack.env of a running local stack (shardvault local up writes "
            "local-stack/stack.env).",
        ) from None
    found = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    if found.get(LOCAL_AGENT_KEY):  # the stack.env's own key is the CLI's, not an agent's
        found["AWS_ACCESS_KEY_ID"] = found[LOCAL_AGENT_KEY]
    values = {key: found[key] for key in LOCAL_KEYS if found.get(key)}
    missing = [v for v in OUTPUTS.values() if v not in values]
    if missing:
        raise InvalidRequest(
            f"{path} names no {', '.join(missing)}: it is not a local stack's stack.env.",
            fix="pass the stack.env that 'shardvault local up' wrote in its --dir.",
        )
    return values


def env_text(values: Mapping[str, str]) -> str:
    lines = [f"{key}={value}" for key, value in values.items()]
    return "# Written by shardvault-agent init: the agent's tables and region.\n" + (
        "\n".join(lines) + "\n"
    )


def write_env_file(path: Path, values: Mapping[str, str], *, force: bool = False) -> None:
    """Writes the file (0640: the tables' names are not secret, but no one else needs them)."""
    for value in values.values():
        if "\n" in value:  # a value from a stack output cannot break the file's format
            raise InvalidRequest(f"a value holds a line break: {value!r}.", fix="check the stack.")
    if path.exists() and not force:
        raise InvalidRequest(
            f"{path} exists.", fix="pass --force to replace it, or --out to write elsewhere."
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    with os.fdopen(descriptor, "w") as file:
        file.write(env_text(values))
    path.chmod(0o640)
