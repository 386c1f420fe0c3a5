"""The overlay of a layered chain restore: a root's piece is written once, with the newer
members' blocks (kept stored in spools) laid in where they fall, and a damaged spooled frame
stops the write by name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from shardvault_agent.restore.objects import ObjectRecord
from shardvault_agent.restore.overlay import Overlay, save_index, write_vectored

from shardvault.contracts.models import DownloadItem, Phase
from shardvault.data.checksums import crc64nvme
from shardvault.data.pipeline import FrameCodec, FrameInfo, Sealer, frame_place, pack_frames
from shardvault.errors import ChecksumMismatch, FrameUnreadable

FRAME = 64


def spooled(tmp_path: Path, key: str, plain: bytes, sealer: Sealer | None = None) -> Path:
    """A newer member's object of ``plain`` bytes, its frames encoded as a backup stores
    them and spooled whole, with its item beside it."""
    codec, stored, frames = FrameCodec(sealer=sealer), b"", []
    place = f"c/b/{key}"
    for index, at in enumerate(range(0, len(plain), FRAME)):
        encoded = codec.encode(plain[at : at + FRAME], frame_place(place, index))
        stored += encoded
        frames.append(FrameInfo(len(encoded), crc64nvme(plain[at : at + FRAME])))
    spool = tmp_path / f"{key}.spool"
    spool.write_bytes(stored)
    item = DownloadItem(
        restore_id="r", target_cluster="t", node_id="n", shard_id="s", phase=Phase.DATA,
        key=key, stream_offset=0, length=len(plain), part_size=1 << 20, part_count=1,
        crc64nvme="", frame_size=FRAME, frames=pack_frames(frames), place=place,
        key_check=sealer.check if sealer else None, from_chain=True,
    )  # fmt: skip
    spool.with_suffix(".item").write_text(item.model_dump_json())
    return spool


def overlay(tmp_path: Path, patches: dict[str, list[int]], sealer: Sealer | None = None):
    index = tmp_path / "s.patchindex"
    save_index(index, sorted(patches), patches)
    return Overlay(index, lambda key: ObjectRecord(tmp_path / key), lambda item: sealer)


def test_a_root_piece_is_written_once_with_the_newer_blocks_laid_in(tmp_path: Path):
    newer = {"i1": os.urandom(3 * FRAME), "i2": os.urandom(FRAME)}
    for key, plain in newer.items():
        spooled(tmp_path, key, plain)
    # (frame, offset in frame, length, place in the stream): i1's frame 2 bytes 5..14 at 105,
    # its frame 0 bytes 0..63 at 300 (another piece), i2's frame 0 bytes 60..63 at 196.
    layer = overlay(tmp_path, {"i1": [2, 5, 10, 105, 0, 0, 64, 300], "i2": [0, 60, 4, 196]})
    root = os.urandom(200)
    target = tmp_path / "file"
    target.write_bytes(bytes(1000))
    fd = os.open(target, os.O_WRONLY)
    try:
        layer.write(fd, memoryview(root), 500, 100)  # stream 100..299 lands at file offset 500
    finally:
        os.close(fd)
        layer.close()
    expected = bytearray(root)
    expected[5:15] = newer["i1"][2 * FRAME + 5 : 2 * FRAME + 15]
    expected[96:100] = newer["i2"][60:64]
    assert target.read_bytes() == bytes(500) + bytes(expected) + bytes(300)


def test_a_root_piece_no_patch_falls_on_is_written_as_it_is(tmp_path: Path):
    spooled(tmp_path, "i1", os.urandom(FRAME))
    layer = overlay(tmp_path, {"i1": [0, 0, 8, 1000]})
    target = tmp_path / "file"
    target.write_bytes(bytes(64))
    fd = os.open(target, os.O_WRONLY)
    root = os.urandom(64)
    layer.write(fd, memoryview(root), 0, 0)
    os.close(fd)
    layer.close()
    assert target.read_bytes() == root


@pytest.mark.parametrize("sealed", [False, True])
def test_a_damaged_spooled_frame_fails_by_name_before_its_piece_is_written(
    tmp_path: Path, sealed: bool
):
    sealer = Sealer(os.urandom(32)) if sealed else None
    spool = spooled(tmp_path, "i1", os.urandom(2 * FRAME), sealer)
    data = bytearray(spool.read_bytes())
    data[-3] ^= 0x40  # in frame 1
    spool.write_bytes(bytes(data))
    layer = overlay(tmp_path, {"i1": [1, 0, 16, 10]}, sealer)
    target = tmp_path / "file"
    target.write_bytes(bytes(64))
    fd = os.open(target, os.O_WRONLY)
    with pytest.raises(FrameUnreadable if sealed else (ChecksumMismatch, FrameUnreadable)):
        layer.write(fd, memoryview(os.urandom(64)), 0, 0)
    os.close(fd)
    layer.close()
    assert target.read_bytes() == bytes(64)  # nothing of the root's piece written


def test_more_buffers_than_one_call_takes_are_all_written(tmp_path: Path):
    target = tmp_path / "file"
    target.write_bytes(b"")
    pieces = [os.urandom(3) for _ in range(2500)]  # past IOV_MAX (1,024 on Linux)
    fd = os.open(target, os.O_WRONLY)
    write_vectored(fd, [memoryview(p) for p in pieces], 7)
    os.close(fd)
    assert target.read_bytes() == bytes(7) + b"".join(pieces)
