"""``shardvault-agent init`` reads the agent's tables from the stack's outputs, refuses a stack
that lacks them, and says in one line when the stack cannot be read."""

from __future__ import annotations

import os

import boto3
import pytest
from botocore.stub import Stubber
from shardvault_agent import bootstrap
from shardvault_agent.bootstrap import write_env_file
from shardvault_agent.cli import main

from shardvault.errors import InvalidRequest

OUTPUTS = {
    "NodesTableName": "ShardVault-TablesNodes-1A2B",
    "InboxTableName": "ShardVault-TablesInbox-3C4D",
    "CatalogTableName": "ShardVault-TablesCatalog-5E6F",
    "ArchiveFunctionName": "ShardVault-ArchiveWal-7A8B",
    "VaultBucketName": "shardvault-vault-xyz",
}


def described(outputs: dict[str, str]) -> dict:
    return {
        "Stacks": [
            {
                "StackName": "ShardVault",
                "CreationTime": "2026-11-24T00:00:00Z",
                "StackStatus": "CREATE_COMPLETE",
                "Outputs": [{"OutputKey": k, "OutputValue": v} for k, v in outputs.items()],
            }
        ]
    }


def test_the_tables_and_region_come_from_the_stacks_outputs() -> None:
    client = boto3.client("cloudformation", region_name="eu-west-3")
    with Stubber(client) as stub:
        stub.add_response("describe_stacks", described(OUTPUTS), {"StackName": "ShardVault"})
        values = bootstrap.from_stack("ShardVault", client)
    assert values == {
        "SHARDVAULT_NODES_TABLE": "ShardVault-TablesNodes-1A2B",
        "SHARDVAULT_INBOX_TABLE": "ShardVault-TablesInbox-3C4D",
        "SHARDVAULT_CATALOG_TABLE": "ShardVault-TablesCatalog-5E6F",
        "SHARDVAULT_ARCHIVE_FUNCTION": "ShardVault-ArchiveWal-7A8B",
        "AWS_DEFAULT_REGION": "eu-west-3",
    }


def test_a_stack_without_the_outputs_is_refused_by_name() -> None:
    client = boto3.client("cloudformation", region_name="eu-west-3")
    with Stubber(client) as stub:
        stub.add_response("describe_stacks", described({"Other": "x"}), {"StackName": "Web"})
        with pytest.raises(InvalidRequest, match="has no output NodesTableName"):
            bootstrap.from_stack("Web", client)


def test_a_missing_stack_is_one_line_with_its_fix(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    client = boto3.client("cloudformation")
    stub = Stubber(client)
    stub.add_client_error("describe_stacks", "ValidationError", "Stack with id Nope does not exist")
    stub.activate()
    monkeypatch.setattr(bootstrap.boto3, "client", lambda *_a, **_k: client)
    assert main(["init", "--stack", "Nope", "--out", str(tmp_path / "agent.env")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: no stack 'Nope' in this region. Fix: ")
    assert not (tmp_path / "agent.env").exists()


def test_run_and_check_read_the_file_init_wrote_and_the_environment_wins(
    tmp_path, monkeypatch
) -> None:
    from shardvault_agent.cli import load_env_file

    written = tmp_path / "agent.env"
    write_env_file(written, {"SHARDVAULT_NODES_TABLE": "nodes-x", "SHARDVAULT_INBOX_TABLE": "in-x"})
    monkeypatch.delenv("SHARDVAULT_NODES_TABLE", raising=False)
    monkeypatch.setenv("SHARDVAULT_INBOX_TABLE", "set-by-hand")

    assert load_env_file(["run", "--config", "a.yaml", "--env-file", str(written)]) is None
    assert os.environ["SHARDVAULT_NODES_TABLE"] == "nodes-x"
    assert os.environ["SHARDVAULT_INBOX_TABLE"] == "set-by-hand"


def test_an_env_file_named_but_unreadable_is_refused_with_its_fix(tmp_path, capsys) -> None:
    missing = tmp_path / "nope.env"
    assert main(["check", "--config", "a.yaml", "--env-file", str(missing)]) == 2
    assert "shardvault-agent init --out" in capsys.readouterr().err
    binary = tmp_path / "binary.env"
    binary.write_bytes(b"\xff\xfe\x00")
    assert main(["run", "--config", "a.yaml", "--env-file", str(binary)]) == 2
    assert "cannot be read" in capsys.readouterr().err
