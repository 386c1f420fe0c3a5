"""The cluster's cut: one named point in every node's WAL, taken at one shared instant.

A PostgreSQL node restored from its own backup is consistent with itself wherever its WAL
replay stops; a cluster whose shards reference each other needs every node stopped at the
same moment. Each backup therefore ends with a *cut*:

- *restore point*: ``pg_create_restore_point(<name>)`` on every source shard, named after
  the backup; a restore recovers every node to it (``recovery_target_name``). It is created
  after ``pg_backup_stop``: PostgreSQL refuses a recovery target before the end of the base
  backup (the point where its copy becomes consistent).
- *cut instant*: when every node creates its restore point, by its own clock: the moment the
  backup's Stop step began (``$$.State.EnteredTime``, the same for every node) plus a
  *margin* that lets every node's stop command arrive and end its backup first. One node
  needs no margin. Nodes keep their clocks in step (NTP/chrony); their offset is part of the
  skew below, and not visible to ShardVault.
- *cut skew*: the spread of the times the nodes' restore points were created (each node's
  ``clock_timestamp()`` beside its restore point): how far apart, at most, the nodes'
  restored states are. A node whose command arrived after the instant is *late*: it cuts at
  once, and the skew shows it.
- *commit pause* (opt-in, the policy's ``cut.commit_lock``): PostgreSQL has no switch that
  holds every commit, so the cut pauses the commits that ask to be paused, as Citus pauses
  its distributed commits. An application's distributed commit holds the advisory lock
  ``commit_lock`` shared on every node it commits on from before its first ``COMMIT
  PREPARED`` to after its last, taking it with ``pg_try_advisory_lock_shared`` (refused while
  an exclusive request waits: it lets go of all and retries), in the policy's ``cut.database``
  (advisory locks are per database: the cut takes it there, on a session of its own, whatever
  database the agent's own session is on; a lock taken elsewhere would hold none of the
  application's commits, so a cut asked to pause without a database is best-effort, never
  paused in name only); each node asks for it exclusively
  at the cut instant (waiting at most ``LOCK_TIMEOUT_SECONDS`` for commits under way), creates
  its restore point as soon as it holds it, and lets go ``PAUSE_HOLD_SECONDS`` after the
  instant: every node lets go at the same instant by its clock, so nodes whose lock came up to
  that much late still share a moment with the others. A node's server times its cut itself:
  the agent sends it as one statement before the instant (the engine's ``PAUSED_CUT``), so no
  round trip or agent wake-up falls inside, and the one wake-up inside is the hold's end.
  If every node held the lock at one shared moment (the latest node's lock came before the
  earliest node's release), no such commit lies on one node's side of the cut and another's:
  the cut is *paused* (consistent for those commits). The *pause* is how long a node held
  commits (from asking for the lock to letting go: about the hold); the longest
  node's is recorded. A node that cannot take the lock in time cuts without it: the cut is
  then best-effort, and says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from pydantic import Field, field_validator

from shardvault.contracts.models import Frozen
from shardvault.contracts.pgwal import check_restore_point_name
from shardvault.errors import InvalidRequest

# Chosen, not measured on AWS: the margin covers a stop command's dispatch and its
# pg_backup_stop. 1 s covered every stop of 3 nodes in the local benchmark until a
# distributed writer shared its two cores; then a node's stop arrived up to 280 ms past the
# instant in 3 to 6 of 20 backups (docs/BENCHMARKS.md), so 2 s. The per-node part assumes a
# Distributed Map starts its children at a few hundred a second. A late node is shown
# (cut_late_seconds), not refused; one node needs no margin.
CUT_MARGIN_SECONDS = 2.0
CUT_MARGIN_PER_NODE_SECONDS = 0.002
# The commit pause: held this long after the instant, which covers the nodes' skew (timed by
# their servers: p90 under 2 ms, max 4 ms under load on one machine, docs/BENCHMARKS.md) and
# the hosts' clock offsets, which add to it. 5 ms paused every cut of a run here too, with
# less margin for those offsets, and did not shorten the pause's tail (the machine's stalls).
# A lock not granted within the timeout (a distributed commit that does not end) leaves a
# best-effort cut.
PAUSE_HOLD_SECONDS = 0.010
LOCK_TIMEOUT_SECONDS = 0.05


# NAMEDATALEN - 1: the longest name a PostgreSQL database can have, in bytes.
DATABASE_NAME_BYTES = 63


def database_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a PostgreSQL database (None: it can). Any text of 1 to 63
    bytes is a valid quoted identifier; control characters are refused too (no database
    worth pausing is named with one, and they would garble the messages that name it). The
    name only ever travels as a connection parameter, never inside SQL."""
    if not name.strip():
        return "is empty or blank"
    if len(name.encode()) > DATABASE_NAME_BYTES:
        return f"is longer than PostgreSQL's {DATABASE_NAME_BYTES} bytes"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        return "holds a control character"
    return None


def cut_margin_seconds(nodes: int) -> float:
    """How long after its Stop step began a backup of ``nodes`` source nodes cuts."""
    return 0.0 if nodes <= 1 else CUT_MARGIN_SECONDS + CUT_MARGIN_PER_NODE_SECONDS * nodes


class CutRequest(Frozen):
    """What a stop command is told of the cut: the restore point's name and its instant."""

    name: str
    entered: str  # the Stop step's start, ISO 8601 (Step Functions' $$.State.EnteredTime)
    margin_seconds: float = 0.0
    commit_lock: int | None = Field(None, ge=-(2**63), lt=2**63)  # None: no commit pause
    # Where the application takes the lock (advisory locks are per database): the cut takes
    # it there, on a session of its own. None with a lock (a control plane older than
    # cut.database): where the application takes it is unknown, so the cut is best-effort.
    database: str | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return check_restore_point_name(value)

    @field_validator("database")
    @classmethod
    def _database(cls, value: str | None) -> str | None:
        if value is not None and (problem := database_name_problem(value)):
            raise InvalidRequest(
                f"cut.database {value!r} {problem}.",
                fix="name the database in the policy's cut.database as PostgreSQL spells it.",
            )
        return value

    @property
    def at(self) -> float:
        """The cut instant, in seconds since the epoch."""
        entered = datetime.fromisoformat(self.entered.replace("Z", "+00:00"))
        return entered.timestamp() + self.margin_seconds


def cut_skew_seconds(times: list[float]) -> float | None:
    """The spread of the nodes' restore points' creation times; None without any."""
    return round(max(times) - min(times), 6) if times else None


def pause_summary(pauses: list[tuple[float, float, float]]) -> dict[str, object]:
    """What the nodes' commit pauses (each ``(asked, locked, released)``, epoch seconds; empty
    for a node that got no lock) made of the cut: paused when every node held the lock at one
    shared moment, and the longest pause; nothing when no pause was asked."""
    if not pauses:
        return {}
    held = [p for p in pauses if p[1] > 0]
    shared = len(held) == len(pauses) and max(p[1] for p in held) < min(p[2] for p in held)
    longest = max((p[2] - p[0] for p in held), default=0.0)
    return {"cut_paused": shared, "cut_pause_seconds": round(longest, 6)}


def pause_of(marker: Mapping[str, str]) -> tuple[float, float, float]:
    """A shard's commit pause as its marker records it: ``asked locked released`` (epoch
    seconds; locked 0: no lock was granted)."""
    asked, locked, released = (float(v) for v in marker["cut_pause"].split())
    return asked, locked, released


def summary(markers: Sequence[tuple[str, Mapping[str, str]]], name: str) -> dict[str, Any]:
    """The cluster's cut as the shards' markers (``(shard id, marker)``) recorded it: its
    restore point's name, the skew of its creation times, how late the latest shard came to
    it, and the pause; nothing when no shard cut (SQLite, an agent older than cuts). A marker
    is an agent's answer: one naming another point, or times that are not numbers, is
    refused."""
    cut = [(shard_id, marker) for shard_id, marker in markers if "cut_at" in marker]
    if not cut:
        return {}
    try:
        times = [float(marker["cut_at"]) for _, marker in cut]
        late = max(float(marker.get("cut_late_seconds", 0)) for _, marker in cut)
        pauses = [pause_of(marker) for _, marker in cut if "cut_pause" in marker]
    except ValueError:
        times, late, pauses = [], 0.0, []
    wrong = [shard_id for shard_id, marker in cut if marker.get("cut_name") != name]
    if wrong or not times:
        raise InvalidRequest(
            f"the markers of shards {wrong or [shard_id for shard_id, _ in cut]} do not record "
            f"the restore point {name} as agents of this version do.",
            fix="check that each agent's version matches the control plane's; retry.",
        )
    return {
        "cut_name": name,
        "cut_skew_seconds": cut_skew_seconds(times),
        "cut_late_seconds": late,
        "cut_shards": len(cut),
        **pause_summary(pauses),
    }
