"""The agent limits glibc's malloc arenas to two (``shardvault_agent.malloc``): threads that
allocate share them, and an operator's ``MALLOC_ARENA_MAX`` wins."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

AGENTS = Path(__file__).resolve().parents[2] / "agents"

# Eight threads allocate at once; glibc's malloc_info then lists one <heap> per arena.
SCRIPT = """
import ctypes, sys, threading
from shardvault_agent.malloc import limit_arenas
print(limit_arenas())
start = threading.Barrier(8)
held = []
def allocate():
    start.wait()
    held.extend(ctypes.create_string_buffer(64 * 1024) for _ in range(50))
threads = [threading.Thread(target=allocate) for _ in range(8)]
for thread in threads: thread.start()
for thread in threads: thread.join()
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
out = libc.fopen(sys.argv[1].encode(), b"w")
libc.malloc_info(0, ctypes.c_void_p(out))
libc.fclose(ctypes.c_void_p(out))
"""


def arenas(tmp_path: Path, **env: str) -> tuple[str, int]:
    info = tmp_path / "malloc.xml"
    environment = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"} | env
    environment["PYTHONPATH"] = str(AGENTS)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(info)],
        env=environment,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip(), info.read_text().count("<heap nr=")


def test_the_agent_allocates_from_two_arenas_whatever_its_threads(tmp_path) -> None:
    assert arenas(tmp_path) == ("True", 2)


def test_the_operators_malloc_arena_max_is_kept(tmp_path) -> None:
    said, count = arenas(tmp_path, MALLOC_ARENA_MAX="4")
    assert said == "False"
    assert count == 4  # glibc's own reading of the variable: more than the agent's two
