"""The agent's WAL archiver (shardvault_agent.wal.archiver), against fakes of the archive function,
the inbox table and the uploads: which spooled files make a batch and when, and what a failure
at each step leaves (the spool keeps every file until its batch is recorded)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from shardvault_agent.wal import archiver as archiver_module
from shardvault_agent.wal.archiver import Archiver, Spool

from shardvault.errors import ArchiveRefused, WalNotArchived

SEGMENT = 64 * 1024  # small segments: the rules do not depend on the size


class Function:
    """The archive function as an agent sees it; ``refuse`` makes one action fail."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.refuse: str | None = None

    def __call__(self, event: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(event["action"])
        if event["action"] == self.refuse:
            return {"errorType": "ChecksumMismatch", "errorMessage": "not stored as described"}
        if event["action"] == "settings":
            return {
                "cluster": "c",
                "compression": {"level": 1},
                "max_delay_seconds": 5.0,
                "encryption": None,
            }
        return {"url": "https://store.example/put", "key": "k"}


class Inbox:
    def __init__(self) -> None:
        self.items: dict[str, dict[str, Any]] = {}

    def put_item(self, Item: dict[str, Any]) -> None:  # boto3's argument names
        self.items[Item["command_id"]] = Item

    def delete_item(self, Key: dict[str, Any]) -> None:
        self.items.pop(Key["command_id"], None)


class Sender:
    def __init__(self) -> None:
        self.sent: list[tuple[int, str]] = []

    def send_file(self, url: str, path: Path, size: int, crc64nvme: str, what: str) -> None:
        assert path.stat().st_size == size
        self.sent.append((size, crc64nvme))


@pytest.fixture
def spool(tmp_path: Path) -> Path:
    path = tmp_path / "spool"
    path.mkdir()
    return path


def spooled(spool: Path, first: int, count: int, age: float = 0.0) -> list[str]:
    names = []
    for number in range(first, first + count):
        path = spool / f"0000000100000000000000{number:02X}"
        path.write_bytes(os.urandom(256) * (SEGMENT // 256))
        then = time.time() - age
        os.utime(path, (then, then))
        names.append(path.name)
    return names


def make(tmp_path: Path, spool: Path, function: Function | None = None) -> Archiver:
    return Archiver(
        node_id="n1",
        spools=[Spool("s1", spool)],
        state_dir=tmp_path / "state",
        invoke=function or Function(),
        inbox=Inbox(),
        sender=Sender(),
        keys=None,  # type: ignore[arg-type] - not sealed: the settings name no key
        parallelism=1,
    )


def test_a_batch_waits_for_the_delay_unless_it_is_full(tmp_path, spool, monkeypatch) -> None:
    archiver = make(tmp_path, spool)
    now = time.time()
    spooled(spool, 1, 2, age=1.0)
    assert archiver.ready(archiver.spools[0], 5.0, now) == []  # young and not full: waits
    assert len(archiver.ready(archiver.spools[0], 0.5, now)) == 2  # waited long enough
    monkeypatch.setattr(archiver_module, "BATCH_MAX_BYTES", 3 * SEGMENT)
    spooled(spool, 3, 3, age=1.0)
    full = archiver.ready(archiver.spools[0], 5.0, now)  # 5 spooled, 3 fit: goes at once
    assert [p.name[-2:] for p in full] == ["01", "02", "03"]


def test_archived_files_leave_the_spool_only_once_recorded(tmp_path, spool) -> None:
    function = Function()
    archiver = make(tmp_path, spool, function)
    spooled(spool, 1, 3, age=10.0)
    archiver.tick()
    archiver.pool.shutdown(wait=True)
    archiver._reap()
    assert function.calls == ["settings", "sign", "record"]
    assert list(spool.iterdir()) == []
    assert list((tmp_path / "state" / "archive").iterdir()) == []
    assert archiver.inbox.items == {}  # the request item is gone too
    ((size, _),) = archiver.sender.sent
    assert size < 3 * SEGMENT  # compressed: each segment repeats 256 random bytes


def test_a_batch_the_function_refuses_to_record_stays_pending_with_its_files(
    tmp_path, spool
) -> None:
    function = Function()
    function.refuse = "record"
    archiver = make(tmp_path, spool, function)
    names = spooled(spool, 1, 2, age=10.0)
    archiver.tick()
    archiver.pool.shutdown(wait=True)
    archiver._reap()
    assert sorted(p.name for p in spool.iterdir()) == names  # nothing lost
    (pending,) = archiver.pending()
    assert [f.name for f in pending.files] == names
    assert archiver.paused_until > time.time()  # tried again later, not in a hot loop
    # Restarted (a new agent), with one more file spooled meanwhile: the pending batch is
    # sent again whole, and its files are in no second batch.
    function.refuse = None
    spooled(spool, 3, 1, age=10.0)
    again = make(tmp_path, spool, function)
    again.tick()
    again.pool.shutdown(wait=True)
    assert len(again.sender.sent) == 1
    assert [p.name[-2:] for p in spool.iterdir()] == ["03"]  # the next batch's


def test_a_pack_that_died_leaves_nothing_the_next_look_keeps(tmp_path, spool) -> None:
    archiver = make(tmp_path, spool)
    dead = tmp_path / "state" / "archive" / ".0123456789abcdef0123456789abcdef"
    dead.mkdir(parents=True)
    (dead / "object").write_bytes(b"half")
    assert archiver.pending() == []
    assert not dead.exists()


def test_a_refusal_is_named_with_the_functions_error(tmp_path, spool) -> None:
    function = Function()
    function.refuse = "settings"
    archiver = make(tmp_path, spool, function)
    with pytest.raises(ArchiveRefused, match="ChecksumMismatch"):
        archiver.tick()


def test_the_settings_are_read_again_but_a_data_key_is_asked_for_once_a_day(
    tmp_path, spool, monkeypatch
) -> None:
    asked: list[bool] = []
    wrapped = {"key_id": "k", "wrapped_key": "d3JhcHBlZA==", "context": {"shardvault:cluster": "c"}}

    def function(event: dict[str, Any]) -> dict[str, Any]:
        asked.append(event["new_key"])
        key = wrapped if event["new_key"] else None
        return {"cluster": "c", "encrypt": True, "encryption": key, "key_seconds": 86400.0}

    archiver = make(tmp_path, spool)
    archiver.invoke = function
    clock = [1000.0]
    first = archiver._settings(clock[0])
    clock[0] += archiver_module.SETTINGS_SECONDS + 1  # the policy again, the same key
    again = archiver._settings(clock[0])
    clock[0] += 86400  # the key ran out
    renewed = archiver._settings(clock[0])
    assert asked == [True, False, True]
    assert first.encryption == again.encryption == renewed.encryption
    assert renewed.key_until == clock[0] + 86400
    assert archiver._settings(clock[0] + 1) is renewed  # no call within SETTINGS_SECONDS


# --- a backup waiting for its WAL (an archived tail) -------------------------------------------
def test_a_waiting_backup_has_the_spool_sent_at_once(tmp_path, spool) -> None:
    archiver = make(tmp_path, spool)
    now = time.time()
    spooled(spool, 1, 3)  # young: without a waiting backup they wait for the delay
    assert archiver.ready(archiver.spools[0], 5.0, now) == []
    through = "000000010000000000000002"
    hurried = archiver.ready(archiver.spools[0], 5.0, now, hurried=through)
    assert [p.name[-2:] for p in hurried] == ["01", "02", "03"]  # the batch is the spool's
    assert archiver.ready(archiver.spools[0], 5.0, now, hurried="000000010000000000000000") == []


def test_a_waiting_backup_returns_once_its_segments_are_recorded(tmp_path, spool) -> None:
    function = Function()
    archiver = make(tmp_path, spool, function)
    threading.Thread(target=archiver.run, daemon=True).start()
    try:
        spooled(spool, 1, 2)  # young: only the waiting backup sends them before the delay
        archiver.wait_archived("s1", "000000010000000000000002", timeout=10.0)
        assert list(spool.iterdir()) == []  # recorded, then removed
        assert function.calls[-2:] == ["sign", "record"]
        assert archiver.hurried == {}  # nothing hurried once the backup has its WAL
    finally:
        archiver.stop()


def test_a_backup_whose_wal_is_not_archived_in_time_fails_naming_why(tmp_path, spool) -> None:
    function = Function()
    function.refuse = "sign"
    archiver = make(tmp_path, spool, function)
    threading.Thread(target=archiver.run, daemon=True).start()
    try:
        spooled(spool, 1, 2)
        with pytest.raises(WalNotArchived) as raised:
            archiver.wait_archived("s1", "000000010000000000000002", timeout=1.0)
    finally:
        archiver.stop()
    message = raised.value.message
    assert "2 file(s) from 000000010000000000000001" in message
    assert "ChecksumMismatch" in message  # the archive function's refusal, named
    assert len(list(spool.iterdir())) == 2  # nothing lost


def test_a_crash_after_the_record_leaves_nothing_a_restart_does_not_remove(
    tmp_path, spool, monkeypatch
) -> None:
    """Killed between clearing the batch's request and removing the pending batch: a restart
    sends the batch again and clears both. (In the other order a kill left a request nothing
    would remove: a fault test found it, and the state it leaves is what is checked here.)"""

    class Killed(BaseException):
        pass

    def killed(path: Any, ignore_errors: bool = False) -> None:
        raise Killed

    first = make(tmp_path, spool)
    spooled(spool, 1, 2, age=10.0)
    monkeypatch.setattr(archiver_module.shutil, "rmtree", killed)
    with pytest.raises(Killed):
        first.send(first.pack(first.spools[0], sorted(spool.iterdir()), first._settings(0)))
    monkeypatch.undo()
    assert first.inbox.items == {}  # the request went first
    assert [p.name for p in (tmp_path / "state" / "archive").iterdir()]  # the batch stayed

    again = make(tmp_path, spool)
    again.inbox = first.inbox
    for batch in again.pending():
        again.send(batch)

    assert list((tmp_path / "state" / "archive").iterdir()) == []
    assert again.inbox.items == {}
    assert list(spool.iterdir()) == []
