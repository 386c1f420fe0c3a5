"""How hard each backup may read and send on this node (``BackupLimits``).

A backup has a *limiter* of its own, made when it starts reading and closed at its release:
the stricter of the policy's rate (brought by the checkpoint command) and this agent's, charged
to the agent's limiter too (its cap is shared by every backup). Before every read the limiter
checks the backup's *source guard* (``sourceguard``: what the backup holds of its shards' log,
and the source disk's free space). With the policy's adaptive throttle (``throttle``), the
limiter steers under that cap by the signals of the source's load, never below the *floor*:
the rate that reads the node's captured data once within the policy's window.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable

from shardvault.contracts.models import Phase, UploadLimits
from shardvault_agent.backup.sourceguard import SourceGuard
from shardvault_agent.backup.state import BackupFiles
from shardvault_agent.backup.throttle import (
    AdaptiveLimiter,
    LatencySignal,
    Signal,
    StallSignal,
    pressure_files,
)
from shardvault_agent.config import AgentConfig, ShardConfig
from shardvault_agent.engines.base import EngineAdapter
from shardvault_agent.ratelimit import RateLimiter

log = logging.getLogger("shardvault.agent")


class BackupLimits:
    """Each running backup's limiter and source guard, from its first read to its release."""

    def __init__(
        self,
        config: AgentConfig,
        engine: EngineAdapter,
        agent_limiter: RateLimiter,
        files: BackupFiles,
        shards: Callable[[], dict[str, ShardConfig]],
    ) -> None:
        self.config, self.engine, self.agent_limiter = config, engine, agent_limiter
        self.files, self.shards = files, shards
        self.limiters: dict[str, RateLimiter] = {}
        self.guards: dict[str, SourceGuard] = {}
        self._guard_lock = threading.Lock()

    def of(self, backup_id: str) -> tuple[RateLimiter, int]:
        """The rate limiter and the parts sent at once for a backup: the stricter of the
        policy's (sent with the checkpoint) and this agent's configuration."""
        limits = self.files.upload_limits(backup_id)
        parallelism = min(self.config.upload_parallelism, limits.parallelism or sys.maxsize)
        with self._guard_lock:
            limiter = self.limiters.get(backup_id)
        if limiter is not None:
            return limiter, parallelism
        # Made outside the lock (an adaptive one asks the server for its baseline), kept
        # under it. Release leaves its tombstone before it takes these away: a command that
        # passed its own check before the release must not make them again.
        adaptive = self._adaptive(backup_id, limits)
        floor = self._floor(backup_id, limits) if adaptive else 0.0
        made = self._backup_limiter(backup_id, limits, adaptive, floor)
        try:
            with self._guard_lock:
                self.files.refuse_released(backup_id)
                limiter = self.limiters.setdefault(backup_id, made)
        finally:
            if self.limiters.get(backup_id) is not made:
                self._close(backup_id, made)
        return limiter, parallelism

    def peak_held_log(self, backup_id: str) -> int | None:
        """The most log the backup has held so far, as its guard saw it."""
        guard = self.guards.get(backup_id)
        return guard.peak if guard is not None else None

    def release(self, backup_id: str) -> None:
        """Stops the backup's controller and its guard: the backup has ended on this node."""
        with self._guard_lock:
            limiter = self.limiters.pop(backup_id, None)
        self._close(backup_id, limiter)

    def _close(self, backup_id: str, limiter: RateLimiter | None) -> None:
        """Stops a backup's controller, and its guard unless another limiter of the backup
        still reads through it."""
        if isinstance(limiter, AdaptiveLimiter):
            limiter.close()
        with self._guard_lock:
            kept = backup_id in self.limiters
            guard = None if kept else self.guards.pop(backup_id, None)
        if guard is not None:
            guard.close()

    def _adaptive(self, backup_id: str, limits: UploadLimits) -> bool:
        """Whether the backup's reads are steered: ``adaptive``, or ``auto`` on a source in
        use (some shard's server has clients other than ShardVault's now, as its engine's
        probe sees them; an engine without a probe cannot tell, and reads static). Asked once,
        as the backup starts reading; a probe that fails counts as no client."""
        if limits.throttle != "auto":
            return limits.throttle == "adaptive"
        for shard in self.shards().values():
            probe = None
            try:
                probe = self.engine.health_probe(shard)
                if probe is not None and probe.ask():
                    log.info(
                        "backup %s: shard %s's source is in use: adaptive",
                        backup_id,
                        shard.shard_id,
                    )
                    return True
            except Exception as error:  # the throttle never fails a backup
                log.warning(
                    "backup %s: shard %s not asked for its clients: %s",
                    backup_id,
                    shard.shard_id,
                    error,
                )
            finally:
                if probe is not None:
                    probe.close()
        return False

    def _backup_limiter(
        self, backup_id: str, limits: UploadLimits, adaptive: bool, floor: float
    ) -> RateLimiter:
        """The backup's own bucket, charging the agent's (its cap is shared by all)."""
        guard = self._guard(backup_id, limits)
        rate, own = limits.rate_limit_bytes_per_second, self.config.rate_limit_bytes_per_second
        if adaptive:
            ceiling = min((r for r in (rate, own) if r is not None), default=None)
            return AdaptiveLimiter(
                floor, ceiling, self._signals, guard=guard.check, parent=self.agent_limiter
            )
        stricter = rate if rate is not None and (own is None or rate < own) else None
        return RateLimiter(stricter, parent=self.agent_limiter, guard=guard.check)

    def _guard(self, backup_id: str, limits: UploadLimits) -> SourceGuard:
        """What the backup holds of its shards' log, watched from now until its release."""
        shards = list(self.shards().values())
        with self._guard_lock:
            guard = self.guards.get(backup_id)
            if guard is None:
                guard = SourceGuard(
                    backup_id,
                    lambda: [h for s in shards if (h := self.engine.held_log(s, backup_id))],
                    limits.max_held_log_bytes,
                    limits.min_source_free_percent,
                )
                self.guards[backup_id] = guard
        return guard

    def _floor(self, backup_id: str, limits: UploadLimits) -> float:
        """An adaptive backup's floor: the rate that reads the node's captured data once
        within the policy's window, and no less than the policy's floor."""
        captured = [
            self.files.load_capture(backup_id, shard_id, Phase.DATA)
            for shard_id in self.shards()
            if self.files.capture_path(backup_id, shard_id, Phase.DATA).exists()
        ]
        data_bytes = sum(capture.bytes for capture in captured)
        window = limits.throttle_window_seconds
        return max(limits.throttle_floor_bytes_per_second or 1, data_bytes / window)

    def _signals(self) -> list[Signal]:
        """The CPU and IO stall of the first shard's server's cgroup (one server per node is
        the rule; else the host's), and each shard's probe. A probe that cannot take its
        baseline is left out (its session closed): the other signals still steer."""
        cfg, shards = self.config, list(self.shards().values())
        pid = next((p for s in shards if (p := self.engine.server_pid(s))), None)
        signals: list[Signal] = [
            StallSignal(f"{resource} stall", path, cfg.throttle_stall_margin, time.monotonic)
            for resource, path in pressure_files(pid).items()
            if path.exists()
        ]
        slack = cfg.throttle_latency_slack_ms / 1000
        for shard in shards:
            if (probe := self.engine.health_probe(shard)) is None:
                continue
            name = f"{shard.shard_id} latency"
            try:
                signals.append(LatencySignal(name, probe, cfg.throttle_latency_ratio, slack))
            except Exception as error:
                probe.close()
                log.warning("throttle: no %s signal: %s", name, error)
        return signals
