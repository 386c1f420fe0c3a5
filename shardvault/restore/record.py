"""A restore's id: its start time (so ids sort by time) and a random suffix. Its catalog
item is kept under ``contracts.catalog.restore_key`` beside the target cluster's backups."""

from __future__ import annotations

import secrets
import time


def new_restore_id(now: float) -> str:
    return "r" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + "-" + secrets.token_hex(3)
