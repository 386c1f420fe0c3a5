"""The C allocator's arenas: two rather than glibc's default, so that a busy agent's memory
stays near what it uses.

glibc gives threads that allocate at the same time arenas of their own (up to eight per
core); memory freed into one arena is neither reused by another nor returned to the system
until the top of its heap is free. An agent's downloads, decodes and writes run on several
threads, each allocating frames of 1 to 4 MiB, so with the default its peak RSS drifts far
above what it holds: the restore of a chain of a full and six incrementals at pgbench scale
300 peaked at 292 to 320 MB with the default and 246 to 257 MB with two arenas, in the same
time (docs/BENCHMARKS.md); with one arena it took three times as long (its threads queued on
the one arena's lock).

``MALLOC_ARENA_MAX`` in the environment, which glibc reads itself, takes precedence.
"""

from __future__ import annotations

import ctypes
import os

ARENAS = 2
M_ARENA_MAX = -8  # glibc's mallopt parameter (malloc.h)


def limit_arenas() -> bool:
    """Sets glibc's arena limit before the agent starts its threads; False where the
    operator set ``MALLOC_ARENA_MAX`` or the C library is not glibc (musl has no arenas)."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    libc = ctypes.CDLL(None)  # the process's own symbols, its C library's among them
    if not hasattr(libc, "gnu_get_libc_version"):
        return False  # another C library's mallopt may read -8 as something else
    return bool(libc.mallopt(M_ARENA_MAX, ARENAS))
