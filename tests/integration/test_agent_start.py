"""An agent that cannot reach its tables at start says why in one line, with the fix, and
exits 2: no region, no credentials, a table name that is not the stack's (the tables have
generated names on AWS), access denied. Not a traceback."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

from shardvault.local import demo

REPO = Path(__file__).resolve().parents[2]


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


def run_init(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardvault_agent.cli", "init", *args],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_init_writes_what_the_agent_needs_and_nothing_of_the_store(stack, tmp_path):
    """No table name typed by hand: the file init writes is all an agent needs to start, and
    it holds nothing of the store (agents hold no store credentials)."""
    out = tmp_path / "etc" / "agent.env"
    bare = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = run_init("--stack-env", str(stack.root / "stack.env"), "--out", str(out), env=bare)
    assert done.returncode == 0, done.stderr
    assert out.stat().st_mode & 0o777 == 0o640
    values = dict(line.split("=", 1) for line in out.read_text().splitlines() if "=" in line)
    assert values["SHARDVAULT_NODES_TABLE"] == stack.settings.nodes_table
    assert values["SHARDVAULT_INBOX_TABLE"] == stack.settings.inbox_table
    assert not [k for k in values if "STORE" in k]

    again = run_init("--stack-env", str(stack.root / "stack.env"), "--out", str(out), env=bare)
    assert "exists" in one_line_error(again)

    config = agent_config(tmp_path)
    node_id = yaml.safe_load(config.read_text())["node_id"]
    agent = subprocess.Popen(
        [sys.executable, "-m", "shardvault_agent.cli", "run", "--config", str(config)],
        env={**bare, **values}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while stack.services().nodes.get(node_id) is None:
            assert agent.poll() is None, agent.stderr.read() if agent.stderr else ""
            assert time.monotonic() < deadline, "the agent never registered"
            time.sleep(0.2)
    finally:
        agent.terminate()
        agent.wait(timeout=60)
    stack.services().nodes.remove(node_id)


def test_the_systemd_unit_is_valid_and_hardened(tmp_path):
    """systemd's own checks: the unit parses without a warning (its commands pointed at this
    checkout's agent), and its exposure stays in systemd's "OK" band."""
    agent = Path(sys.executable).with_name("shardvault-agent")
    unit = REPO / "agents" / "systemd" / "shardvault-agent.service"
    local = tmp_path / unit.name
    local.write_text(unit.read_text().replace("/opt/shardvault/bin/shardvault-agent", str(agent)))
    verify = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(local)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert verify.returncode == 0, verify.stderr
    assert verify.stderr.strip() == ""
    security = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", str(local)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    (level,) = re.findall(r"Overall exposure level for \S+: ([0-9.]+)", security.stdout)
    assert float(level) <= 4.0, security.stdout
    # The unit runs the commands the agent has.
    text = unit.read_text()
    assert "ExecStart=/opt/shardvault/bin/shardvault-agent run --config" in text
    assert "EnvironmentFile=/etc/shardvault/agent.env" in text
    assert "KillMode=process" in text  # restored servers outlive an agent restart
