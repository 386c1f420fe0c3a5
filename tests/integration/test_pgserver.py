"""Starting a PostgreSQL server, as restores and the local stack do, against a real one."""

from __future__ import annotations

import time

import pytest

from shardvault.local.postgres import init_instance


def test_a_server_that_stops_while_it_starts_is_said_at_once(tmp_path):
    # A restored copy whose recovery ends before its target accepts connections and then
    # exits: waiting for it to be ready must end with its log, not after the start timeout.
    instance = init_instance(tmp_path / "data")
    instance.stop(mode="immediate")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="stopped while it started"):
        instance.wait_ready(timeout=60)
    assert time.monotonic() - started < 10
