"""The mapped screen: a block screen judges a range of a file through a mapping, in a helper.

Terms:
- *mapped screen*: a screened range (``scan.screen_range``) is mapped (``mmap``) and its
  engine's screen reads each block's header in place. The kernel maps the page cache's
  pages into the process without copying them, so a range costs its page-table entries,
  where reading it costs a copy of every byte through the CPU: in a dev probe over
  ``pgbench -i -s 100``'s three relation files (1.5 GiB, in the page cache), 0.03 s on one
  thread, against 0.2 s read a MiB at a time into a buffer (0.16 s on two threads). Only
  the blocks the screen lets through are then read and hashed, by the scan.
- *helper*: a mapped page past its file's end kills the process that touches it (SIGBUS),
  and a live file may shrink under the scan (PostgreSQL's VACUUM truncates a table's empty
  tail; DROP and TRUNCATE empty a relation's first segment). So the mapping is read by a
  helper process of the agent's own (``python -m shardvault_agent.backup.mappedscreen``, started
  when first asked), over a pipe: the helper maps no more than its file holds when it
  opens it, and one killed by a truncation racing its read takes only that request with it.
  The scan reads that range instead, as it does without a helper, and the helper is started
  again on a later request, after ``REST_SECONDS`` (a file truncated again and again is
  read meanwhile, not mapped).
- *request*: ``(path, offset, length, screen, block_size)``, pickled (the agent's own child
  reads it: nothing from outside the agent crosses the pipe); the answer is the indexes,
  from the range's first block, of the blocks the screen does not prove unchanged, with
  every block past the file's current end (the scan reads those as zeros, as its reads do).
  A helper that reads EOF on its input (the agent ended) ends too.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import mmap
import os
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from shardvault_agent.backup.blockmap import block_count

if TYPE_CHECKING:  # the helper imports little: its engine's screen comes with its requests
    from shardvault_agent.engines.base import BlockScreen

log = logging.getLogger("shardvault.agent")

REST_SECONDS = 60.0  # after a helper died: ranges are read, not mapped, this long
WINDOW_BYTES = 32 * 2**20  # mapped at once by the helper (a multiple of the pages' size)
PRELOAD, PRELOADED = "preload", "preloaded"  # a request to import a module of the agent's


class MappedScreener:
    """The agent's helper, shared by the scan's threads (one request at a time: a range is
    judged in well under a millisecond once mapped, so they seldom wait)."""

    def __init__(self, command: list[str] | None = None) -> None:
        self.command = command or [sys.executable, "-m", "shardvault_agent.backup.mappedscreen"]
        self.lock = threading.Lock()
        self.process: subprocess.Popen[bytes] | None = None
        self.resting_until = 0.0

    def start(self, preload: str | None = None) -> None:
        """Starts the helper now, unless it runs or rests, and has it import ``preload`` (the
        engine's screen module) while nothing waits for it."""
        with self.lock:
            process = self._started()
            if process is None or preload is None:
                return
            try:
                pickle.dump((PRELOAD, preload), _pipe(process.stdin))
                _pipe(process.stdin).flush()
            except OSError as error:
                self._ended(process, error)

    def may_differ(
        self, path: Path, offset: int, length: int, screen: BlockScreen, block_size: int
    ) -> list[int] | None:
        """The indexes, from ``offset``'s block, of the blocks of ``length`` bytes at ``offset``
        that ``screen`` does not prove unchanged; None when the helper cannot say (it died,
        rests, or the screen does not pickle): the caller reads the range instead."""
        try:  # whole before anything is written: a request that does not pickle is read
            request = pickle.dumps(
                (str(path), offset, length, screen, block_size), protocol=pickle.HIGHEST_PROTOCOL
            )
        except (pickle.PicklingError, TypeError, AttributeError):
            return None
        with self.lock:
            process = self._started()
            if process is None:
                return None
            try:
                _pipe(process.stdin).write(request)
                _pipe(process.stdin).flush()
                answer = pickle.load(_pipe(process.stdout))
                while answer == PRELOADED:  # the preload's answer, read with the first request's
                    answer = pickle.load(_pipe(process.stdout))
            except (OSError, EOFError, pickle.UnpicklingError) as error:
                self._ended(process, error)
                return None
        # The helper answers ascending indexes: its first and last bound them all.
        count = block_count(length, block_size)
        if not isinstance(answer, list) or (answer and not 0 <= answer[0] <= answer[-1] < count):
            return None  # not an answer to this request: read the range
        return answer

    def close(self) -> None:
        with self.lock:
            if self.process is not None:
                _stop(self.process)
                self.process = None

    def _started(self) -> subprocess.Popen[bytes] | None:
        if self.process is not None and self.process.poll() is None:
            return self.process
        if self.process is not None:
            self._ended(self.process, EOFError("it exited"))
        if time.monotonic() < self.resting_until:
            return None
        try:
            self.process = subprocess.Popen(
                self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True
            )
        except OSError as error:
            self.resting_until = time.monotonic() + REST_SECONDS
            log.warning("the mapped screen's helper did not start (%s): ranges are read", error)
        return self.process

    def _ended(self, process: subprocess.Popen[bytes], error: BaseException) -> None:
        """Notes a helper that stopped answering, and rests before starting another."""
        _stop(process)
        self.process = None
        self.resting_until = time.monotonic() + REST_SECONDS
        code = process.returncode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit {code}"
        log.warning(
            "the mapped screen's helper stopped (%s: %s): screened ranges are read for %.0f s",
            how,
            error,
            REST_SECONDS,
        )


def _pipe(stream: BinaryIO | None) -> BinaryIO:
    if stream is None:
        raise OSError("the helper's pipe is closed")
    return stream


def _stop(process: subprocess.Popen[bytes]) -> None:
    for stream in (process.stdin, process.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
    if process.poll() is None:
        process.kill()
    process.wait()


def judged(path: str, offset: int, length: int, screen: BlockScreen, block_size: int) -> list[int]:
    """The helper's answer to one request (see the module docstring), the range mapped
    ``WINDOW_BYTES`` at a time (a mapped page counts in the helper's resident memory while it
    is mapped, though it is the page cache's)."""
    count = block_count(length, block_size)
    differ: list[int] = []
    try:
        with open(path, "rb") as handle:
            present = max(0, min(length, os.fstat(handle.fileno()).st_size - offset))
            window = max(block_size, WINDOW_BYTES - WINDOW_BYTES % block_size)
            for start in range(0, present, window):
                size = min(window, present - start)
                first = start // block_size
                with mmap.mmap(
                    handle.fileno(), size, offset=offset + start, prot=mmap.PROT_READ
                ) as held:
                    view = memoryview(held)
                    try:
                        differ += [first + n for n in screen.may_differ(view, block_size)]
                    finally:
                        view.release()
    except FileNotFoundError:  # removed since its listing: zeros, as the scan reads it
        return list(range(count))
    # Every block past the end comes after every block before it: no set to merge them.
    return sorted(differ) + list(range(block_count(present, block_size), count))


def serve(requests: BinaryIO, answers: BinaryIO) -> None:
    """Answers requests until the agent closes the pipe; a request that fails is answered
    None (the scan reads that range), with its error on the helper's stderr (the agent's),
    once for each kind of error (a file system that cannot map fails every range)."""
    said: set[str] = set()
    while True:
        try:
            request: Any = pickle.load(requests)
        except EOFError:
            return
        answer: list[int] | str | None = PRELOADED if request[0] == PRELOAD else None
        try:
            if answer != PRELOADED:
                answer = judged(*request)
            elif str(request[1]).startswith("shardvault_agent."):  # the agent's own modules
                importlib.import_module(request[1])
        except Exception as error:  # the range is read instead; the helper goes on
            if type(error).__name__ not in said:
                said.add(type(error).__name__)
                print(f"mapped screen: {request[0]}: {error!r}", file=sys.stderr, flush=True)
        pickle.dump(answer, answers, protocol=pickle.HIGHEST_PROTOCOL)
        answers.flush()


def main() -> None:
    """The helper: answers on its stdout, which nothing else may write to (a stray print
    would corrupt the answers), so stdout becomes a copy of stderr."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    serve(sys.stdin.buffer, answers)


if __name__ == "__main__":
    main()
