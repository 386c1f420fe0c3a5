"""Which zstd level a frame is compressed at when the policy says ``compression.level: auto``.

A stronger level pays only if the bytes it saves would take longer to upload than the CPU it
costs: on a host whose packs keep every core busy (a full, on a small host: the common case),
each extra CPU-second of compression is ``1 / cores`` of a second of wall time, and each byte
saved is ``1 / upload bandwidth`` of a second. So the strong level wins a stretch of data when

    saved bytes / extra CPU-seconds  >  upload bandwidth / cores

Terms:
- *fast* and *strong*: the two levels compared (``FAST``, ``STRONG``: 1 and 3; zstd's levels
  in between and above cost more CPU for each byte they save on database pages, measured in
  ``bench/compression_levels.py``).
- *probe*: both levels compress the first ``PROBE_BYTES`` of a frame, timed by the thread's
  CPU clock; the rule above, with the slice's sizes and times, picks the level of that frame
  and of the ``PROBE_EVERY - 1`` frames after it (an object's frames are consecutive bytes of
  its files, which change character slowly). A probe costs about one frame's compression at
  the fast level (a quarter of one at each level, the strong one three times as slow), once
  every ``PROBE_EVERY`` frames: about 3 % of the compression's CPU by the levels' rates (an
  estimate, not measured); a frame the probe covers whole takes the probe's output.
- *upload bandwidth*: ``compression.upload_mib_s``, what the node can send the store (the
  policy's declaration: an agent cannot tell its link's capacity from its own uploads, which
  wait on compression when the cores are the limit).

What ``bench/compression_levels.py`` measured: on data nobody tuned for (``--untuned 2.7``)
level 3 stores 1.7 % *more* than level 1 at a third of its speed, so ``auto`` chooses level 1
there; on pgbench data after updates (``--changes 3``) level 3 stores 6 % less of a 20-fold
compressed output (76.3 MiB against 81.0 of 1,567.5 MiB) for 29 % more CPU (1,229 MiB/s a
core against 1,582): about 16 MiB saved per extra CPU-second, worth it only behind a link
slower than about 16 MiB/s per core. At the default 120 MiB/s ``auto`` takes level 1 there too,
and stores those 6 % more.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

FAST, STRONG = 1, 3
PROBE_BYTES = 1024 * 1024  # of a frame (4 MiB at most): both levels compress this much
PROBE_EVERY = 32  # frames: 128 MiB of 4 MiB frames, half an object of the smallest size
MiB = 1024 * 1024

Compress = Callable[[int, bytes], bytes]  # (level, plaintext) -> zstd frame


@dataclass(frozen=True)
class Probe:
    """One slice compressed at both levels: stored sizes and CPU-seconds."""

    fast_size: int
    fast_seconds: float
    strong_size: int
    strong_seconds: float
    outputs: dict[int, bytes] = field(default_factory=dict, compare=False, repr=False)

    def strong_pays(self, bytes_per_core_second: float) -> bool:
        """Whether the strong level's saving outruns the bandwidth one core's compression
        feeds (see the module's rule)."""
        saved = self.fast_size - self.strong_size
        if saved <= 0:
            return False
        extra = self.strong_seconds - self.fast_seconds
        return extra <= 0 or saved / extra > bytes_per_core_second


def probe(compress: Compress, plain: bytes, clock: Callable[[], float] = time.thread_time) -> Probe:
    """Compresses ``plain``'s first ``PROBE_BYTES`` at both levels, each timed by ``clock``
    (the thread's CPU clock: other threads' work does not count)."""
    sample = plain[:PROBE_BYTES]
    timed, outputs = [], {}
    for level in (FAST, STRONG):
        started = clock()
        outputs[level] = compress(level, sample)
        timed.append((len(outputs[level]), clock() - started))
    (fast_size, fast_seconds), (strong_size, strong_seconds) = timed
    return Probe(fast_size, fast_seconds, strong_size, strong_seconds, outputs)


@dataclass
class LevelChooser:
    """The levels of one object's frames, in order (see the module's terms)."""

    upload_mib_s: int
    cores: int
    compress: Compress
    level: int = FAST
    clock: Callable[[], float] = time.thread_time
    # The frame a probe compressed whole (a frame of at most ``PROBE_BYTES``), and the probe's
    # outputs: its encoding takes the chosen level's instead of compressing it a third time.
    _probed: tuple[bytes, dict[int, bytes]] | None = None

    def level_for(self, index: int, plain: bytes) -> int:
        """The level of frame ``index`` (``plain`` its plaintext), probing every
        ``PROBE_EVERY`` frames."""
        if index % PROBE_EVERY == 0 and plain:
            per_core = self.upload_mib_s * MiB / max(self.cores, 1)
            measured = probe(self.compress, plain, self.clock)
            self.level = STRONG if measured.strong_pays(per_core) else FAST
            self._probed = (plain, measured.outputs) if len(plain) <= PROBE_BYTES else None
        return self.level

    def probed_whole(self, plain: bytes) -> bool:
        """Whether the last probe compressed all of ``plain`` (this very frame)."""
        return self._probed is not None and self._probed[0] is plain

    def take_output(self, level: int, plain: bytes) -> bytes | None:
        """The probe's output of ``plain`` at ``level``, once (None: not probed whole)."""
        probed = self._probed
        if probed is None or probed[0] is not plain:
            return None
        self._probed = None
        return probed[1].get(level)


__all__ = ["FAST", "PROBE_BYTES", "PROBE_EVERY", "STRONG", "LevelChooser", "Probe", "probe"]
