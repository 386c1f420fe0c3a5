"""``shardvault schedule --policy FILE``: run the policy's schedules on the local stack."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from shardvault.client import operations as ops
from shardvault.client.output import console


def add_parser(sub: Any) -> tuple[argparse.ArgumentParser, ...]:
    """Its subcommands, each a parser (given the deployment options by ``cli``)."""
    schedule = sub.add_parser("schedule", help="run the policy's schedules (local stack)")
    schedule.add_argument("--policy", type=Path, required=True, help="the policy file")
    schedule.add_argument("--interval", type=float, default=20.0, help="seconds between ticks")
    schedule.set_defaults(run=run_schedule)
    return (schedule,)


def run_schedule(args: argparse.Namespace) -> int:
    import logging

    from shardvault.config.policy import load_policy
    from shardvault.local import scheduler

    policy = load_policy(args.policy)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    console.print(f"scheduling {', '.join(sorted(policy.clusters))}; Ctrl-C stops")
    scheduler.run(policy, ops.ClientConfig.from_env(), args.interval)
    return 0
