"""Timing probes on the control-plane steps of ShardVault's upload (local stack only).

In the local stack the Lambda handlers run in this process. The probes wrap, without changing
what they do, the three steps an object's upload passes through here: *dispatch* (a command
and its task token posted to the agent's inbox), *sign* (the multipart upload created and one
URL per part presigned) and *complete* (the upload completed and verified). Each call is
recorded as (step, command, key, start, end) in epoch seconds. With the agent's log, which
says when each command ended and how long it ran, this splits an object's time into waiting
for the agent, agent work, and control-plane work.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Probe:
    events: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wrap(
        self, step: str, function: Callable[..., Any], name: Callable[..., tuple[str, str]]
    ) -> Callable[..., Any]:
        """``function``, recording each call; ``name(*args)`` gives its (command, key)."""

        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.time()
            try:
                return function(*args, **kwargs)
            finally:
                command, key = name(*args)
                event = {"step": step, "command": command, "key": key, "start": start}
                with self.lock:
                    self.events.append(event | {"end": time.time()})

        return timed

    def drain(self) -> list[dict[str, Any]]:
        """The events recorded since the last drain."""
        with self.lock:
            events, self.events = self.events, []
        return events


def _dispatch_name(request: Any, *_: Any) -> tuple[str, str]:
    return request.command, request.args.get("object", {}).get("key", "")


def _object_name(step: str) -> Callable[..., tuple[str, str]]:
    return lambda item, *_: (step, item.key)


def install() -> Probe:
    """Wraps the dispatch, sign and complete steps; call after the local stack has started
    (it puts the repository's ``functions`` package on the import path)."""
    import functions.dispatch as dispatch_handler
    from shardvault import backup

    probe = Probe()
    dispatch_handler.dispatch = probe.wrap("dispatch", dispatch_handler.dispatch, _dispatch_name)
    backup.sign = probe.wrap("sign", backup.sign, _object_name("sign"))
    backup.complete = probe.wrap("complete", backup.complete, _object_name("complete"))
    return probe
