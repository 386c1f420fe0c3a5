"""Where the CLI learns its deployment: a deployed stack's outputs (``--stack``), a local
stack's ``stack.env``; an unreadable one is a one-line refusal, never a traceback."""

from __future__ import annotations

import os

import pytest

from shardvault.client import cli
from shardvault.client import operations as ops

OUTPUTS = {name: f"value-of-{name}" for name in ops.STACK_OUTPUTS}


class Described:
    def __init__(self, outputs: dict[str, str]) -> None:
        self.outputs = outputs
        self.asked: list[str] = []

    def describe_stacks(self, StackName: str) -> dict:
        self.asked.append(StackName)
        entries = [{"OutputKey": k, "OutputValue": v} for k, v in self.outputs.items()]
        return {"Stacks": [{"Outputs": entries}]}


def test_a_deployed_stacks_outputs_become_the_clis_settings(monkeypatch):
    for variable in ops.STACK_OUTPUTS.values():
        monkeypatch.delenv(variable, raising=False)
    cloudformation = Described(OUTPUTS)
    ops.load_stack_outputs("ShardVault-prod", cloudformation)
    assert cloudformation.asked == ["ShardVault-prod"]
    config = ops.ClientConfig.from_env()
    assert config.state_machine_arn == "value-of-BackupStateMachineArn"
    assert config.catalog_table == "value-of-CatalogTableName"
    assert config.drill_state_machine_arn == "value-of-DrillStateMachineArn"
    assert os.environ["SHARDVAULT_NODES_TABLE"] == "value-of-NodesTableName"


def test_a_stack_without_the_outputs_is_named():
    with pytest.raises(Exception, match=r"has no output Restore.*CatalogTableName"):
        ops.load_stack_outputs("Other", Described({"BackupStateMachineArn": "x"}))


@pytest.mark.parametrize("what", ["directory", "binary"])
def test_a_stack_env_that_is_not_one_is_refused_in_a_line(tmp_path, capsys, what):
    path = tmp_path / "stack.env"
    if what == "directory":
        path.mkdir()
    else:
        path.write_bytes(b"\x7fELF\x02\x01\xff\xfe\x00")
    assert cli.main(["list", "--stack-env", str(path)]) == cli.REFUSED
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert str(path) in err.splitlines()[0]  # whole, so it can be copied from the terminal
    assert "Fix" in err


def test_a_long_path_with_brackets_is_printed_whole_and_as_written(tmp_path, capsys):
    path = tmp_path / ("[bold]deployments-" + "x" * 120) / "stack.env"
    path.mkdir(parents=True)
    assert cli.main(["list", "--stack-env", str(path)]) == cli.REFUSED
    first = capsys.readouterr().err.splitlines()[0]
    assert str(path) in first


def test_a_policy_file_that_is_not_utf8_is_refused_in_a_line(tmp_path, capsys):
    policy = tmp_path / "p.yaml"
    policy.write_bytes(b"version: 1\nclusters: {\xff\xfe}\n")
    assert cli.main(["cost", "--policy", str(policy)]) == cli.REFUSED
    err = " ".join(capsys.readouterr().err.split())
    assert "Traceback" not in err
    assert "is not UTF-8" in err


def test_stack_and_stack_env_are_one_or_the_other(tmp_path):
    with pytest.raises(SystemExit):
        cli.main(["list", "--stack", "S", "--stack-env", str(tmp_path / "stack.env")])
