"""A restore's record in the catalog: its id, and the key it is kept under beside the
target cluster's backups."""

from __future__ import annotations

import secrets
import time

from shardvault.aws.tables import RESTORE_PREFIX


def new_restore_id(now: float) -> str:
    return "r" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + "-" + secrets.token_hex(3)


def catalog_key(restore_id: str) -> str:
    return f"{RESTORE_PREFIX}{restore_id}"
