"""Extents: the changed byte ranges of a shard's stream, in a compact wire form.

An *extent* is ``(offset, length)`` of a stream, in order, non-overlapping and not adjacent
(adjacent ones are merged). An incremental's agent reports its extents in a task result, so
they are packed small: each extent as two unsigned LEB128 varints (the gap since the previous
extent's end, and the length), the whole zlib-compressed and base64-encoded. When they still
exceed the budget they are *coarsened*: extents closer than a gap are joined (the gap doubling
until they fit). A coarsened set covers every changed byte and some unchanged ones: an
incremental stays correct and uploads a little more.
"""

from __future__ import annotations

import base64
import zlib
from collections.abc import Iterator

Extent = tuple[int, int]
FIRST_GAP = 8192


def _put_varint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _varints(data: bytes) -> Iterator[int]:
    value = shift = 0
    for byte in data:
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            yield value
            value = shift = 0
    if shift:
        raise ValueError("extents end inside a number")


def pack_extents(extents: list[Extent]) -> str:
    raw, end = bytearray(), 0
    for offset, length in extents:
        if offset < end or length <= 0:
            raise ValueError(f"extent ({offset}, {length}) is out of order or empty")
        _put_varint(raw, offset - end)
        _put_varint(raw, length)
        end = offset + length
    return base64.b64encode(zlib.compress(bytes(raw), 6)).decode("ascii")


def varint_bytes(packed: str) -> bytes:
    """The varints of packed extents or numbers, unwrapped (for a decoder of its own, such as
    the restoring node's over arrays)."""
    return zlib.decompress(base64.b64decode(packed))


def unpack_extents(packed: str) -> list[Extent]:
    numbers = list(_varints(varint_bytes(packed)))
    if len(numbers) % 2:
        raise ValueError("extents hold an odd count of numbers")
    extents, end = [], 0
    for gap, length in zip(numbers[::2], numbers[1::2], strict=True):
        extents.append((end + gap, length))
        end += gap + length
    return extents


def pack_numbers(numbers: list[int]) -> str:
    """Non-negative integers, packed like extents (varints, zlib, base64)."""
    raw = bytearray()
    for number in numbers:
        _put_varint(raw, number)
    return base64.b64encode(zlib.compress(bytes(raw), 6)).decode("ascii")


def unpack_numbers(packed: str) -> list[int]:
    return list(_varints(varint_bytes(packed)))


def coarsen(extents: list[Extent], gap: int) -> list[Extent]:
    """Joins extents less than ``gap`` bytes apart."""
    joined: list[Extent] = []
    for offset, length in extents:
        if joined and offset - (joined[-1][0] + joined[-1][1]) < gap:
            start = joined[-1][0]
            joined[-1] = (start, offset + length - start)
        else:
            joined.append((offset, length))
    return joined


def pack_within(extents: list[Extent], budget: int) -> tuple[str, list[Extent]]:
    """The packed extents within ``budget`` characters, coarsened as far as needed; returns
    them and the extents they hold (what the backup must then send)."""
    gap = FIRST_GAP
    while True:
        packed = pack_extents(extents)
        if len(packed) <= budget or len(extents) <= 1:
            return packed, extents
        extents = coarsen(extents, gap)
        gap *= 2
