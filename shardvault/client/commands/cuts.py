"""The CLI's scheduled cuts: ``shardvault cut CLUSTER`` takes one now, ``shardvault cuts
CLUSTER`` lists them (``shardvault.backup.cuts`` says what a cut is); ``shardvault restore
--target-cut`` restores to one."""

from __future__ import annotations

import argparse
import time
from typing import Any

from rich.markup import escape
from rich.table import Table

from shardvault.client import operations as ops
from shardvault.client.output import console, emit_json, errors
from shardvault.contracts.catalog import CutItem


def add_parsers(sub: Any) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    cut = sub.add_parser(
        "cut", help="take a cluster-wide cut now: one restore point on every node, no backup"
    )
    cut.add_argument("cluster")
    cut.add_argument("--wait", action="store_true", help="wait for it and show the cut")
    cut.set_defaults(run=run_cut)

    cuts = sub.add_parser("cuts", help="a cluster's scheduled cuts: restore points to restore to")
    cuts.add_argument("cluster")
    cuts.add_argument("--json", action="store_true", help="print JSON for scripts")
    cuts.set_defaults(run=run_cuts)
    return cut, cuts


def run_cut(args: argparse.Namespace) -> int:
    config = ops.ClientConfig.from_env()
    execution = ops.start_cut(config, args.cluster, "cli")
    if not args.wait:
        console.print(f"cut started: {execution}")
        return 0
    with console.status("cut: every node to its restore point"):
        outcome = ops.wait_cut(config, execution)
    if outcome.status == "SUCCEEDED" and outcome.record:
        cut = CutItem.model_validate(outcome.record)
        console.print(f"[bold]cut {cut.cut_id}[/] of {cut.cluster}: {pause_cell(cut)}")
        console.print(
            f"  restore to it: shardvault restore {cut.cluster} --target-cut {cut.cut_id}"
        )
        return 0
    errors.print(f"[bold red]cut {outcome.status}[/]: [bold]{escape(outcome.error)}[/]")
    errors.print(escape(outcome.cause))
    return ops.exit_status(outcome)


def pause_cell(cut: CutItem) -> str:
    """What the cut is worth to a distributed commit: paused (and how long it held commits),
    best-effort, or no pause asked; with the skew of its nodes' points."""
    skew = f"skew {cut.cut_skew_seconds * 1000:,.1f} ms" if cut.cut_skew_seconds is not None else ""
    if cut.status != "complete":
        return f"[bold red]failed[/] ({cut.error})"
    if cut.commit_lock is None:
        pause = "no pause asked"
    elif cut.cut_paused:
        pause = f"[green]paused[/] ≤{(cut.cut_pause_seconds or 0) * 1000:,.0f} ms"
    else:
        pause = "[yellow]best-effort[/] (the pause was not held on every node)"
    return ", ".join(p for p in (pause, skew) if p)


def run_cuts(args: argparse.Namespace) -> int:
    config = ops.ClientConfig.from_env()
    records = ops.list_cuts(config, args.cluster)
    if args.json:
        return emit_json([ops.as_row(r) for r in records])
    table = Table(
        "cut", "instant (UTC)", "shards", "pause and skew", title=f"Cuts of {args.cluster}"
    )
    for cut in records:
        instant = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(cut.instant))
        table.add_row(cut.cut_id, instant, str(len(cut.shards)), pause_cell(cut))
    console.print(table)
    if not records:
        console.print(
            f"no cuts of {args.cluster} yet: set cut.every_minutes in its policy, or "
            f"'shardvault cut {args.cluster} --wait'"
        )
    return 0
