"""Faults and the causes they are reported with: every failure names what really happened and
a fix that is true, and leaves nothing behind. The end state is read from outside the
product's report (the agent's log, the restore directory, the catalog item)."""

from __future__ import annotations

import errno
import os
import subprocess
import time
from pathlib import Path

import pytest

from shardvault.aws.readback import load_manifest
from shardvault.contracts.layout import manifest_key


def test_an_agents_error_reaches_the_record_with_its_cause(make_cluster):
    """moto keeps only the error's name of SendTaskFailure: the cause must still arrive."""
    cluster = make_cluster(nodes=1, size_mb=2)
    blocker = Path(cluster.configs[0]["state_dir"]) / "snapshots"
    blocker.write_text("not a directory")  # the snapshot cannot be written under it

    progress = cluster.backup()

    assert progress.status == "FAILED"
    (record,) = cluster.records()
    assert record["status"] == "FAILED"
    assert record["error"] in {"EngineError", "NotADirectoryError", "FileExistsError"}, record
    assert "snapshots" in record["cause"], record["cause"]
    assert "timed out" not in record["cause"]
    assert cluster.held_checkpoints() == []


def test_a_damaged_manifest_is_refused_by_name_before_any_change(make_cluster, make_target):
    # Read whole before it is damaged, as a warm function keeps it: the store's answer to the
    # next read (If-None-Match) tells it changed.
    cluster = make_cluster(nodes=1, size_mb=2)
    backup = cluster.backup()
    assert backup.status == "SUCCEEDED", backup.cause
    svc = cluster.stack.services()
    key = manifest_key(svc.store.prefix, cluster.name, backup.record["backup_id"])
    load_manifest(svc.store_bucket, key)  # read whole once: a reader may keep it
    body = svc.store_s3.get_object(Bucket=svc.store.bucket, Key=key)["Body"].read()
    svc.store_s3.put_object(Bucket=svc.store.bucket, Key=key, Body=body[: len(body) // 2])
    target = make_target(nodes=1)

    restored = target.restore(cluster.name)

    assert restored.status == "FAILED"
    assert restored.error == "ManifestDamaged", restored.cause
    assert key in restored.cause
    assert "restore another backup" in restored.cause
    assert target.records() == []  # refused at validation: no restore was recorded
    assert not any(p.is_file() for p in target.restore_dir(0).rglob("*"))


def minio_files_of(stack, key: str) -> list[Path]:
    """The files MinIO keeps for an object on its (single) drive: its parts' data."""
    folder = stack.root / "minio" / stack.services().store.bucket / key
    return sorted(p for p in folder.rglob("part.*") if p.is_file())


def test_bitrot_in_the_store_is_named_and_not_called_resumable(make_cluster, make_target):
    """MinIO finds bitrot by its own checksums and cuts the read at the damaged block, on
    every try: that is a damaged object, not a network problem a new start would resume."""
    cluster = make_cluster(nodes=1, size_mb=12)
    backup = cluster.backup()
    assert backup.status == "SUCCEEDED", backup.cause
    (key,) = (k for k in cluster.store_keys() if "/data-" in k)
    parts = minio_files_of(cluster.stack, key)
    assert parts, f"no part files of {key} on MinIO's drive"
    with open(parts[0], "r+b") as part:  # flip bytes in the middle of the first part
        part.seek(4096)
        data = part.read(64)
        part.seek(4096)
        part.write(bytes(b ^ 0xFF for b in data))
    target = make_target(nodes=1)

    restored = target.restore(cluster.name)

    assert restored.status == "FAILED"
    assert restored.error == "StoreObjectDamaged", restored.cause
    (record,) = target.records()
    assert record["error"] == "StoreObjectDamaged"
    assert key in record["cause"]
    assert "resumes" not in record["cause"]
    assert not any(p.is_file() for p in target.restore_dir(0).rglob("*"))


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs: a disk that can really fill up (the tests run as root)."""
    mounts = []

    def mount(path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(path)], check=True)
        mounts.append(path)
        return path

    yield mount
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill_up(filler: Path) -> None:
    """Takes every free byte of ``filler``'s filesystem. The restore writes meanwhile, so the
    free space can shrink between reading it and taking it: then take what is left."""
    with open(filler, "wb") as out:
        for _ in range(50):
            stat = os.statvfs(filler.parent)
            free = stat.f_bavail * stat.f_frsize
            if not free:
                return
            try:
                os.posix_fallocate(out.fileno(), os.fstat(out.fileno()).st_size, free)
                return
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise
    raise AssertionError(f"could not fill the disk under {filler}")


def test_a_full_disk_during_a_restore_is_named_and_not_retried(
    make_cluster, make_target, small_disk
):
    cluster = make_cluster(nodes=1, size_mb=8)
    assert cluster.backup().status == "SUCCEEDED"
    target = make_target(nodes=1, agent={"rate_limit_bytes_per_second": 2**20})
    restore_dir = small_disk(target.restore_dir(0))
    time.sleep(1.5)  # the next heartbeat reports the small disk's room
    execution = target.start_restore(cluster.name)
    deadline = time.monotonic() + 60
    while not any((restore_dir / ".incoming").glob("*/*")):
        assert time.monotonic() < deadline, "the restore never laid out its staging"
        time.sleep(0.05)
    filler = restore_dir / "filler"  # someone else fills the disk while the restore writes
    fill_up(filler)

    from shardvault.client import operations as ops

    from .conftest import client_of

    restored = ops.wait_restore(client_of(target.stack), execution, interval=0.2, timeout=300)

    assert restored.status == "FAILED"
    assert restored.error == "TargetTooSmall", restored.cause
    assert "filled up" in restored.cause
    log = target.agent_log(0)
    assert "PartDownloadFailed" not in log  # a full disk is not a network problem to retry
    assert [p for p in restore_dir.rglob("*") if p.is_file()] == [filler]
