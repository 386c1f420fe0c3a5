"""Token buckets over the bytes an agent reads, so a backup runs at any hour without an IO
spike (WalB's lesson: there are no more "nights").

The agent has one bucket of its own (its ``rate_limit_bytes_per_second``, shared by every
backup and restore); every backup has a bucket of its own too (the policy's rate, or the
adaptive throttle's, ``throttle``), which charges the agent's (``parent``) and checks the
backup's *guard* before every read (``sourceguard``): a guard that raises fails the read, and
with it the command.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class RateLimiter:
    def __init__(
        self,
        bytes_per_second: int | None,
        burst_seconds: float = 0.25,
        *,
        parent: RateLimiter | None = None,
        guard: Callable[[], None] | None = None,
    ) -> None:
        self.rate = bytes_per_second
        self.burst_seconds = burst_seconds
        self.capacity = (bytes_per_second or 0) * burst_seconds
        self.tokens = self.capacity
        self.updated = time.monotonic()
        self.lock = threading.Lock()
        self.parent, self.guard = parent, guard

    def paced(self) -> bool:
        """Whether reads through it may be made to wait: a rate here or above."""
        return self.rate is not None or (self.parent is not None and self.parent.paced())

    def set_rate(self, bytes_per_second: float | None) -> None:
        """A new rate (None: unlimited) for the readers from now on (``throttle``)."""
        with self.lock:
            self.rate = None if bytes_per_second is None else max(1, round(bytes_per_second))
            self.capacity = (self.rate or 0) * self.burst_seconds
            self.tokens = min(self.tokens, self.capacity)

    def take(self, n: int) -> None:
        """Blocks until ``n`` bytes may be read (never when unlimited), after the guard."""
        if self.guard is not None:
            self.guard()
        with self.lock:  # the rate too: a controller may change it meanwhile
            wait, rate = 0.0, self.rate
            if rate:
                now = time.monotonic()
                self.tokens = min(self.capacity, self.tokens + (now - self.updated) * rate)
                self.updated = now
                self.tokens -= n
                wait = -self.tokens / rate if self.tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)
        if self.parent is not None:
            self.parent.take(n)
