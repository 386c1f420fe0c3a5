"""The policy's upload settings reach the agents: each backup carries the cluster's rate limit
and parallelism to its agents with the checkpoint command, and an agent applies the stricter
of those and its own configuration."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from shardvault_agent.backup.throttle import AdaptiveLimiter
from shardvault_agent.commands import Commands
from shardvault_agent.engines.sqlite.adapter import SqliteAdapter
from shardvault_agent.ratelimit import RateLimiter

from shardvault.backup import upload_limits
from shardvault.config.policy import parse_policy
from shardvault.contracts.models import ObjectPlan, Phase, UploadLimits
from shardvault.data.planning import MiB

from .support import handle, sqlite_agent

POLICY = """version: 1
clusters:
  c:
    engine: sqlite
    schedule: {full: "0 2 * * *"}
    vault: {storage_class: DEEP_ARCHIVE, object_lock: {days: 1}}
    retention: {keep_daily: 7}
    upload: {rate_limit_mib_per_second: 1.5, parallelism: 2}
"""


def test_the_policys_upload_settings_become_the_backups_limits() -> None:
    cluster = parse_policy(POLICY).cluster("c")
    assert upload_limits(cluster) == UploadLimits(
        rate_limit_bytes_per_second=round(1.5 * MiB),
        parallelism=2,
        throttle="auto",  # the default: adaptive on a source in use
        throttle_window_seconds=6 * 3600,
        throttle_floor_bytes_per_second=4 * MiB,
        min_source_free_percent=5.0,
    )
    adaptive = parse_policy(POLICY.replace("parallelism: 2}", "throttle: adaptive}"))
    assert upload_limits(adaptive.cluster("c")).throttle == "adaptive"
    # A cluster the policy does not name: the agents' own rate and parallelism, and the
    # policy's default throttle with its floor (issue 44: it had none, and fell to 23 KB/s).
    unnamed = upload_limits(None)
    assert unnamed.rate_limit_bytes_per_second is None
    assert unnamed.parallelism is None
    assert unnamed.throttle_floor_bytes_per_second == 4 * MiB
    assert unnamed.throttle_window_seconds == 6 * 3600


def commands(tmp_path: Path, **agent: object) -> Commands:
    config = sqlite_agent(tmp_path, rows=3000, **agent)
    limiter = RateLimiter(config.rate_limit_bytes_per_second)
    no_faults = SimpleNamespace()  # checksum needs no sender but its faults
    return Commands(config, SqliteAdapter(config), limiter, sender=no_faults)


@pytest.mark.parametrize(
    ("agent", "policy", "rate", "parallelism"),
    [
        ({}, {}, None, 4),  # neither: the agent's defaults, no cap
        ({}, {"rate_limit_bytes_per_second": MiB, "parallelism": 2}, MiB, 2),
        (
            {"rate_limit_bytes_per_second": MiB // 2, "upload_parallelism": 1},
            {"parallelism": 3},
            MiB // 2,
            1,
        ),
        ({"rate_limit_bytes_per_second": 4 * MiB}, {"rate_limit_bytes_per_second": MiB}, MiB, 4),
    ],
)
def test_an_agent_applies_the_stricter_of_the_policy_and_its_config(
    tmp_path: Path, agent: dict, policy: dict, rate: int | None, parallelism: int
) -> None:
    cmds = commands(tmp_path, **agent)
    handle(cmds, "checkpoint", {"backup_id": "b1", "shard_ids": ["s1"], "upload": policy})

    limiter, parts_at_once = cmds.backup.limits.of("b1")

    own = limiter.parent.rate if limiter.parent else None  # the agent's cap, shared by all
    assert (limiter.rate or own, parts_at_once) == (rate, parallelism)
    handle(cmds, "release", {"backup_id": "b1", "shard_ids": ["s1"]})
    assert "b1" not in cmds.backup.limits.limiters


def test_the_policys_rate_limit_paces_the_reads_of_a_backup(tmp_path: Path) -> None:
    cmds = commands(tmp_path)
    rate = 4 * MiB
    (listing,) = handle(
        cmds,
        "checkpoint",
        {"backup_id": "b1", "shard_ids": ["s1"], "upload": {"rate_limit_bytes_per_second": rate}},
    )["shards"]
    size = listing["bytes"]
    assert size > 2 * MiB  # enough to outlast the limiter's burst (a quarter second)
    plan = ObjectPlan(
        backup_id="b1", cluster="c", node_id="n1", shard_id="s1", phase=Phase.DATA, index=0,
        key="k", stream_offset=0, length=size, part_size=8 * MiB, part_count=1,
    )  # fmt: skip

    started = time.monotonic()
    handle(cmds, "pack", {"object": plan.model_dump(mode="json")})
    elapsed = time.monotonic() - started

    # A token bucket never lets more through than its rate plus its burst: a lower bound only.
    assert elapsed >= (size - rate * 0.25) / rate * 0.95


def test_an_adaptive_backup_gets_a_limiter_of_its_own_that_release_stops(tmp_path: Path) -> None:
    """Under the stricter cap, above a floor that reads the data once in the window; the
    pack's answer carries its report; release stops its controller."""
    cmds = commands(tmp_path, rate_limit_bytes_per_second=64 * MiB)
    upload = {
        "rate_limit_bytes_per_second": 32 * MiB,
        "throttle": "adaptive",
        "throttle_window_seconds": 1,  # the floor: all the data in a second
        "throttle_floor_bytes_per_second": 1024,
    }
    (listing,) = handle(
        cmds, "checkpoint", {"backup_id": "b1", "shard_ids": ["s1"], "upload": upload}
    )["shards"]
    limiter, _ = cmds.backup.limits.of("b1")
    assert isinstance(limiter, AdaptiveLimiter)
    assert cmds.backup.limits.of("b1")[0] is limiter  # one per backup, shared by its readers
    assert limiter.aimd.ceiling == 32 * MiB
    assert limiter.aimd.floor == listing["bytes"]  # its data once within the 1 s window
    plan = ObjectPlan(
        backup_id="b1", cluster="c", node_id="n1", shard_id="s1", phase=Phase.DATA, index=0,
        key="k", stream_offset=0, length=listing["bytes"], part_size=8 * MiB, part_count=1,
    )  # fmt: skip
    packed = handle(cmds, "pack", {"object": plan.model_dump(mode="json")})
    assert packed["throttle"]["mode"] == "adaptive"
    assert packed["throttle"]["floor_bytes_per_second"] == listing["bytes"]

    handle(cmds, "release", {"backup_id": "b1", "shard_ids": ["s1"]})
    assert "b1" not in cmds.backup.limits.limiters
    assert limiter.thread is None  # the controller ended, and closed its signals


class Probe:
    """A source's answer to whether clients other than ShardVault's are connected."""

    def __init__(self, in_use: bool | Exception) -> None:
        self.in_use, self.closed = in_use, False

    def ask(self) -> bool:
        if isinstance(self.in_use, Exception):
            raise self.in_use
        return self.in_use

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(
    ("probe", "adaptive"),
    [
        (None, False),  # an engine that cannot tell (SQLite's has no server): static
        (Probe(False), False),  # an idle source: static, no controller to pay for
        (Probe(True), True),  # clients connected: steered by the source's health
        (Probe(ConnectionError("down")), False),  # a probe that fails never fails the backup
    ],
)
def test_auto_steers_a_backup_only_when_its_source_is_in_use(
    tmp_path: Path, monkeypatch, probe: Probe | None, adaptive: bool
) -> None:
    cmds = commands(tmp_path)
    monkeypatch.setattr(cmds.engine, "health_probe", lambda shard: probe)
    handle(
        cmds, "checkpoint", {"backup_id": "b1", "shard_ids": ["s1"], "upload": {"throttle": "auto"}}
    )

    limiter, _ = cmds.backup.limits.of("b1")

    assert isinstance(limiter, AdaptiveLimiter) == adaptive
    assert probe is None or probe.closed  # asked once, then its session closed
    handle(cmds, "release", {"backup_id": "b1", "shard_ids": ["s1"]})
