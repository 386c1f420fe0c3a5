"""The backup workflow's Upload map: TransferSigned is Transfer's task, only with nothing
after it (an object signed at plan is verified by CheckUploads, not Complete). The two are
written out in full in the ASL; this keeps a change to one from missing the other."""

from __future__ import annotations

import json
from pathlib import Path

ASL = Path(__file__).parents[2] / "statemachines" / "backup.asl.json"
# What TransferSigned may differ in: it ends the item and keeps no result (no Complete reads it).
ENDING = ("Next", "End", "ResultPath", "OutputPath", "Comment")


def upload_states() -> dict:
    return json.loads(ASL.read_text())["States"]["Upload"]["ItemProcessor"]["States"]


def test_transfer_signed_is_transfer_with_nothing_after_it() -> None:
    states = upload_states()
    transfer, signed = states["Transfer"], states["TransferSigned"]
    assert {k: v for k, v in signed.items() if k not in ENDING} == {
        k: v for k, v in transfer.items() if k not in ENDING
    }
    assert (transfer["Next"], signed.get("End")) == ("Complete", True)
    assert (signed["ResultPath"], signed["OutputPath"]) == (None, None)


def test_only_an_item_signed_at_plan_skips_sign_and_complete() -> None:
    choices = upload_states()["PackedAtScan"]["Choices"]
    assert choices[0] == {"Variable": "$.signed", "IsNull": False, "Next": "TransferSigned"}
