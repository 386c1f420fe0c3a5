"""The WAL feed (``shardvault_agent.restore.walfeed``) and the ``restore_command`` that waits
for it, run as PostgreSQL runs it: ``sh -c`` with ``%f`` and ``%p`` put in."""

from __future__ import annotations

import io
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from shardvault_agent.engines.postgres.restore import FEED_FAILED_STATUS, feed_command
from shardvault_agent.restore.walfeed import WalFeed, wal_batches

from shardvault.contracts.models import DownloadItem, FileEntry, Phase
from shardvault.contracts.wal_archive import WAL_DIR
from shardvault.data.checksums import crc64nvme, to_b64
from shardvault.data.pipeline import FrameCodec, pack, pack_frames
from shardvault.errors import ChecksumMismatch, FrameUnreadable

SEGMENT = 64 * 1024  # small segments: the feed does not care about their size


def as_postgres_runs(command: str, name: str, path: str) -> str:
    """The shell text PostgreSQL runs: the configuration's quoting undone, then ``%f``,
    ``%p`` and ``%%`` replaced."""
    text, out, i = command.replace("''", "'"), [], 0
    while i < len(text):
        if text[i] == "%" and i + 1 < len(text):
            out.append({"f": name, "p": path, "%": "%"}.get(text[i + 1], text[i : i + 2]))
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def restore_command(wal_dir: Path, name: str, into: Path) -> subprocess.CompletedProcess[str]:
    shell = as_postgres_runs(feed_command(wal_dir), name, str(into))
    run = ["/bin/sh", "-c", shell]
    return subprocess.run(run, check=False, capture_output=True, text=True, timeout=20)


@pytest.fixture
def wal_dir(tmp_path: Path) -> Path:
    # A directory name the shell and PostgreSQL's own substitution must both survive.
    directory = tmp_path / "re stored 100% 'x'" / WAL_DIR
    for marker in (".planned", ".asked"):
        (directory / marker).mkdir(parents=True)
    return directory


def test_a_file_the_feed_does_not_plan_is_not_in_the_archive(wal_dir: Path, tmp_path: Path):
    started = time.monotonic()
    done = restore_command(wal_dir, "00000002.history", tmp_path / "RECOVERYHISTORY")
    assert done.returncode == 1
    assert time.monotonic() - started < 2  # at once: recovery goes on without it
    assert not any((wal_dir / ".asked").iterdir())


def test_the_command_waits_for_its_file_and_says_it_asked(wal_dir: Path, tmp_path: Path):
    name = "000000010000000000000003"
    (wal_dir / ".planned" / name).touch()
    later = threading.Timer(0.4, lambda: (wal_dir / name).write_bytes(b"wal" * 100))
    later.start()
    done = restore_command(wal_dir, name, tmp_path / "RECOVERYXLOG")
    later.join()
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "RECOVERYXLOG").read_bytes() == b"wal" * 100


def test_the_command_links_its_file_into_place_and_copies_across_file_systems(
    wal_dir: Path, tmp_path: Path
):
    name = "000000010000000000000005"
    (wal_dir / ".planned" / name).touch()
    (wal_dir / name).write_bytes(b"segment" * 100)
    done = restore_command(wal_dir, name, tmp_path / "RECOVERYXLOG")
    assert done.returncode == 0, done.stderr
    # One file, not a copy: recovery pays a link's cost per segment, not 16 MiB written.
    assert (tmp_path / "RECOVERYXLOG").stat().st_ino == (wal_dir / name).stat().st_ino
    elsewhere = Path("/dev/shm")  # tmpfs: a link from tmp_path's file system fails there
    assert elsewhere.stat().st_dev != tmp_path.stat().st_dev
    into = elsewhere / f"RECOVERYXLOG-{tmp_path.name}"
    try:
        done = restore_command(wal_dir, name, into)
        assert done.returncode == 0, done.stderr
        assert into.read_bytes() == b"segment" * 100
    finally:
        into.unlink(missing_ok=True)


@pytest.mark.parametrize("marker", [".failed", ".stop"])
def test_a_failed_or_stopped_feed_stops_recovery_instead_of_ending_it(
    wal_dir: Path, tmp_path: Path, marker: str
):
    name = "000000010000000000000004"
    (wal_dir / ".planned" / name).touch()
    (wal_dir / marker).write_text("the batch is damaged\n")
    done = restore_command(wal_dir, name, tmp_path / "RECOVERYXLOG")
    assert done.returncode == FEED_FAILED_STATUS  # above 125: recovery stops with an error
    assert (wal_dir / ".asked" / name).exists()


# --- the feed -------------------------------------------------------------------------------
class Store:
    """Batches as the archive holds them, fetched by range; ``damaged``: keys whose bytes
    come back changed. ``fetched`` lists the keys fetched, in order."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.damaged: set[str] = set()
        self.fetched: list[str] = []
        self.guard = threading.Lock()

    def fetch(self, url: str, what: str, offset: int, size: int, write: Any) -> str:
        body = self.objects[url][offset : offset + size]
        if url in self.damaged:
            body = bytes([body[0] ^ 1]) + body[1:]
        with self.guard:
            self.fetched.append(url)
        write(0, body)
        return to_b64(crc64nvme(body))


def segment_name(n: int) -> str:
    return f"00000001{0:08X}{n:08X}"


def archive(store: Store, batches: int, per_batch: int = 2) -> tuple[list, list]:
    """``batches`` batches of ``per_batch`` segments each: the WAL stream and its items."""
    files = [FileEntry(path=f"{WAL_DIR}/", size=0)]
    signed, offset = [], 0
    for b in range(batches):
        names = [segment_name(b * per_batch + i) for i in range(per_batch)]
        body = b"".join(name.encode() * (SEGMENT // 24) + b"." * (SEGMENT % 24) for name in names)
        files += [FileEntry(path=f"{WAL_DIR}/{name}", size=SEGMENT) for name in names]
        out = io.BytesIO()
        key = f"archive/batch-{b}"
        packed = pack(io.BytesIO(body).read, len(body), SEGMENT, 8 << 20, FrameCodec(), out, key)
        store.objects[key] = out.getvalue()
        item = DownloadItem(
            restore_id="r1", target_cluster="t", node_id="n1", shard_id="s1",
            phase=Phase.WAL, key=key, stream_offset=offset, length=len(body),
            part_size=len(out.getvalue()), part_count=1, crc64nvme=packed.crc64nvme,
            part_crc64nvme=[packed.crc64nvme], source="store",
            stored_length=len(out.getvalue()), frame_size=SEGMENT,
            frames=pack_frames(packed.frames), place=key,
        )  # fmt: skip
        signed.append((item, key))
        offset += len(body)
    return files, signed


def feed_of(tmp_path: Path, store: Store, files: list, signed: list, ahead: int = 1) -> WalFeed:
    wal = tmp_path / "final" / WAL_DIR
    wal.mkdir(parents=True, exist_ok=True)
    return WalFeed(
        wal_dir=wal,
        landing=tmp_path / "landing",
        files=files,
        batches=wal_batches(files, signed),
        downloader=store,  # type: ignore[arg-type]
        sealer_of=lambda item: None,
        ahead=ahead,
        parallel=1,
    )


def a_feed(tmp_path: Path, batches: int, ahead: int = 1, per_batch: int = 2):
    """A store holding ``batches`` batches, and a feed of them (not started)."""
    store = Store()
    files, signed = archive(store, batches, per_batch)
    return store, feed_of(tmp_path, store, files, signed, ahead)


@contextmanager
def running(feed: WalFeed) -> Iterator[WalFeed]:
    """The feed started, and stopped however the block ends."""
    feed.start()
    try:
        yield feed
    finally:
        feed.stop()


def wait_for(check, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_feed_fetches_what_recovery_asks_for_and_a_few_batches_ahead(tmp_path: Path):
    store, feed = a_feed(tmp_path, batches=8, ahead=1)
    with running(feed):
        wait_for(lambda: len(store.fetched) == 2)  # batches 0 and 1 (one ahead of none asked)
        time.sleep(0.3)
        assert store.fetched == ["archive/batch-0", "archive/batch-1"]
        (feed.wal_dir / ".asked" / segment_name(6)).touch()  # recovery reached batch 3
        wait_for(lambda: len(store.fetched) == 5)
        time.sleep(0.3)
        assert store.fetched[2:] == ["archive/batch-2", "archive/batch-3", "archive/batch-4"]
    # Every fetched file whole in the WAL directory, readable; nothing past the window.
    for n in range(10):
        assert (feed.wal_dir / segment_name(n)).read_bytes()[:24] == segment_name(n).encode()
    assert not (feed.wal_dir / segment_name(10)).exists()
    assert (feed.wal_dir / ".planned" / segment_name(15)).exists()
    assert feed.counted().model_dump() == {
        "planned": 8, "fetched": 5, "bytes": 5 * 2 * SEGMENT,
        "stored_bytes": sum(len(store.objects[f"archive/batch-{b}"]) for b in range(5)),
    }  # fmt: skip
    assert not (tmp_path / "landing").exists()


def test_the_feed_gives_each_file_to_the_servers_account(tmp_path: Path):
    # The command links a file into pg_wal, where the server later recycles it and writes
    # into it: the file must be the server's account's (the agent may run as root).
    _, feed = a_feed(tmp_path, batches=1)
    account = (65534, 65534)  # nobody: not the test's own
    feed.owner = account
    with running(feed):
        wait_for((feed.wal_dir / segment_name(1)).exists)
    for n in range(2):
        st = (feed.wal_dir / segment_name(n)).stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (*account, 0o600)


def test_a_damaged_batch_fails_the_feed_and_what_waits_on_it(tmp_path: Path):
    store, feed = a_feed(tmp_path, batches=3, ahead=4)
    store.damaged.add("archive/batch-1")
    with running(feed):
        wait_for((feed.wal_dir / ".failed").exists)
    assert isinstance(feed.failure, ChecksumMismatch | FrameUnreadable)
    assert "archive/batch-1" in str(feed.failure)
    assert "batch-1" in (feed.wal_dir / ".failed").read_text()
    assert not (feed.wal_dir / segment_name(2)).exists()  # the damaged batch's files: never
    done = restore_command(feed.wal_dir, segment_name(2), tmp_path / "RECOVERYXLOG")
    assert done.returncode == FEED_FAILED_STATUS


def test_a_retried_feed_trusts_no_file_a_crash_may_have_torn(tmp_path: Path):
    store = Store()
    files, signed = archive(store, batches=2)
    with running(feed_of(tmp_path, store, files, signed, ahead=4)) as first:
        wait_for(lambda: len(first.fetched) == 2)
    (first.wal_dir / segment_name(1)).write_bytes(b"torn")  # written, never synced
    with running(feed_of(tmp_path, store, files, signed, ahead=4)) as again:
        wait_for(lambda: len(again.fetched) == 2)
    assert (again.wal_dir / segment_name(1)).read_bytes()[:24] == segment_name(1).encode()


def test_a_feed_waiting_for_recovery_to_ask_further_uses_no_cpu(tmp_path: Path):
    _, feed = a_feed(tmp_path, batches=6, ahead=1)
    with running(feed):
        wait_for(lambda: len(feed.fetched) == 2)
        before = time.process_time()
        time.sleep(1.0)
        assert time.process_time() - before < 0.3  # it sleeps between looks, never spins


def test_an_abort_ends_the_feed_and_what_waits_on_it(tmp_path: Path):
    _, feed = a_feed(tmp_path, batches=6, ahead=1)
    aborted = {"now": False}
    feed.aborted = lambda: aborted["now"]
    with running(feed):
        wait_for(lambda: len(feed.fetched) == 2)
        aborted["now"] = True
        wait_for((feed.wal_dir / ".failed").exists)
    assert "aborted" in str(feed.failure)
    done = restore_command(feed.wal_dir, segment_name(8), tmp_path / "RECOVERYXLOG")
    assert done.returncode == FEED_FAILED_STATUS


def test_a_file_is_in_place_once_its_frames_are_not_once_its_batch_is(tmp_path: Path):
    store, feed = a_feed(tmp_path, batches=1, per_batch=3)
    held, release = threading.Event(), threading.Event()
    fetch = store.fetch

    def slow_after_first(url: str, what: str, offset: int, size: int, write: Any) -> str:
        if offset > 0:  # every read but the batch's first waits
            held.set()
            release.wait(10)
        return fetch(url, what, offset, size, write)

    store.fetch = slow_after_first  # type: ignore[method-assign]
    feed.read_bytes = 1  # a read per frame: a frame per segment here
    try:
        with running(feed):
            held.wait(10)
            assert (feed.wal_dir / segment_name(0)).exists()  # recovery may read it already
            assert not (feed.wal_dir / segment_name(1)).exists()
            release.set()
            wait_for(lambda: len(feed.fetched) == 1)
    finally:
        release.set()  # a failed assertion must not leave the fetch waiting
    assert all((feed.wal_dir / segment_name(n)).exists() for n in range(3))
