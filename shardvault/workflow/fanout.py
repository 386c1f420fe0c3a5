"""Fan-out: a per-node step of a workflow, over any number of nodes.

Each per-node step (Flush, Checkpoint, Scan, Stop, Release) is a *Distributed Map*: every
node's command runs in a child execution with a history of its own, so a backup's history
grows by a few events a step whatever the node count (an inline Map adds 8 an iteration,
25,000 at about 620 nodes), and up to :data:`NODE_MAP_CONCURRENCY` nodes run at once where an
inline Map runs 40.

A Distributed Map that meets a failed child fails with ``States.ExceedToleratedFailureThreshold``,
and the agent's error (``AgentUnavailable``, ``EngineError``...) would be lost with it; moto's
does not fail at all. So each child catches its own failure and returns it as data
(``{"node_id", "error": {"Error", "Cause"}}``), and the step after the Map
(``raise_first_failure``: the ``check_nodes`` function, or the plan step, which calls it
before it reads any answer) fails the workflow with the first
node's error, by its own name and cause, into the same failure path as before (an error the
interpreter names, ``States.Timeout``, becomes ``NodeTimeout``: tasks may not report
``States.`` names).
"""

from __future__ import annotations

from typing import Any

from shardvault.workflow.causes import TIMEOUTS, readable_cause


class NodeStepFailed(Exception):
    """Raised under the failed node's error name (``failure``), with its cause."""


def failure(name: str, message: str) -> NodeStepFailed:
    """An exception whose class is named ``name``: Lambda reports the class name as the error,
    so Retry and Catch see the node's own error, not this module's."""
    return type(name, (NodeStepFailed,), {})(message)


def raise_first_failure(results: list[dict[str, Any]]) -> dict[str, int]:
    """Raises the first failed node's error (its name and cause); returns the count of nodes
    when none failed."""
    failed = [r for r in results if isinstance(r, dict) and r.get("error")]
    if not failed:
        return {"nodes": len(results)}
    node_id, error = failed[0].get("node_id", "?"), failed[0]["error"]
    name = str(error.get("Error") or "States.TaskFailed")
    # A Lambda's cause is its error payload: keep its message, or it would be wrapped twice.
    cause = readable_cause(str(error.get("Cause") or ""))
    if name.startswith("States."):
        # Names under States. are the interpreter's own; a task may not report them.
        reserved, name = name, "Node" + name.removeprefix("States.")
        if not cause and reserved in TIMEOUTS:
            cause = (
                f"the command to node {node_id} timed out ({reserved}): its agent neither "
                "answered nor heartbeated in time."
            )
    raise failure(name, cause)
