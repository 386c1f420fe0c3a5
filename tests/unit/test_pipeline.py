"""The part pipeline round trip: frames, codecs, sealing, part checksums."""

from __future__ import annotations

import io
import os
import threading

import pytest

from shardvault.data.checksums import crc64nvme_of_bytes
from shardvault.data.pipeline import (
    RAW,
    ZSTD,
    FrameCodec,
    FrameSink,
    Sealer,
    SpareCores,
    fetch_ranges,
    frame_spans,
    key_check,
    pack,
    pack_frames,
    plaintext_crc,
    unpack_frames,
)
from shardvault.data.planning import MAX_FRAME_SIZE, MIN_FRAME_SIZE, frame_size_for
from shardvault.errors import ChecksumMismatch, FrameUnreadable, WrongKey

MiB = 1024 * 1024
PLACE = "orders/b1/shard-a/data/00000"


def compressible(n: int) -> bytes:
    row = b"id=%08d balance=0000000000 filler=" + b" " * 60
    return b"".join(row % (i,) for i in range(n // len(row % (0,)) + 1))[:n]


def packed(
    data: bytes,
    codec: FrameCodec,
    frame_size: int = MIN_FRAME_SIZE,
    part: int = 5 * MiB,
    spare: SpareCores | None = None,
):
    out, source = io.BytesIO(), io.BytesIO(data)
    result = pack(source.read, len(data), frame_size, part, codec, out, PLACE, spare)
    return result, out.getvalue()


def unpacked(result, stored: bytes, codec: FrameCodec, length: int, frame_size=MIN_FRAME_SIZE):
    spans = frame_spans(unpack_frames(pack_frames(result.frames)), frame_size, length)
    plain = bytearray(length)

    def write(offset: int, data: bytes) -> None:
        plain[offset : offset + len(data)] = data

    for group in fetch_ranges(spans, 3 * MiB):
        sink = FrameSink(group, codec, PLACE, write)
        start = group[0].stored_offset
        end = group[-1].stored_offset + group[-1].stored_size
        for at in range(start, end, 65536):  # arrives in chunks, as from the network
            sink.receive(at - start, stored[at : min(end, at + 65536)])
        assert sink.complete
    return bytes(plain), spans


@pytest.mark.parametrize(
    ("data", "codec_byte"),
    [
        (compressible(5 * MiB + 123), ZSTD),
        (os.urandom(3 * MiB + 7), RAW),
        (b"\0" * 100, ZSTD),
    ],
    ids=["compressible", "incompressible", "small"],
)
def test_round_trip_restores_every_byte(data: bytes, codec_byte: int) -> None:
    codec = FrameCodec(3)
    result, stored = packed(data, codec)
    assert stored[0] == codec_byte
    plain, spans = unpacked(result, stored, codec, len(data))
    assert plain == data
    assert plaintext_crc(spans) == crc64nvme_of_bytes(data)
    assert result.stored_length == len(stored)
    assert result.crc64nvme == crc64nvme_of_bytes(stored)


def test_compression_shrinks_and_incompressible_data_does_not_grow() -> None:
    codec = FrameCodec(3)
    text, _ = packed(compressible(4 * MiB), codec)
    noise, _ = packed(os.urandom(4 * MiB), codec)
    assert text.stored_length < 4 * MiB / 10
    assert noise.stored_length == 4 * MiB + len(noise.frames)  # one codec byte per frame


def test_parts_cut_the_stored_bytes_at_the_part_size() -> None:
    data = os.urandom(12 * MiB)  # stored raw: 12 MiB + 12 codec bytes
    result, stored = packed(data, FrameCodec(), part=5 * MiB)
    assert [p.size for p in result.parts] == [5 * MiB, 5 * MiB, len(stored) - 10 * MiB]
    assert [p.crc64nvme for p in result.parts] == [
        crc64nvme_of_bytes(stored[i : i + 5 * MiB]) for i in range(0, len(stored), 5 * MiB)
    ]


def test_empty_stream_packs_to_nothing() -> None:
    result, stored = packed(b"", FrameCodec())
    assert (result.frames, stored, result.stored_length) == ([], b"", 0)
    assert [p.size for p in result.parts] == [0]


def test_frame_size_grows_with_objects_between_bounds() -> None:
    assert frame_size_for(256 * MiB) == MIN_FRAME_SIZE
    assert frame_size_for(16 * 1024 * MiB) == MAX_FRAME_SIZE
    assert frame_size_for(8 * 1024 * MiB) == 2 * MiB


def test_sealed_frames_hide_plaintext_and_round_trip() -> None:
    key = os.urandom(32)
    data = compressible(2 * MiB)
    codec = FrameCodec(sealer=Sealer(key))
    result, stored = packed(data, codec)
    assert b"balance=0000000000" not in stored
    plain, _ = unpacked(result, stored, FrameCodec(sealer=Sealer(key)), len(data))
    assert plain == data


def test_a_wrong_key_fails_by_name() -> None:
    data = compressible(MiB)
    result, stored = packed(data, FrameCodec(sealer=Sealer(os.urandom(32))))
    with pytest.raises(FrameUnreadable, match="fails authentication"):
        unpacked(result, stored, FrameCodec(sealer=Sealer(os.urandom(32))), len(data))


def test_a_key_check_tells_keys_apart() -> None:
    key = os.urandom(32)
    assert key_check(key) == Sealer(key).check != key_check(os.urandom(32))
    with pytest.raises(WrongKey):
        Sealer(b"short")


def test_a_flipped_ciphertext_bit_fails_by_name() -> None:
    key, data = os.urandom(32), compressible(MiB)
    result, stored = packed(data, FrameCodec(sealer=Sealer(key)))
    damaged = bytearray(stored)
    damaged[40] ^= 0x01
    with pytest.raises(FrameUnreadable):
        unpacked(result, bytes(damaged), FrameCodec(sealer=Sealer(key)), len(data))


def test_a_frame_moved_to_another_place_fails_to_open() -> None:
    key, data = os.urandom(32), compressible(2 * MiB)
    result, stored = packed(data, FrameCodec(sealer=Sealer(key)))
    first, second = result.frames
    swapped = stored[first.stored_size :] + stored[: first.stored_size]
    result.frames[:] = [second, first]
    with pytest.raises(FrameUnreadable):
        unpacked(result, swapped, FrameCodec(sealer=Sealer(key)), len(data))


def test_damaged_plaintext_of_an_unsealed_frame_fails_its_checksum() -> None:
    data = os.urandom(MiB)  # stored raw: a flipped bit survives decoding
    result, stored = packed(data, FrameCodec())
    damaged = bytearray(stored)
    damaged[1000] ^= 0x80
    with pytest.raises(ChecksumMismatch, match="frame 0"):
        unpacked(result, bytes(damaged), FrameCodec(), len(data))


def test_damaged_compressed_frame_fails_by_name() -> None:
    data = compressible(MiB)
    result, stored = packed(data, FrameCodec())
    damaged = bytearray(stored)
    damaged[20:40] = b"\xff" * 20
    with pytest.raises((FrameUnreadable, ChecksumMismatch)):
        unpacked(result, bytes(damaged), FrameCodec(), len(data))


def test_a_retried_read_starts_the_frames_again() -> None:
    data = compressible(3 * MiB)
    codec = FrameCodec()
    result, stored = packed(data, codec)
    spans = frame_spans(result.frames, MIN_FRAME_SIZE, len(data))
    writes: list[int] = []
    sink = FrameSink(spans, codec, PLACE, lambda offset, plain: writes.append(offset))
    sink.receive(0, stored[: spans[1].stored_offset + 10])  # the connection breaks mid-frame
    sink.receive(0, stored)  # the retry sends the range again from its start
    assert sink.complete
    assert writes == [0, 0, MiB, 2 * MiB]


@pytest.mark.parametrize("size", [0, MiB // 3, 7 * MiB + 5, 12 * MiB])
def test_a_pack_on_spare_cores_stores_the_same_bytes(size: int) -> None:
    data = compressible(size // 2) + os.urandom(size - size // 2)  # frames raw and compressed
    alone, alone_stored = packed(data, FrameCodec())
    helped, helped_stored = packed(data, FrameCodec(), spare=SpareCores(cores=4))
    assert helped_stored == alone_stored
    assert (helped.frames, helped.parts, helped.crc64nvme) == (
        alone.frames,
        alone.parts,
        alone.crc64nvme,
    )


def test_sealed_frames_encoded_on_spare_cores_open_in_their_places() -> None:
    key, data = os.urandom(32), compressible(9 * MiB)
    result, stored = packed(data, FrameCodec(sealer=Sealer(key)), spare=SpareCores(cores=3))
    plain, _ = unpacked(result, stored, FrameCodec(sealer=Sealer(key)), len(data))
    assert plain == data


def test_frames_go_to_helpers_only_while_a_core_is_idle() -> None:
    spare, codec = SpareCores(cores=2), FrameCodec()
    with spare.packing():  # one pack on two cores: one idle
        handed = spare.encode(codec, b"x" * 1000, b"place", 1)
        assert handed is not None
        assert handed.result().stored == codec.encode(b"x" * 1000, b"place")
        with spare.packing():  # two packs: none idle
            assert spare.encode(codec, b"y", b"place", 1) is None
        again = spare.encode(codec, b"z" * 1000, b"place", 1)  # one idle again
        assert again is not None
        again.result()


def test_a_core_other_processes_keep_busy_is_not_borrowed() -> None:
    # One pack on two cores, the database on the other one: nothing is idle to borrow.
    busy = {"others": 1.0}
    spare, codec = SpareCores(cores=2, others=lambda: busy["others"]), FrameCodec()
    with spare.packing():
        assert spare.encode(codec, b"x", b"place", 1) is None
        busy["others"] = 0.4  # the database idles more than half a core: one is idle
        handed = spare.encode(codec, b"y" * 1000, b"place", 1)
        assert handed is not None
        assert handed.result().stored == codec.encode(b"y" * 1000, b"place")


def test_no_more_frames_are_handed_out_than_the_most_whatever_the_cores() -> None:
    spare, codec = SpareCores(cores=16, most=2), FrameCodec()
    hold = threading.Event()
    held = [spare._pool.submit(hold.wait) for _ in range(spare.most)]  # both helpers busy
    with spare.packing():
        handed = [spare.encode(codec, b"a" * 5000, b"place", 1) for _ in range(3)]
        assert handed[0] is not None
        assert handed[1] is not None
        assert handed[2] is None  # two are out, queued: the third is the caller's
        hold.set()
        assert [f.result().stored for f in handed[:2]] == [codec.encode(b"a" * 5000, b"place")] * 2
        assert spare.encode(codec, b"b", b"place", 1) is not None  # back under the most
    assert all(h.result() for h in held)
