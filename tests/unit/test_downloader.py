"""The downloader tells a damaged object from a slow network: a store that answers and cuts
every try at the same byte cannot serve the object (StoreObjectDamaged, not retried again);
timeouts are the network's (PartDownloadFailed, which the restore retries)."""

from __future__ import annotations

import pytest
import urllib3
from shardvault_agent.ratelimit import RateLimiter
from shardvault_agent.transfer import Downloader

from shardvault.errors import PartDownloadFailed, StoreObjectDamaged


class Response:
    def __init__(self, fail: Exception, chunks: list[bytes]) -> None:
        self.status, self.fail, self.chunks = 206, fail, chunks

    def stream(self, size: int):
        yield from self.chunks
        raise self.fail

    def release_conn(self) -> None:
        pass


class Store:
    def __init__(self, fail: Exception, chunks: list[bytes]) -> None:
        self.fail, self.chunks, self.calls = fail, chunks, 0

    def request(self, *args, **kwargs) -> Response:
        self.calls += 1
        return Response(self.fail, self.chunks)


def fetch(store: Store) -> None:
    downloader = Downloader(store, attempts=3, limiter=RateLimiter(None), sleep=lambda s: None)
    downloader.fetch("https://store/o", "o", 0, 1024, lambda at, data: None)


def test_a_store_that_cuts_every_try_at_the_same_byte_has_a_damaged_object():
    cut = urllib3.exceptions.ProtocolError("Connection broken: IncompleteRead")
    store = Store(cut, [b"x" * 100])
    with pytest.raises(StoreObjectDamaged, match="at byte 100"):
        fetch(store)
    assert store.calls == 3


@pytest.mark.parametrize("chunks", [[], [b"x" * 100]])
def test_timeouts_are_the_networks_and_are_retried_by_the_restore(chunks):
    timeout = urllib3.exceptions.ReadTimeoutError(None, "https://store/o", "read timed out")
    with pytest.raises(PartDownloadFailed):
        fetch(Store(timeout, chunks))
