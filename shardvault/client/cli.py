"""``shardvault``: run backups and inspect them, against AWS or the local stack.

  shardvault demo [--engine sqlite|postgres]   set up the local stack, back up a 3-node cluster
  shardvault local up                          run the local stack until Ctrl-C or local down
  shardvault local down                        stop the stack 'local up' runs in --dir
  shardvault backup CLUSTER [--wait]           start a backup (and follow it)
  shardvault list [CLUSTER] [--json]           backups in the catalog
  shardvault show CLUSTER BACKUP_ID [--json]   one backup, in full
  shardvault restore CLUSTER --into TARGET     restore a backup into another cluster
  shardvault retention [CLUSTER] [--dry-run]   expire backups by the policy's keep counts
  shardvault cut CLUSTER [--wait]              a cluster-wide cut now (a restore point per node)
  shardvault cuts CLUSTER [--json]             the cluster's cuts (restore --target-cut)
  shardvault check CLUSTER [--policy FILE]     will the next backup run? (exit 1: no)
      [--no-probe] [--json]                      (and each agent's round trip to the store)
  shardvault verify CLUSTER [BACKUP_ID]        check a backup and its chain in the store
      [--read-data PERCENT] [--json]             (exit 1 when damaged)
  shardvault schedule --policy FILE            start scheduled backups (the local stack)
  shardvault cost [--policy FILE] [--target]   monthly cost forecasts against budgets
      [--cluster NAME] [--data-gib N] [--daily-change F]   (exit 1 when a cluster is over)
  shardvault copy-setup CLUSTER NAME           what account B applies for an aws vault copy
      --policy FILE --stack-roles ARNS           (its bucket policy, its role's trust, grants)

Which deployment is used comes from ``--stack NAME`` (a deployed stack's outputs, read with
CloudFormation ``DescribeStacks``), ``--stack-env`` (a local stack's ``stack.env``), or
SHARDVAULT_STATE_MACHINE_ARN and SHARDVAULT_CATALOG_TABLE set by hand.

Exit status: 0 done; 1 failed (a backup or restore followed with --wait that failed, a backup
that verify found damaged, a check that failed, a cost over its budget); 2 a usage error (the
arguments do not parse); 3 refused (a named error, on stderr with its fix, before anything
started).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    NoRegionError,
)
from rich.markup import escape

from shardvault.client import operations as ops
from shardvault.client.commands import (
    backup,
    catalog,
    check,
    copy_setup,
    cost,
    cuts,
    drills,
    local,
    restore,
    retention,
    schedule,
    verify,
)
from shardvault.client.output import REFUSED, errors
from shardvault.errors import AWS_DENIED_CODES, ShardVaultError
from shardvault.versions import installed

__all__ = ["REFUSED", "main", "parser"]


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if getattr(args, "stack_env", None):
            ops.load_env_file(args.stack_env)
        if getattr(args, "stack", None):
            ops.load_stack_outputs(args.stack)
        return args.run(args) or 0
    except ShardVaultError as error:
        errors.print(f"[bold red]{error.name}[/]: {escape(error.message)}")
        if error.fix:
            errors.print(f"[yellow]Fix[/]: {escape(error.fix)}")
        return REFUSED
    except (BotoCoreError, ClientError) as error:  # AWS configuration: one line, no traceback
        errors.print(f"[bold red]AWS[/]: {escape(aws_problem(error))}")
        return REFUSED
    except KeyboardInterrupt:
        return 130


def aws_problem(error: BotoCoreError | ClientError) -> str:
    """What AWS refused the CLI, and the fix, in one line."""
    if isinstance(error, NoRegionError):
        return (
            "no AWS region is set. Fix: set AWS_DEFAULT_REGION (or the profile's region) to "
            "the ShardVault stack's region."
        )
    if isinstance(error, NoCredentialsError):
        return "no AWS credentials were found. Fix: set AWS_PROFILE, or log in (aws sso login)."
    if isinstance(error, EndpointConnectionError):
        return f"AWS cannot be reached ({error}). Fix: check the network and the region."
    if isinstance(error, ClientError):
        code = error.response.get("Error", {}).get("Code", "")
        if code in AWS_DENIED_CODES:
            return (
                f"this AWS identity may not do that ({code}: {error}). Fix: use an identity "
                "allowed to start the stack's executions and read its tables."
            )
        if code in ("ResourceNotFoundException", "StateMachineDoesNotExist"):
            return (
                f"{error}. Fix: set SHARDVAULT_* from the stack's outputs (the table and state "
                "machine names are generated), and AWS_DEFAULT_REGION to its region."
            )
    return f"{error}."


def parser() -> argparse.ArgumentParser:
    """The whole grammar: each command module adds its own subcommands
    (``shardvault.client.commands``); the options they share are added here."""
    root = argparse.ArgumentParser(prog="shardvault", description=__doc__.splitlines()[0])
    root.add_argument("--version", action="version", version=f"%(prog)s {installed('shardvault')}")
    sub = root.add_subparsers(dest="command", required=True)
    local.add_parser(sub)  # demo, local: they make the deployment they use
    (backup_,) = backup.add_parser(sub)
    readers = [*catalog.add_parser(sub), *check.add_parser(sub), *verify.add_parser(sub)]
    for reader in readers:  # list, show, nodes, check, verify
        reader.add_argument(
            "--json", action="store_true", help="print JSON for scripts (docs/reference/cli.md)"
        )
    on_a_deployment = [
        backup_,
        *readers,
        *restore.add_parser(sub),
        *retention.add_parser(sub),
        *schedule.add_parser(sub),
    ]
    cost.add_parser(sub)  # its deployment is optional: the catalog's measurements
    copy_setup.add_parser(sub)  # account B's side: the policy file alone
    on_a_deployment += drills.add_parsers(sub)
    on_a_deployment += cuts.add_parsers(sub)
    for command in on_a_deployment:
        where = command.add_mutually_exclusive_group()
        where.add_argument("--stack-env", type=Path, help="a local stack's stack.env")
        where.add_argument(
            "--stack", metavar="NAME", help="a deployed stack (e.g. ShardVault): its outputs"
        )
    return root


if __name__ == "__main__":
    raise SystemExit(main())
