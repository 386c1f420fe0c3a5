"""A token bucket shared by every reader of one agent: caps the bytes read per second so a
backup runs at any hour without an IO spike (WalB's lesson: there are no more "nights")."""

from __future__ import annotations

import threading
import time


class RateLimiter:
    def __init__(self, bytes_per_second: int | None, burst_seconds: float = 0.25) -> None:
        self.rate = bytes_per_second
        self.burst_seconds = burst_seconds
        self.capacity = (bytes_per_second or 0) * burst_seconds
        self.tokens = self.capacity
        self.updated = time.monotonic()
        self.lock = threading.Lock()

    def set_rate(self, bytes_per_second: float | None) -> None:
        """A new rate (None: unlimited) for the readers from now on (``throttle``)."""
        with self.lock:
            self.rate = None if bytes_per_second is None else max(1, round(bytes_per_second))
            self.capacity = (self.rate or 0) * self.burst_seconds
            self.tokens = min(self.tokens, self.capacity)

    def take(self, n: int) -> None:
        """Blocks until ``n`` bytes may be read (never when unlimited)."""
        if not self.rate:
            return
        with self.lock:
            now = time.monotonic()
            self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
            self.updated = now
            self.tokens -= n
            wait = -self.tokens / self.rate if self.tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)
