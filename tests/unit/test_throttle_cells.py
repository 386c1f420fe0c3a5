"""What backup --wait, the summary and show say of an adaptive backup's throttle, of the WAL a
backup held on its source and of what an incremental read."""

from __future__ import annotations

from shardvault.client.records import held_cell, throttle_cell, throttle_note
from shardvault.contracts.models import ThrottleReport
from tests.unit.support import backup_item

MiB = 2**20


def test_the_progress_line_says_the_rate_and_what_holds_it_back_only_while_it_does() -> None:
    assert throttle_note(None) == ""
    assert throttle_note(ThrottleReport()) == ""
    held = ThrottleReport(limited_by="cpu stall", rate_bytes_per_second=12 * MiB)
    assert throttle_note(held) == "; reading at 12.0 MiB/s (held back by cpu stall)"


def test_the_summary_says_what_the_throttle_did_over_the_backup() -> None:
    assert throttle_cell(ThrottleReport(cuts=0)) == (
        "adaptive: never held back (the source stayed within its targets)"
    )
    throttle = ThrottleReport(
        cuts=3,
        throttled_seconds=12.5,
        lowest_rate_bytes_per_second=4 * MiB,
        floor_bytes_per_second=4 * MiB,
    )
    assert throttle_cell(throttle) == (
        "adaptive: held back 3 times, 12.5 s in all, lowest 4.0 MiB/s (floor 4.0 MiB/s)"
    )
    throttle = throttle.model_copy(
        update={"limited_by": "s1 latency", "rate_bytes_per_second": 20 * MiB}
    )
    assert throttle_cell(throttle).endswith("; last 20.0 MiB/s, held back by s1 latency")


def test_the_wal_a_backup_held_is_said_in_bytes_and_mib() -> None:
    assert held_cell(backup_item(backup_id="b", held_log_bytes=3 * MiB)) == (
        "3,145,728 (3.0 MiB) at most, until the backup let it go"
    )


def test_the_summary_says_what_page_headers_vouched_for_beside_the_bytes_read() -> None:
    from shardvault.client.records import read_cell

    assert read_cell(backup_item(backup_id="b", read_bytes=3 * MiB)) == "3,145,728 (3.0 MiB)"
    screened = backup_item(backup_id="b", read_bytes=3 * MiB, data_screened_bytes=96 * MiB)
    assert read_cell(screened) == (
        "3,145,728 (3.0 MiB); 100,663,296 (96.0 MiB) more vouched for by page headers"
    )
