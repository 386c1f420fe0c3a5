"""``shardvault-agent``: run the agent daemon, or check its configuration.

``check`` and ``run`` refuse the same things, before anything starts: an invalid file (every
problem by its field path, with its fix) and a host the configuration cannot run on
(``check_host``: directories the agent cannot write, shard data missing). Errors go to stderr
with exit status 2, without a traceback; so do AWS errors at start (no region, no credentials,
a table that does not exist, access denied), each as one line with its fix.

The tables come from ``--nodes-table``/``--inbox-table``/``--catalog-table`` or
``SHARDVAULT_NODES_TABLE``, ``SHARDVAULT_INBOX_TABLE`` and ``SHARDVAULT_CATALOG_TABLE`` (read
only at start, for ``reconcile``); AWS endpoints and credentials from the usual AWS variables
(``AWS_ENDPOINT_URL`` reaches the local stack). No S3 credentials are needed or used.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    NoRegionError,
)

from shardvault.errors import ShardVaultError
from shardvault.versions import installed
from shardvault_agent.config import check_host, load_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardvault-agent", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {installed('shardvault-agent')}"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "check"):
        cmd = sub.add_parser(name)
        cmd.add_argument("--config", type=Path, required=True, help="agent YAML config")
        cmd.add_argument(
            "--nodes-table", default=os.environ.get("SHARDVAULT_NODES_TABLE", "shardvault-nodes")
        )
        cmd.add_argument(
            "--inbox-table", default=os.environ.get("SHARDVAULT_INBOX_TABLE", "shardvault-inbox")
        )
        cmd.add_argument(
            "--catalog-table",
            default=os.environ.get("SHARDVAULT_CATALOG_TABLE"),
            help="the catalog, read at start to release what ended backups left (optional)",
        )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("botocore").setLevel(logging.WARNING)  # "Found credentials in ..."
    try:
        config = load_config(args.config)
        check_host(config)
        if args.command == "check":
            shards = len(config.shards)
            print(
                f"config ok: node {config.node_id} of cluster {config.cluster}, {shards} shard(s)"
            )
            return 0
        from shardvault_agent.daemon import Agent

        agent = Agent(
            config,
            nodes_table=args.nodes_table,
            inbox_table=args.inbox_table,
            catalog_table=args.catalog_table,
        )
        agent.install_signal_handlers()
        agent.run()
        return 0
    except ShardVaultError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (BotoCoreError, ClientError) as error:  # at start: later ones are logged and retried
        print(f"error: {aws_start_error(error, args)}", file=sys.stderr)
        return 2


# What AWS answers an identity that may not do something, or whose credentials are not valid.
DENIED = {
    "AccessDenied",
    "AccessDeniedException",
    "UnrecognizedClientException",
    "InvalidClientTokenId",
    "ExpiredTokenException",
}


def aws_start_error(error: BotoCoreError | ClientError, args: argparse.Namespace) -> str:
    """One line naming why the agent could not reach its tables, and the fix."""
    tables = f"nodes table {args.nodes_table!r}, inbox table {args.inbox_table!r}"
    if isinstance(error, NoRegionError):
        return (
            "no AWS region is set. Fix: set AWS_DEFAULT_REGION (or the AWS profile's region) "
            "to the region of the ShardVault stack."
        )
    if isinstance(error, NoCredentialsError):
        return (
            "no AWS credentials were found. Fix: give the host the stack's agent role (an "
            "instance profile), or set AWS_PROFILE to a profile that has it."
        )
    if isinstance(error, EndpointConnectionError):
        return f"AWS cannot be reached ({error}). Fix: check the host's network and its region."
    if not isinstance(error, ClientError):
        return f"AWS refused the agent's first requests: {error}."
    code = error.response.get("Error", {}).get("Code", "")
    if code == "ResourceNotFoundException":
        return (
            f"a table the agent uses does not exist in this region ({tables}). Fix: pass "
            "--nodes-table and --inbox-table (or SHARDVAULT_NODES_TABLE and "
            "SHARDVAULT_INBOX_TABLE) with the stack's outputs NodesTableName and "
            "InboxTableName."
        )
    if code in DENIED:
        return (
            f"the agent's AWS identity may not use its tables ({code}: {tables}). Fix: give "
            "the host the stack's agent role, or renew its credentials."
        )
    return f"AWS refused the agent's first requests ({code}): {error}."


if __name__ == "__main__":
    sys.exit(main())
