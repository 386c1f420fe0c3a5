"""An agent with faults injected into its uploads, for the tests (never in production code).

``python -m shardvault.local.agent_faults run --config agent.yaml`` runs the agent
(``shardvault_agent.cli``) with its part sender's HTTP pool wrapped in ``FaultyHttp``, as
``SHARDVAULT_AGENT_FAULTS`` asks (comma-separated ``name=value``):

- ``upload_part=N``: the first N tries of every part fail before a byte is sent (a
  connection refused), of the objects whose key holds ``upload_part_of`` if that is set;
- ``first_try_delay=S``: the first try of every part waits S seconds (its URL expires);
- ``corrupt_part=1``: the first try of every part sends one flipped bit (damage on the way);
- ``corrupt_answer=1``: every answer of a listing command is sent with one flipped bit (an
  answer replaced in the work bucket).

A *part* is a PUT of a backup object (a presigned UploadPart, or the single PutObject of an
object of one part: part 1); an *answer* a PUT under ``answers/`` in the work bucket. The
local stack starts its agents this way when their environment sets the variable
(``LocalStack.start_agent``).
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, BinaryIO
from urllib.parse import parse_qs, urlsplit

from shardvault.aws.services import ANSWERS_DIR
from shardvault.contracts.layout import ARCHIVE_DIR

VARIABLE = "SHARDVAULT_AGENT_FAULTS"


class InjectedFault(ConnectionError):
    """A failure the tests asked for: the agent sees a connection that failed."""


@dataclass
class Faults:
    part_failures: int = 0
    failing_keys: str = ""
    first_try_delay: float = 0.0
    corrupt_part: bool = False
    corrupt_answer: bool = False

    @classmethod
    def parse(cls, spec_text: str) -> Faults:
        spec = dict(item.split("=", 1) for item in spec_text.split(",") if "=" in item)
        return cls(
            part_failures=int(spec.get("upload_part", 0)),
            failing_keys=spec.get("upload_part_of", ""),
            first_try_delay=float(spec.get("first_try_delay", 0)),
            corrupt_part=spec.get("corrupt_part") == "1",
            corrupt_answer=spec.get("corrupt_answer") == "1",
        )


def damaged(stream: BinaryIO) -> BinaryIO:
    """The stream's bytes with the middle byte's lowest bit flipped."""
    data = bytearray(stream.read())
    data[len(data) // 2] ^= 0x01
    return io.BytesIO(bytes(data))


@dataclass
class FaultyHttp:
    """``http`` (a urllib3 pool) with ``faults`` applied to the PUTs the agent sends."""

    http: Any
    faults: Faults
    _tries: dict[tuple[str, str], int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def request(self, method: str, url: str, **kwargs: Any) -> Any:
        if method == "PUT":
            kwargs = self._applied(url, kwargs)
        return self.http.request(method, url, **kwargs)

    def _applied(self, url: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        parsed = urlsplit(url)
        if f"/{ANSWERS_DIR}/" in parsed.path:
            if self.faults.corrupt_answer:
                kwargs["body"] = damaged(kwargs["body"])
            return kwargs
        if "/backups/" not in parsed.path or f"/{ARCHIVE_DIR}/" in parsed.path:
            return kwargs  # a probe, a WAL batch: not a backup's part
        part = parse_qs(parsed.query).get("partNumber", ["1"])[0]
        with self._lock:
            seen = self._tries.get((parsed.path, part), 0)
            self._tries[(parsed.path, part)] = seen + 1
        if seen == 0 and self.faults.first_try_delay:
            time.sleep(self.faults.first_try_delay)
        if seen < self.faults.part_failures and self.faults.failing_keys in parsed.path:
            raise InjectedFault(f"injected failure {seen + 1} of part {part} of {parsed.path}")
        if seen == 0 and self.faults.corrupt_part:
            kwargs["body"] = damaged(kwargs["body"])
        return kwargs


def main(argv: list[str]) -> int:
    from shardvault_agent import cli, daemon

    faults = Faults.parse(os.environ.get(VARIABLE, ""))
    sender = daemon.PartSender

    def faulty_sender(*, http: Any, **kwargs: Any) -> Any:
        return sender(http=FaultyHttp(http, faults), **kwargs)

    daemon.PartSender = faulty_sender  # type: ignore[assignment, misc]
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
