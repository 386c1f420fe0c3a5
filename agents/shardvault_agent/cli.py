"""``shardvault-agent``: run the agent, check its configuration, or write its environment.

``init`` writes the environment file (its tables and region) from the deployment
(``shardvault_agent.bootstrap``).

``check`` and ``run`` refuse the same things, before anything starts: an invalid file (every
problem by its field path, with its fix) and a host the configuration cannot run on
(``check_host``: directories the agent cannot write, shard data missing). Errors go to stderr
with exit status 2, without a traceback; so do AWS errors at start (no region, no credentials,
a table that does not exist, access denied), each as one line with its fix.

The tables come from ``--nodes-table``/``--inbox-table``/``--catalog-table`` or
``SHARDVAULT_NODES_TABLE``, ``SHARDVAULT_INBOX_TABLE`` and ``SHARDVAULT_CATALOG_TABLE`` (read
only at start, for ``reconcile``), set in the environment or in the file ``init`` wrote
(``--env-file``, default ``/etc/shardvault/agent.env``: the environment wins); AWS endpoints
and credentials from the usual AWS variables (``AWS_ENDPOINT_URL`` reaches the local stack).
No S3 credentials are needed or used.
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

from shardvault.errors import AWS_DENIED_CODES, ShardVaultError
from shardvault.versions import installed
from shardvault_agent import bootstrap
from shardvault_agent.bootstrap import DEFAULT_ENV_FILE, DEFAULT_STACK
from shardvault_agent.config import check_host, load_config


def load_env_file(argv: list[str] | None) -> str | None:
    """Sets, for ``run`` and ``check``, the variables of the file ``init`` wrote that the
    environment does not set already (a systemd ``EnvironmentFile`` sets them first). The
    default file may be absent; one named with ``--env-file`` must be readable. Returns the
    problem, or None."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("command", nargs="?")
    pre.add_argument("--env-file", type=Path)
    known, _ = pre.parse_known_args(argv)
    if known.command not in ("run", "check"):
        return None
    path = known.env_file or DEFAULT_ENV_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        if known.env_file is None:
            return None
        return f"{path} does not exist. Fix: write it with 'shardvault-agent init --out {path}'."
    except (OSError, UnicodeDecodeError) as error:
        why = getattr(error, "strerror", None) or "not a text file"
        return f"{path} cannot be read ({why}). Fix: rewrite it with 'shardvault-agent init'."
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key and not key.startswith("#"):
            os.environ.setdefault(key.strip(), value.strip())
    return None


def main(argv: list[str] | None = None) -> int:
    if problem := load_env_file(sys.argv[1:] if argv is None else argv):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="shardvault-agent", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {installed('shardvault-agent')}"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "check"):
        cmd = sub.add_parser(name)
        cmd.add_argument("--config", type=Path, required=True, help="agent YAML config")
        cmd.add_argument(
            "--env-file",
            type=Path,
            default=DEFAULT_ENV_FILE,
            help=f"the file 'init' wrote (default {DEFAULT_ENV_FILE}; the environment wins)",
        )
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
        cmd.add_argument(
            "--archive-function",
            default=os.environ.get("SHARDVAULT_ARCHIVE_FUNCTION"),
            help="the WAL archive's function, for shards with a wal_spool_dir (optional)",
        )
    init = sub.add_parser("init", help="write the agent's environment file from the stack")
    source = init.add_mutually_exclusive_group()
    source.add_argument(
        "--stack", default=DEFAULT_STACK, help=f"the ShardVault stack (default {DEFAULT_STACK})"
    )
    source.add_argument("--stack-env", type=Path, help="a local stack's stack.env instead")
    init.add_argument("--out", type=Path, default=DEFAULT_ENV_FILE, help="the file to write")
    init.add_argument("--force", action="store_true", help="replace an existing file")
    args = parser.parse_args(argv)
    if args.command == "init":
        return run_init(args)
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
        from shardvault_agent.malloc import limit_arenas

        limit_arenas()  # before the agent's threads allocate
        agent = Agent(
            config,
            nodes_table=args.nodes_table,
            inbox_table=args.inbox_table,
            catalog_table=args.catalog_table,
            archive_function=args.archive_function,
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


def run_init(args: argparse.Namespace) -> int:
    """Writes the environment file; errors as ``run``'s: one line on stderr, exit 2."""
    try:
        if args.stack_env:
            values = bootstrap.from_stack_env(args.stack_env)
        else:
            values = bootstrap.from_stack(args.stack)
        bootstrap.write_env_file(args.out, values, force=args.force)
    except ShardVaultError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (BotoCoreError, ClientError) as error:
        print(f"error: {stack_error(error, args.stack)}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.out}: "
        + ", ".join(f"{k}={v}" for k, v in values.items() if not k.startswith("AWS_SECRET"))
    )
    return 0


def stack_error(error: BotoCoreError | ClientError, stack: str) -> str:
    """One line naming why the stack's outputs could not be read, and the fix."""
    if isinstance(error, ClientError):
        code = error.response.get("Error", {}).get("Code", "")
        message = error.response.get("Error", {}).get("Message", "")
        if code == "ValidationError" and "does not exist" in message:
            return (
                f"no stack {stack!r} in this region. Fix: pass --stack with the ShardVault "
                "stack's name, and set AWS_DEFAULT_REGION to its region."
            )
        if code in DENIED:
            return (
                f"this AWS identity may not describe stack {stack!r} ({code}). Fix: run init "
                "with the stack's agent role (an instance profile), or with --stack-env."
            )
    return aws_start_error(error, None)


DENIED = AWS_DENIED_CODES


def aws_start_error(error: BotoCoreError | ClientError, args: argparse.Namespace | None) -> str:
    """One line naming why the agent could not reach its tables, and the fix."""
    tables = (
        f"nodes table {args.nodes_table!r}, inbox table {args.inbox_table!r}"
        if args
        else "its tables"
    )
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
            f"a table the agent uses does not exist in this region ({tables}). Fix: write "
            "them with 'shardvault-agent init' (from the stack's outputs) and load that file "
            "(the systemd unit's EnvironmentFile), or pass --nodes-table and --inbox-table."
        )
    if code in DENIED:
        return (
            f"the agent's AWS identity may not use its tables ({code}: {tables}). Fix: give "
            "the host the stack's agent role, or renew its credentials."
        )
    return f"AWS refused the agent's first requests ({code}): {error}."


if __name__ == "__main__":
    sys.exit(main())
