"""``compression.level: auto``: the strong level only where its saving outruns the upload."""

from __future__ import annotations

import io
import os
import random

import pytest

from shardvault.contracts.models import Compression
from shardvault.data.levels import FAST, PROBE_BYTES, PROBE_EVERY, STRONG, LevelChooser, Probe
from shardvault.data.pipeline import FrameCodec, FrameSink, frame_spans, pack
from shardvault.data.planning import MIN_FRAME_SIZE

MiB = 1024 * 1024
PLACE = "orders/b1/shard-a/data/00000"


@pytest.mark.parametrize(
    ("probe", "bandwidth_per_core", "strong"),
    [
        (Probe(100, 0.01, 102, 0.03), 1.0, False),  # strong stores more: never
        (Probe(100, 0.01, 100, 0.03), 1.0, False),  # saves nothing
        (Probe(1000, 0.01, 900, 0.03), 10_000.0, False),  # 5,000 B/CPU-s saved < 10,000 B/s
        (Probe(1000, 0.01, 900, 0.03), 1_000.0, True),  # a slow link: the saving pays
        (Probe(1000, 0.03, 900, 0.02), 1e12, True),  # smaller and no slower: always
    ],
)
def test_the_strong_level_pays_only_if_its_saving_outruns_the_bandwidth(
    probe: Probe, bandwidth_per_core: float, strong: bool
) -> None:
    assert probe.strong_pays(bandwidth_per_core) is strong


class Measured:
    """A compressor and CPU clock with chosen sizes and costs per level."""

    def __init__(self, sizes: dict[int, int], seconds: dict[int, float]) -> None:
        self.sizes, self.seconds, self.now, self.calls = sizes, seconds, 0.0, 0

    def clock(self) -> float:
        return self.now

    def compress(self, level: int, plain: bytes) -> bytes:
        self.calls += 1
        self.now += self.seconds[level]
        return b"z" * self.sizes[level]


def test_the_chooser_probes_the_first_frame_and_every_stretch_after() -> None:
    # Level 3 saves 100 KiB of a 1 MiB probe for 10 ms more: 10 MiB per CPU-second saved.
    measured = Measured({FAST: 500 * 1024, STRONG: 400 * 1024}, {FAST: 0.005, STRONG: 0.015})
    slow_link = LevelChooser(8, 2, measured.compress, clock=measured.clock)  # 4 MiB/s a core
    frame = b"f" * PROBE_BYTES
    levels = [slow_link.level_for(i, frame) for i in range(2 * PROBE_EVERY + 1)]
    assert levels == [STRONG] * len(levels)
    assert measured.calls == 2 * 3  # two levels at frames 0, PROBE_EVERY and 2 * PROBE_EVERY

    fast_link = LevelChooser(100, 2, measured.compress, clock=measured.clock)  # 50 MiB/s a core
    assert fast_link.level_for(0, frame) == FAST


def test_the_chooser_follows_the_data_as_it_changes() -> None:
    measured = Measured({FAST: 500_000, STRONG: 100_000}, {FAST: 0.001, STRONG: 0.002})
    chooser = LevelChooser(1, 1, measured.compress, clock=measured.clock)
    assert chooser.level_for(0, b"text") == STRONG
    measured.sizes[STRONG] = 510_000  # the next file: level 3 no longer helps
    assert chooser.level_for(1, b"more") == STRONG  # the stretch keeps its level...
    assert chooser.level_for(PROBE_EVERY, b"next") == FAST  # ...until the next probe


def round_trip(data: bytes, codec: FrameCodec) -> tuple[bytes, dict[int, int], float]:
    out = io.BytesIO()
    packed = pack(io.BytesIO(data).read, len(data), MIN_FRAME_SIZE, 8 * MiB, codec, out, PLACE)
    plain = bytearray(len(data))

    def write(offset: int, chunk: bytes) -> None:
        plain[offset : offset + len(chunk)] = chunk

    spans = frame_spans(packed.frames, MIN_FRAME_SIZE, len(data))
    sink = FrameSink(spans, FrameCodec(), PLACE, write)
    sink.receive(0, out.getvalue())
    assert sink.complete
    return bytes(plain), dict(packed.levels), packed.cpu_seconds


def words(n: int) -> bytes:
    """Words drawn from a vocabulary: text a stronger level finds more in (level 3 stores
    about 10 % less than level 1; on many tables it stores more)."""
    rng = random.Random(1)
    vocabulary = [rng.randbytes(rng.randint(2, 8)).hex().encode() for _ in range(3000)]
    return b" ".join(rng.choice(vocabulary) for _ in range(n // 6))[:n]


def test_auto_packs_each_frame_at_its_chosen_level_and_every_frame_reads_back() -> None:
    data = words(4 * MIN_FRAME_SIZE)
    slow = FrameCodec(Compression(level="auto", upload_mib_s=1), cores=1)
    plain, levels, cpu = round_trip(data, slow)
    assert plain == data
    assert levels == {STRONG: 4}
    assert cpu > 0

    fast = FrameCodec(Compression(level="auto", upload_mib_s=100_000), cores=1)
    plain, levels, _ = round_trip(data, fast)
    assert plain == data
    assert levels == {FAST: 4}


def test_auto_does_not_spend_the_strong_level_on_random_text() -> None:
    # Hex digits of random bytes (data nobody tuned for): level 3 stores no less than 1.
    data = os.urandom(2 * MIN_FRAME_SIZE).hex().encode()[: 4 * MIN_FRAME_SIZE]
    codec = FrameCodec(Compression(level="auto", upload_mib_s=1), cores=1)
    plain, levels, _ = round_trip(data, codec)
    assert plain == data
    assert levels == {FAST: 4}


def test_a_fixed_level_is_kept_for_every_frame() -> None:
    data = words(3 * MIN_FRAME_SIZE)
    _, levels, _ = round_trip(data, FrameCodec(Compression(level=9)))
    assert levels == {9: 3}


def test_a_frame_the_probe_compressed_whole_is_not_compressed_again() -> None:
    codec = FrameCodec(Compression(level="auto", upload_mib_s=1), cores=1)
    calls: list[int] = []
    compress = codec.compress

    def counting(level: int, plain: bytes) -> bytes:
        calls.append(level)
        return compress(level, plain)

    codec.compress = counting  # type: ignore[method-assign]
    codec.chooser.compress = counting  # type: ignore[union-attr]
    data = words(2 * MIN_FRAME_SIZE)  # 1 MiB frames: the probe covers a frame whole
    plain, levels, _ = round_trip(data, codec)
    assert plain == data
    assert levels == {STRONG: 2}
    assert calls == [FAST, STRONG, STRONG]  # frame 0: the probe's two; frame 1 at its level
