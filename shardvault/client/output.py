"""How the CLI speaks: tables and text on stdout (``console``), JSON for scripts
(``emit_json``), refusals and failures on stderr (``errors``), so stdout stays what a script
parses."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape

from shardvault.client import operations as ops
from shardvault.data.planning import MiB

# The CLI's width when stdout is not a terminal (a pipe, a file, a log): rich would cut tables
# at 80 columns; COLUMNS, when set, still decides.
PIPED_WIDTH = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 200
console = Console(width=PIPED_WIDTH)


# Refusals and their fixes go to stderr, so stdout stays what a script parses. They are never
# hard-wrapped: a path or key in an error must survive a copy and paste whole.
errors = Console(stderr=True, soft_wrap=True)


REFUSED = 3  # argparse exits 2 on a usage error


def emit_json(data: Any) -> int:
    """``--json``: one JSON document on stdout, nothing else (no colours, no wrapping)."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    return 0


def sized(count: int) -> str:
    return f"{count:,} ({count / MiB:,.1f} MiB)"


def print_failure(what: str, outcome: ops.Progress) -> None:
    """A followed run that failed: its error and cause, on stderr (stdout is the output)."""
    errors.print(f"[bold red]{what} {outcome.status}[/]: [bold]{escape(outcome.error)}[/]")
    errors.print(escape(outcome.cause))
