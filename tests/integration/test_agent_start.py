"""An agent that cannot reach its tables at start says why in one line, with the fix, and
exits 2: no region, no credentials, a table name that is not the stack's (the tables have
generated names on AWS), access denied. Not a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from shardvault.local import demo


def agent_config(tmp_path: Path) -> Path:
    (config,) = demo.restore_targets(tmp_path, name="start", engine="sqlite", nodes=1)
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_agent(config: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardvault_agent.cli", "run", "--config", str(config), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("error: ")]
    assert "Fix: " in line
    assert "botocore" not in result.stderr  # the SDK's chatter is not the agent's log
    return line


def test_a_table_that_is_not_the_stacks_is_named(stack, tmp_path):
    env = stack.agent_env()
    result = run_agent(agent_config(tmp_path), env, "--nodes-table", "shardvault-nodes-typo")
    line = one_line_error(result)
    assert "does not exist" in line
    assert "'shardvault-nodes-typo'" in line
    assert "--nodes-table" in line


def test_no_region_and_no_credentials_are_named(stack, tmp_path):
    config = agent_config(tmp_path)
    bare = {
        k: v
        for k, v in stack.agent_env().items()
        if not k.startswith("AWS_") or k == "AWS_ENDPOINT_URL"
    }
    bare |= {"AWS_CONFIG_FILE": "/nonexistent", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent"}
    bare["AWS_EC2_METADATA_DISABLED"] = "true"  # no instance profile to wait for here
    assert "no AWS region" in one_line_error(run_agent(config, bare))
    assert "no AWS credentials" in one_line_error(
        run_agent(config, bare | {"AWS_DEFAULT_REGION": "us-east-1"})
    )
