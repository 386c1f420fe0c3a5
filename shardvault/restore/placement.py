"""Placement: which target node restores which shard of a backup. Pure and deterministic.

Terms:
- *need*: the room a shard takes on a node: its bytes plus a safety margin (``need``).
- *room*: what a node offers, ``restore_free_bytes`` from its agent's heartbeat.
- *pin*: a shard the request places on a named node.

A backup of a mixed cluster (nodes of several engines, as its policy allows) is placed engine
by engine: each shard on a target node of its own engine (``place_by_engine``).

Pins are placed first; the other shards go largest first, each to the node with the fewest
bytes placed so far among those where it fits (ties: fewer shards, then node id), so the
result balances bytes and is the same for the same input. Several shards may share a node;
a node may get none (a restore into more nodes than shards).
"""

from __future__ import annotations

from collections.abc import Mapping

from shardvault.contracts.models import NodeAssignment, ShardPlacement
from shardvault.errors import InvalidRequest, TargetTooSmall

MARGIN = 0.10  # beyond the shard's bytes: the engine's own growth while it starts (WAL, temp)
MARGIN_BYTES = 16 * 1024 * 1024
GiB = 1024**3


def need(shard_bytes: int) -> int:
    return shard_bytes + int(shard_bytes * MARGIN) + MARGIN_BYTES


def place(
    shards: Mapping[str, int], room: Mapping[str, int], pins: Mapping[str, str] | None = None
) -> list[ShardPlacement]:
    """Places every shard (id -> bytes) on a node (id -> room); raises ``TargetTooSmall``."""
    pins = dict(pins or {})
    check_pins(shards, room, pins)
    placed: dict[str, int] = dict.fromkeys(room, 0)
    count: dict[str, int] = dict.fromkeys(room, 0)
    out: list[ShardPlacement] = []

    def put(shard_id: str, node_id: str) -> None:
        placed[node_id] += need(shards[shard_id])
        count[node_id] += 1
        out.append(ShardPlacement(shard_id=shard_id, node_id=node_id, bytes=shards[shard_id]))

    for shard_id, node_id in sorted(pins.items()):
        if placed[node_id] + need(shards[shard_id]) > room[node_id]:
            raise too_small(shard_id, shards[shard_id], {node_id: room[node_id] - placed[node_id]})
        put(shard_id, node_id)
    for shard_id in sorted((s for s in shards if s not in pins), key=lambda s: (-shards[s], s)):
        fits = [n for n in room if placed[n] + need(shards[shard_id]) <= room[n]]
        if not fits:
            raise too_small(shard_id, shards[shard_id], {n: room[n] - placed[n] for n in room})
        put(shard_id, min(fits, key=lambda n: (placed[n], count[n], n)))
    return sorted(out, key=lambda p: p.shard_id)


def place_by_engine(
    shards: Mapping[str, int],
    room: Mapping[str, int],
    pins: Mapping[str, str] | None,
    shard_engine: Mapping[str, str],
    node_engine: Mapping[str, str],
) -> list[ShardPlacement]:
    """``place``, each engine's shards on the nodes of that engine (every engine of the shards
    must have a node: the caller checks that by name)."""
    pins = dict(pins or {})
    check_pins(shards, room, pins)
    if crossed := sorted(s for s, n in pins.items() if shard_engine[s] != node_engine[n]):
        raise InvalidRequest(
            "placement pins shards to nodes of another engine: "
            + ", ".join(
                f"{s} ({shard_engine[s]}) on {pins[s]} ({node_engine[pins[s]]})" for s in crossed
            )
            + ".",
            fix="pin each shard to a target node of its own engine.",
        )
    out: list[ShardPlacement] = []
    for engine in sorted(set(shard_engine.values())):
        group = {s: size for s, size in shards.items() if shard_engine[s] == engine}
        nodes = {n: left for n, left in room.items() if node_engine[n] == engine}
        out += place(group, nodes, {s: n for s, n in pins.items() if s in group})
    return sorted(out, key=lambda p: p.shard_id)


def assignments(placements: list[ShardPlacement]) -> list[NodeAssignment]:
    """The placements grouped by node (nodes that restore nothing are left out)."""
    by_node: dict[str, list[ShardPlacement]] = {}
    for p in placements:
        by_node.setdefault(p.node_id, []).append(p)
    return [
        NodeAssignment(
            node_id=node_id,
            shard_ids=[p.shard_id for p in group],
            bytes=sum(p.bytes for p in group),
        )
        for node_id, group in sorted(by_node.items())
    ]


def check_pins(shards: Mapping[str, int], room: Mapping[str, int], pins: Mapping[str, str]) -> None:
    if unknown := sorted(set(pins) - set(shards)):
        raise InvalidRequest(
            f"placement names shards the backup does not hold: {', '.join(unknown)}.",
            fix=f"pin only the backup's shards: {', '.join(sorted(shards))}.",
        )
    if strangers := sorted({n for n in pins.values() if n not in room}):
        raise InvalidRequest(
            f"placement names nodes outside the target cluster: {', '.join(strangers)}.",
            fix=f"pin shards to the target's nodes: {', '.join(sorted(room))}.",
        )


def too_small(shard_id: str, size: int, left: Mapping[str, int]) -> TargetTooSmall:
    best = max(left.values(), default=0)
    return TargetTooSmall(
        f"shard {shard_id} needs {need(size) / GiB:.2f} GiB ({size / GiB:.2f} GiB of data plus "
        f"a {MARGIN:.0%} margin) but the most room left on any target node is "
        f"{max(best, 0) / GiB:.2f} GiB.",
        fix="add target nodes, free space in their restore_dir, or raise their "
        "restore_capacity_bytes; 'restore --plan-only' shows the placement.",
    )
