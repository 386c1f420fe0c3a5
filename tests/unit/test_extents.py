"""Extents travel packed, and coarsen to fit a task result without losing a changed byte."""

from __future__ import annotations

import random

import pytest

from shardvault.contracts.extents import coarsen, pack_extents, pack_within, unpack_extents


def scattered(n: int, seed: int = 1) -> list[tuple[int, int]]:
    rng, out, at = random.Random(seed), [], 0
    for _ in range(n):
        at += rng.randrange(1, 200) * 8192
        out.append((at, 8192))
        at += 8192
    return out


def test_extents_round_trip_small() -> None:
    extents = scattered(10_000)
    packed = pack_extents(extents)
    assert unpack_extents(packed) == extents
    assert len(packed) < 40_000  # 10,000 scattered pages: a few bytes each


def test_bad_extents_are_refused() -> None:
    with pytest.raises(ValueError, match="out of order"):
        pack_extents([(10, 5), (12, 5)])
    with pytest.raises(ValueError, match="out of order or empty"):
        pack_extents([(10, 0)])


def covered(extents: list[tuple[int, int]]) -> set[int]:
    return {o // 8192 for o, n in extents for o in range(o, o + n, 8192)}


def test_coarsened_extents_cover_every_changed_byte() -> None:
    extents = scattered(200_000)
    packed, sent = pack_within(extents, 150_000)
    assert len(packed) <= 150_000
    assert unpack_extents(packed) == sent
    assert covered(extents) <= covered(sent)
    assert len(sent) < len(extents)
    assert coarsen([(0, 5), (10, 5), (100, 5)], 6) == [(0, 15), (100, 5)]
