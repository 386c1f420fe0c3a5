"""Real local servers: MinIO answers S3 calls, PostgreSQL answers SQL, both stop cleanly.

These servers are what the local stack and the integration tests stand on, so a missing
binary fails here, with the fix in the message: it is never a skip.
"""

from __future__ import annotations

import os
import pwd
import shutil
import uuid
from pathlib import Path

import boto3
import pytest
from botocore.config import Config
from shardvault_agent.engines.postgres.server import (
    BIN_ENV,
    SOCKET_PATH_MAX,
    PostgresNotFound,
    PostgresPermissionError,
)

from shardvault.local.minio import BINARY_ENV, MinioNotFound, start_minio
from shardvault.local.ports import port_open
from shardvault.local.postgres import init_instance


def test_minio_serves_objects_and_closes_its_port_on_stop(tmp_path_factory):
    root = tmp_path_factory.mktemp("minio")
    server = start_minio(root / "data")
    with server:
        assert server.secret_key not in repr(server)
        s3 = boto3.client(
            "s3",
            endpoint_url=server.endpoint,
            aws_access_key_id=server.access_key,
            aws_secret_access_key=server.secret_key,
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
        )
        s3.create_bucket(Bucket="servers")
        body = os.urandom(100_000)
        s3.put_object(Bucket="servers", Key="a/b.bin", Body=body)
        assert s3.get_object(Bucket="servers", Key="a/b.bin")["Body"].read() == body
    assert server.process.returncode is not None
    assert not port_open(server.port)
    assert server.log_path is not None
    assert server.secret_key not in server.log_path.read_text(errors="replace")


def test_each_minio_start_gets_its_own_secret(tmp_path_factory):
    root = tmp_path_factory.mktemp("minio2")
    with start_minio(root / "a") as first, start_minio(root / "b") as second:
        assert first.secret_key != second.secret_key
        assert first.port != second.port


def test_minio_not_found_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv(BINARY_ENV, str(tmp_path / "no-such-minio"))
    with pytest.raises(MinioNotFound, match=r"scripts/setup\.sh.*go install github\.com/minio"):
        start_minio(tmp_path / "data")


def test_postgres_instance_runs_sql_and_stops(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("pg") / "data"
    instance = init_instance(data_dir)
    socket = instance.socket_dir / f".s.PGSQL.{instance.port}"
    with instance:
        assert instance.is_running()
        assert instance.psql("SELECT 1") == "1"
        assert instance.psql("SELECT current_setting('data_checksums'), 1 + 1") == "on|2"
        assert instance.psql("SHOW wal_level") == "replica"
        assert instance.psql("SHOW listen_addresses") == ""
        assert socket.is_socket()
        assert f"port={instance.port}" in instance.conninfo
    assert not instance.is_running()
    assert not socket.exists()


def test_postgres_socket_moves_to_a_short_dir_when_the_path_is_too_long(tmp_path_factory):
    deep = tmp_path_factory.mktemp("pg-deep") / ("d" * 60) / ("e" * 60) / "data"
    with init_instance(deep) as instance:
        socket = instance.socket_dir / f".s.PGSQL.{instance.port}"
        assert len(os.fsencode(socket)) <= SOCKET_PATH_MAX
        assert instance.psql("SELECT 1") == "1"
    assert not instance.is_running()
    shutil.rmtree(instance.socket_dir, ignore_errors=True)  # the short dir lives in /tmp


def test_postgres_not_found_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv(BIN_ENV, str(tmp_path))
    with pytest.raises(PostgresNotFound, match=r"scripts/setup\.sh.*apt-get install postgresql-15"):
        init_instance(tmp_path / "data")


@pytest.mark.skipif(os.geteuid() != 0, reason="only root runs servers as another user")
def test_postgres_refuses_a_directory_its_user_cannot_reach(tmp_path):
    # A 0700 directory that is not ours (like /root is not the postgres user's) is reported,
    # not loosened.
    blocked = tmp_path / f"blocked-{uuid.uuid4().hex[:6]}"
    blocked.mkdir(mode=0o700)
    nobody = pwd.getpwnam("nobody")
    os.chown(blocked, nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(PostgresPermissionError, match=r"chmod o\+x"):
        init_instance(blocked / "data")
    assert oct(Path(blocked).stat().st_mode & 0o777) == oct(0o700)
