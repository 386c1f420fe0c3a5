"""Following a backup or restore the CLI started (``--wait``): bytes, rate and ETA until the
execution ends, then its summary or its error."""

from __future__ import annotations

from collections.abc import Callable

from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from shardvault.client import operations as ops
from shardvault.client.output import console, print_failure
from shardvault.client.records import chain_root_of, print_restore, print_summary, throttle_note
from shardvault.contracts.catalog import BackupItem
from shardvault.contracts.models import (
    ThrottleReport,
)


def follow(
    config: ops.ClientConfig,
    execution: str,
    wait: Callable[..., ops.Progress] = ops.wait_backup,
    what: str = "backup",
) -> ops.Progress:
    """Shows bytes done, rate and ETA until the execution ends; then its summary or error."""
    columns = (
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:
        first = "checkpointing" if what == "backup" else "preparing"
        task = bar.add_task(first, total=None)

        def update(p: ops.Progress) -> None:
            moving = "uploading" if what == "backup" else "downloading"
            phase = moving if p.bytes_total else first
            if frozen := (p.record or {}).get("frozen"):
                phase = f"waiting for {frozen} archived objects to thaw;"
            throttle = (p.record or {}).get("throttle")
            steered = throttle_note(ThrottleReport.model_validate(throttle) if throttle else None)
            bar.update(
                task,
                description=f"{phase} {p.objects_done}/{p.objects_total} objects{steered}",
                completed=p.bytes_done,
                total=p.bytes_total or None,
            )

        outcome = wait(config, execution, update)
    if outcome.status == "SUCCEEDED" and what == "backup":
        record = BackupItem.from_item(outcome.record or {})
        print_summary(record, chain_root_of(config, record))
    elif outcome.status == "SUCCEEDED":
        print_restore(outcome.record or {})
    else:
        print_failure(what, outcome)
    return outcome
