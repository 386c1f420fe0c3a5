"""An agent failure the operator acts on by name fails the backup under that name, even when
an earlier note of another error (a part tried again) came first, and even when the workflow's
own error is a Map's failure threshold (AWS) rather than the check that names it (moto)."""

from __future__ import annotations

import time

from shardvault.errors import SourceLogFull
from shardvault.workflow.causes import named_failure

from .support import moto_services


def note(svc, node: str, command_id: str, error: str, cause: str) -> None:
    item = {"command_id": command_id, "command": "pack", "args": {"backup_id": "b1"}}
    svc.inbox.note_failure(node, item, error, cause)
    time.sleep(0.01)  # notes are ordered by their time


def test_a_named_failure_is_found_behind_an_earlier_transient_one(monkeypatch) -> None:
    with moto_services(monkeypatch) as svc:
        assert named_failure(svc, "b1", ["n1", "n2"]) is None
        note(svc, "n1", "c1", "PartUploadFailed", "a part was refused; sent again")
        assert named_failure(svc, "b1", ["n1", "n2"]) is None  # not one the operator acts on
        note(svc, "n2", "c2", "SourceLogFull", "backup b1 holds 900 MiB of the source's WAL")
        found = named_failure(svc, "b1", ["n1", "n2"])
    assert isinstance(found, SourceLogFull)
    assert found.name == "SourceLogFull"
    assert found.message == "backup b1 holds 900 MiB of the source's WAL (node n2, pack)"
