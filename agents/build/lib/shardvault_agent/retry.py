"""The one retry policy of the agent's transfers (a part's upload, a range's download).

A try that failed for a reason another try may not meet (a connection reset, a 503, a timeout)
raises ``TryAgain``; anything else ends the transfer at once. Tries wait exponentially longer
with full jitter (a random wait up to ``BASE_DELAY * 2**n``, at most ``MAX_DELAY``), so agents
that failed together do not retry together.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_random_exponential

BASE_DELAY = 0.2
MAX_DELAY = 10.0
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class TryAgain(Exception):
    """One try failed in a way a later try may not: ``why`` says how, for the final error."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def retrying(attempts: int, sleep: Callable[[float], None] = time.sleep) -> Retrying:
    """Iterate over it (``for attempt in retrying(n): with attempt: ...``); after the last
    try the last ``TryAgain`` is raised again, for the caller to name the failure."""
    return Retrying(
        stop=stop_after_attempt(max(1, attempts)),
        wait=wait_random_exponential(multiplier=BASE_DELAY, max=MAX_DELAY),
        retry=retry_if_exception_type(TryAgain),
        sleep=sleep,
        reraise=True,
    )
