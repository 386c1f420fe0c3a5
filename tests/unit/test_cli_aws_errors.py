"""The CLI meets AWS's configuration errors as one line on stderr with the fix and exit 3
(refused before anything started), not a traceback."""

from __future__ import annotations

import boto3
import pytest

from shardvault.client import cli


@pytest.fixture
def bare_aws(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setenv("SHARDVAULT_STATE_MACHINE_ARN", "arn:aws:states:eu-west-1:1:stateMachine:x")
    monkeypatch.setenv("SHARDVAULT_CATALOG_TABLE", "catalog")
    for name in ("AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)  # no credentials an earlier test found
    return monkeypatch


def aws_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "Traceback" not in captured.err
    text = " ".join(captured.err.split())
    assert text.startswith("AWS: ")
    assert "Fix: " in text
    return text


def test_no_region_is_one_line_with_its_fix(bare_aws, capsys) -> None:
    assert cli.main(["list"]) == cli.REFUSED
    assert "no AWS region is set" in aws_line(capsys)


def test_no_credentials_is_one_line_with_its_fix(bare_aws, capsys) -> None:
    bare_aws.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    assert cli.main(["list"]) == cli.REFUSED
    assert "no AWS credentials were found" in aws_line(capsys)
