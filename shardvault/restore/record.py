"""A restore's record in the catalog: its id, and the key it is kept under beside the
target cluster's backups."""

from __future__ import annotations

import secrets
import time

from shardvault.contracts.catalog import restore_key


def new_restore_id(now: float) -> str:
    return "r" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now)) + "-" + secrets.token_hex(3)


def catalog_key(restore_id: str) -> str:
    return restore_key(restore_id)
