"""Resolving a chain: every byte of the newest backup's stream from the newest member that
changed it, matched by file, never by stream offset."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import NamedTuple

import pytest
from shardvault_agent.restore import chain_placement
from shardvault_agent.restore.chain_placement import extent_columns, place_chain

from shardvault.contracts.extents import pack_extents, unpack_extents
from shardvault.contracts.models import FileEntry, pack_files
from shardvault.errors import ParentUnavailable

B = 8192


@dataclass(frozen=True)
class Member:
    """A member as these tests write it: a listing, and its extents as pairs."""

    backup_id: str
    files: list[FileEntry]
    extents: list[tuple[int, int]] | None


class Piece(NamedTuple):
    backup_id: str
    delta_offset: int
    length: int
    target: int


def resolve(chain: list[Member], layered: bool = False) -> list[Piece]:
    """The chain's pieces (``chain_placement.resolve_chain``) as tuples."""
    members = [chain_placement.Member.of(m.backup_id, m.files, m.extents) for m in chain]
    pieces = chain_placement.resolve_chain(members, layered).pieces
    ids = [m.backup_id for m in chain]
    columns = (column.tolist() for column in pieces)
    return [Piece(ids[m], d, n, t) for m, d, n, t in zip(*columns, strict=True)]


def files(**sizes: int) -> list[FileEntry]:
    return [FileEntry(path=p, size=s) for p, s in sizes.items()]


def rebuild(
    chain: list[Member], contents: dict[str, dict[str, bytes]], layered: bool = False
) -> bytes:
    """What a restore writes: each piece's bytes from its member's delta stream, in any order
    (the download map's), except that ``layered`` lays the root's pieces under all others (a
    node patches the newer blocks into the root's frames)."""
    newest = chain[-1]
    out = bytearray(sum(f.size for f in newest.files))
    pieces = resolve(chain, layered)
    random.Random(len(pieces)).shuffle(pieces)
    if layered:
        pieces.sort(key=lambda p: p.backup_id != chain[0].backup_id)  # stable: root under
    for piece in pieces:
        member = next(m for m in chain if m.backup_id == piece.backup_id)
        stream = b"".join(contents[member.backup_id][f.path] for f in member.files)
        extents = member.extents if member.extents is not None else [(0, len(stream))]
        delta = b"".join(stream[o : o + n] for o, n in extents)
        out[piece.target : piece.target + piece.length] = delta[
            piece.delta_offset : piece.delta_offset + piece.length
        ]
    return bytes(out)


def test_a_full_alone_is_its_whole_stream():
    chain = [Member("full", files(a=3 * B, b=B), None)]
    assert resolve(chain) == [Piece("full", 0, 4 * B, 0)]


def test_changed_grown_new_and_dropped_files_come_from_the_right_member():
    a0, b0, gone = os.urandom(4 * B), os.urandom(2 * B), os.urandom(B)
    full = Member("full", files(a=4 * B, gone=B, b=2 * B), None)
    a1 = a0[:B] + os.urandom(B) + a0[2 * B :] + os.urandom(B)  # block 1 changed, one block more
    new = os.urandom(B + 100)
    # i1's stream: a (5 blocks), b (2), new; its extents in its own stream coordinates.
    i1 = Member("i1", files(a=5 * B, b=2 * B, new=B + 100), [(B, B), (4 * B, B), (7 * B, B + 100)])
    b2 = b0[:B] + os.urandom(B)
    i2 = Member("i2", files(a=5 * B, b=2 * B, new=B + 100), [(6 * B, B)])  # b's block 1
    contents = {
        "full": {"a": a0, "gone": gone, "b": b0},
        "i1": {"a": a1, "b": b0, "new": new},
        "i2": {"a": a1, "b": b2, "new": new},
    }
    chain = [full, i1, i2]
    assert rebuild(chain, contents) == a1 + b2 + new
    pieces = resolve(chain)
    assert {p.backup_id for p in pieces} == {"full", "i1", "i2"}
    assert sum(p.length for p in pieces) == 7 * B + B + 100


def test_a_file_cut_short_keeps_only_what_remains():
    a0 = os.urandom(4 * B)
    full = Member("full", files(a=4 * B), None)
    i1 = Member("i1", files(a=2 * B + 10), [(2 * B, 10)])  # cut mid-block: that block changed
    a1 = a0[: 2 * B] + os.urandom(10)
    assert rebuild([full, i1], {"full": {"a": a0}, "i1": {"a": a1}}) == a1


def test_a_byte_no_member_holds_is_named():
    broken = [Member("i1", files(a=2 * B), [(0, B)])]  # no full at the root
    with pytest.raises(ParentUnavailable, match="no backup of its chain"):
        resolve(broken)


def test_random_chains_rebuild_the_newest_stream_exactly():
    """Chains made the way agents make them (block hashes against the parent's, per file)."""
    import random

    from shardvault_agent.backup.blockmap import changes, hash_blocks, merge_extents

    rng = random.Random(7)
    for _ in range(30):
        state = {f"f{i}": os.urandom(rng.randrange(0, 6 * B)) for i in range(4)}
        chain, contents, previous = [], {}, None
        for depth in range(rng.randrange(1, 7)):
            backup_id = f"b{depth}"
            names = sorted(state)
            extents, offset = [], 0
            for name in names:
                data = state[name]
                parent = hash_blocks(previous[name], B) if previous and name in previous else None
                extents += [
                    (offset + o, n) for o, n in changes(hash_blocks(data, B), parent, len(data), B)
                ]
                offset += len(data)
            listing = [FileEntry(path=n, size=len(state[n])) for n in names]
            chain.append(
                Member(backup_id, listing, None if previous is None else merge_extents(extents))
            )
            contents[backup_id] = dict(state)
            previous = dict(state)
            for name in list(state):  # the next day's changes
                roll = rng.random()
                data = bytearray(state[name])
                if roll < 0.1:
                    del state[name]
                    continue
                if roll < 0.3 and data:
                    data[rng.randrange(len(data))] ^= 0xFF
                elif roll < 0.4:
                    data += os.urandom(rng.randrange(1, 2 * B))
                elif roll < 0.5:
                    del data[rng.randrange(len(data) + 1) :]
                state[name] = bytes(data)
            if rng.random() < 0.3:
                state[f"n{depth}"] = os.urandom(rng.randrange(1, 3 * B))
        newest = chain[-1]
        assert rebuild(chain, contents) == b"".join(
            contents[newest.backup_id][f.path] for f in newest.files
        )


def changed_extents(before: dict[str, bytes], after: dict[str, bytes]) -> list[tuple[int, int]]:
    """The stream ranges of ``after`` (files in its order) whose bytes differ from ``before``'s
    at the same file and offset, as a scan reports them: merged, in stream order."""
    extents: list[tuple[int, int]] = []
    at = 0
    for path, data in after.items():
        old = before.get(path, b"")
        for i, byte in enumerate(data):
            if i >= len(old) or old[i] != byte:
                if extents and extents[-1][0] + extents[-1][1] == at + i:
                    extents[-1] = (extents[-1][0], extents[-1][1] + 1)
                else:
                    extents.append((at + i, 1))
        at += len(data)
    return extents


def random_chain(seed: int) -> tuple[list[Member], dict[str, dict[str, bytes]]]:
    """Files grow, shrink, vanish and appear, bytes change anywhere."""
    rng = random.Random(seed)
    state = {f"f{i}": rng.randbytes(rng.randrange(0, 60)) for i in range(rng.randrange(1, 6))}
    contents = {"m0": dict(state)}
    chain = [Member("m0", [FileEntry(path=p, size=len(d)) for p, d in state.items()], None)]
    for k in range(1, rng.randrange(2, 8)):
        before, state = state, dict(state)
        for path in list(state):
            roll = rng.random()
            if roll < 0.1:
                del state[path]
            elif roll < 0.3:
                state[path] += rng.randbytes(rng.randrange(1, 20))
            elif roll < 0.4:
                state[path] = state[path][: rng.randrange(0, len(state[path]) + 1)]
            elif state[path] and roll < 0.8:
                data = bytearray(state[path])
                for _ in range(rng.randrange(1, 4)):
                    i = rng.randrange(len(data))
                    data[i : i + rng.randrange(1, 6)] = rng.randbytes(
                        len(data[i : i + rng.randrange(1, 6)])
                    )
                state[path] = bytes(data[: len(state[path])])
        if rng.random() < 0.3:
            state[f"n{k}"] = rng.randbytes(rng.randrange(0, 30))
        contents[f"m{k}"] = dict(state)
        listing = [FileEntry(path=p, size=len(d)) for p, d in state.items()]
        chain.append(Member(f"m{k}", listing, changed_extents(before, state)))
    return chain, contents


@pytest.mark.parametrize("layered", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_any_chain_rebuilds_its_newest_stream(seed: int, layered: bool):
    # Whatever the fast paths of the resolution take, the pieces rebuild the newest backup
    # byte for byte, written in any order (layered: the root's under the others).
    chain, contents = random_chain(seed)
    expected = b"".join(contents[chain[-1].backup_id].values())
    assert rebuild(chain, contents, layered) == expected


def test_a_layered_root_lands_whole_under_the_changed_blocks():
    # The root's pieces are its whole stream, one piece, where an exclusive resolution cuts
    # it around every block a newer member changed; the newer members' pieces are the same.
    base = Member("full", files(a=8 * B), None)
    chain = [
        base,
        Member("i1", files(a=8 * B), [(1 * B, B), (5 * B, B)]),
        Member("i2", files(a=8 * B), [(3 * B, B)]),
    ]
    exclusive, layered = resolve(chain), resolve(chain, layered=True)
    assert [p for p in layered if p.backup_id == "full"] == [Piece("full", 0, 8 * B, 0)]
    assert len([p for p in exclusive if p.backup_id == "full"]) == 4
    assert [p for p in layered if p.backup_id != "full"] == [
        p for p in exclusive if p.backup_id != "full"
    ]


def delta_stream(member: Member, contents: dict[str, dict[str, bytes]]) -> bytes:
    stream = b"".join(contents[member.backup_id][f.path] for f in member.files)
    extents = member.extents if member.extents is not None else [(0, len(stream))]
    return b"".join(stream[o : o + n] for o, n in extents)


def as_args(member: Member, objects: list[dict[str, int | str]]) -> dict[str, object]:
    """A member as the restore's prepare step sends it (``chains.chain_args``)."""
    return {
        "backup_id": member.backup_id,
        "files": pack_files(member.files),
        "extents": None if member.extents is None else pack_extents(member.extents),
        "objects": objects,
    }


@pytest.mark.parametrize("layered", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_a_node_places_any_chain_through_its_objects_frames(seed: int, layered: bool):
    # What a node does at prepare (place_chain): each member's delta stream is cut into
    # objects and frames as a backup stores it; the placements of each object's frames
    # rebuild the newest stream byte for byte, and name no frame an object does not have.
    # Layered, the newer members' placements are written first, in any order, then the
    # root's frames with the patches laid in: no byte is written twice.
    chain, contents = random_chain(seed)
    rng = random.Random(seed)
    args, objects = [], {}
    for member in chain:
        delta, cut, own = delta_stream(member, contents), 0, []
        while cut < len(delta):
            length = min(len(delta) - cut, rng.randrange(1, 40))
            key = f"{member.backup_id}/{len(own)}"
            frame_size = rng.choice([1, 3, 8])
            own.append(
                {"key": key, "stream_offset": cut, "length": length, "frame_size": frame_size}
            )
            objects[key] = delta[cut : cut + length]
            cut += length
        args.append(as_args(member, own))
    newest = b"".join(contents[chain[-1].backup_id].values())
    out = bytearray(len(newest))
    written = [0] * len(newest)
    sizes = {o["key"]: o["frame_size"] for a in args for o in a["objects"]}
    chain_placed = place_chain(args, layered)
    # Each object supplies the bytes no newer member overwrites: together, the stream once.
    assert sum(chain_placed.supplied.values()) == len(newest)
    if not layered:
        assert chain_placed.patches == {}

    def pieces(numbers: list[int], key: str):
        for i in range(0, len(numbers), 4):
            frame, offset, length, target = numbers[i : i + 4]
            assert offset + length <= sizes[key]  # within its frame
            start = frame * sizes[key] + offset
            assert start + length <= len(objects[key])
            yield objects[key][start : start + length], target

    root = f"{chain[0].backup_id}/"
    placed = list(chain_placed.placements.items())
    rng.shuffle(placed)  # the download map's order; layered: the newer members' objects first
    if layered:
        placed.sort(key=lambda kv: kv[0].startswith(root))
    patches = [
        (data, target)
        for key, numbers in chain_placed.patches.items()
        for data, target in pieces(numbers, key)
    ]
    assert all(not key.startswith(root) for key in chain_placed.patches)
    patched = [0] * len(newest)
    for key, numbers in placed:
        for data, target in pieces(numbers, key):
            buffer = bytearray(data)
            if key.startswith(root):  # the root's frame, its patches laid in before its write
                for patch, at in patches:
                    lo, hi = max(at, target), min(at + len(patch), target + len(data))
                    if lo >= hi:
                        continue
                    buffer[lo - target : hi - target] = patch[lo - at : hi - at]
                    for i in range(lo, hi):
                        patched[i] += 1
            out[target : target + len(data)] = buffer
            for i in range(target, target + len(data)):
                written[i] += 1
    assert sum(patched) == sum(len(patch) for patch, _ in patches)  # each laid in, once
    assert bytes(out) == newest
    assert set(written) <= {1}  # every byte written once: a patch lies where the root writes


def test_a_byte_in_none_of_its_members_objects_is_named_before_anything_is_placed():
    # A member's objects that leave a hole in its delta stream: the chain's manifests disagree.
    full = Member("full", files(a=4 * B), None)
    i1 = Member("i1", files(a=4 * B), [(B, 2 * B)])
    args = [
        as_args(full, [{"key": "full/0", "stream_offset": 0, "length": 4 * B, "frame_size": B}]),
        as_args(
            i1,
            [
                {"key": "i1/0", "stream_offset": 0, "length": B // 2, "frame_size": B},
                {"key": "i1/1", "stream_offset": B, "length": B, "frame_size": B},
            ],
        ),
    ]
    for layered in (False, True):
        with pytest.raises(ParentUnavailable, match=f"byte {B // 2} of backup i1's changes"):
            place_chain(args, layered)


@pytest.mark.parametrize("seed", range(20))
def test_packed_extents_decode_at_once_as_the_reference_decoder_does(seed: int):
    rng = random.Random(seed)
    extents, at = [], 0
    for _ in range(rng.randrange(0, 200)):
        at += rng.choice([0, 1, 127, 128, 70_000, 2**40]) + (1 if extents else 0)
        length = rng.choice([1, 127, 128, B, 2**33, 2**56])
        extents.append((at, length))
        at += length
    offsets, lengths = extent_columns(pack_extents(extents))
    expected = unpack_extents(pack_extents(extents))
    assert list(zip(offsets.tolist(), lengths.tolist(), strict=True)) == expected == extents


def test_packed_extents_cut_short_or_odd_are_refused():
    import base64
    import zlib

    def packed(raw: bytes) -> str:
        return base64.b64encode(zlib.compress(raw)).decode()

    with pytest.raises(ValueError, match="inside a number"):
        extent_columns(packed(b"\x05\x85"))
    with pytest.raises(ValueError, match="odd count"):
        extent_columns(packed(b"\x05\x06\x07"))
    with pytest.raises(ValueError, match="too large"):
        extent_columns(packed(b"\x01" + b"\xff" * 9 + b"\x01"))


def test_a_member_whose_objects_stop_short_or_hold_nothing_is_named_at_its_first_missing_byte():
    full = Member("full", files(a=100), None)
    short = [as_args(full, [{"key": "f/0", "stream_offset": 0, "length": 50, "frame_size": 8}])]
    empty = [as_args(full, [{"key": "f/0", "stream_offset": 0, "length": 0, "frame_size": 8}])]
    for layered in (False, True):
        with pytest.raises(ParentUnavailable, match="byte 50 of backup full's changes"):
            place_chain(short, layered)
        with pytest.raises(ParentUnavailable, match="byte 0 of backup full's changes"):
            place_chain(empty, layered)
