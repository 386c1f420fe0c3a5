"""Why an operation failed, said truthfully.

The *error* is what Step Functions recorded for the failed state (``{"Error", "Cause"}``); its
*cause* is the text that says what happened and what to do. Three sources, in this order:

1. the cause in the error itself (a Lambda's error payload, or an agent's ``SendTaskFailure``
   cause on AWS);
2. the agents' *failure notes* (``Inbox.note_failure``): an agent writes each failure's cause
   next to its commands before it answers, because the local stack (moto) keeps only the
   error's name;
3. what the error's name alone says: a timeout is a timeout; any other name with no cause
   anywhere is reported as exactly that, never as a made-up reason.

On AWS a Distributed Map run fails as a whole when one of its children fails
(``MAP_RUN_FAILURES``), and the Catch after it sees only the run's error, whose cause names no
child. ``transfer_failure`` gives such an error the workflow's own name for an incomplete
transfer (``UploadIncomplete``, ``DownloadIncomplete``) and the failed child's cause from the
agents' notes (the local stack fails its Maps the same way: ``moto_fidelity``).

A few agent failures are the operator's to act on by name (``NAMED``: the source guard's
``SourceLogFull``): when a note of one is behind a failed backup, the backup fails under that
name, whatever the workflow's own error was (the Upload map's failure threshold on AWS, a
missing object in ``check_uploads`` where the map tolerates failures).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from shardvault.errors import ShardVaultError, SourceLogFull

if TYPE_CHECKING:  # a type only: importing services here closed a cycle through policy
    from shardvault.aws.services import Services

TIMEOUTS = frozenset({"States.Timeout", "States.HeartbeatTimeout"})
MAP_RUN_FAILURES = frozenset({"States.ExceedToleratedFailureThreshold"})
NAMED: dict[str, type[ShardVaultError]] = {"SourceLogFull": SourceLogFull}


def readable_cause(cause: str) -> str:
    """A Lambda error's cause is its JSON payload: keep the message, drop the stack trace."""
    try:
        parsed = json.loads(cause)
    except ValueError:
        return cause
    return parsed.get("errorMessage", cause) if isinstance(parsed, dict) else cause


def agent_note(svc: Services, operation_id: str, node_ids: list[str], error: str) -> str:
    """The earliest failure note of the operation on these nodes of the recorded ``error``
    (``error=""``: of any error); "" when there is none. A note of another error (a retried
    part that later succeeded) says nothing about this failure."""
    first = first_failure(svc, operation_id, node_ids, error)
    return f"{first['cause']} (node {first['node_id']}, {first['command']})" if first else ""


def named_failure(svc: Services, operation_id: str, node_ids: list[str]) -> ShardVaultError | None:
    """The error an agent's note names, when it is one of ``NAMED`` (the earliest of them),
    with the note's cause and where it came from."""
    for name, error in NAMED.items():
        if note := first_failure(svc, operation_id, node_ids, name):
            return error(f"{note['cause']} (node {note['node_id']}, {note['command']})")
    return None


def first_failure(
    svc: Services, operation_id: str, node_ids: list[str], error: str = ""
) -> dict[str, Any] | None:
    """The earliest failure note (``agent_note``), whole: its ``error`` names the class."""
    notes = [note for node in node_ids for note in svc.inbox.failures(node, operation_id)]
    matching = [note for note in notes if not error or note.get("error") == error]
    return min(matching, key=lambda note: note.get("failed_at", 0)) if matching else None


def failure_cause(
    error: dict[str, Any], svc: Services, operation_id: str, node_ids: list[str]
) -> str:
    """The cause of ``error``: its own, else the agents' note, else what its name says."""
    name = str(error.get("Error") or "States.Runtime")
    cause = readable_cause(str(error.get("Cause") or ""))
    if cause:
        return cause
    if note := agent_note(svc, operation_id, node_ids, name):
        return note
    if name in TIMEOUTS:
        return "a task timed out: its agent neither answered nor heartbeated in time."
    return f"{name}, with no cause recorded by the state that failed."


def transfer_failure(
    error: dict[str, Any], name: str, svc: Services, operation_id: str, node_ids: list[str]
) -> dict[str, Any]:
    """``error``, or for a Map run that failed as a whole, ``name`` with the earliest agent
    note's cause (the child that failed), else the run's own cause."""
    if error.get("Error") not in MAP_RUN_FAILURES:
        return error
    cause = agent_note(svc, operation_id, node_ids, "") or (
        f"an item of the transfer failed ({error.get('Error')}: "
        f"{readable_cause(str(error.get('Cause') or ''))}), and no agent noted why: see the "
        "map run's failed child execution."
    )
    return {"Error": name, "Cause": cause}
