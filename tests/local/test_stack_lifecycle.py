"""The local stack's processes live and die with it: ``shardvault local down`` stops a stack
that ``local up`` runs (MinIO with it), a second stack in the same directory is refused, and
a stack killed outright (SIGKILL: no handler runs) still takes MinIO and its agents with it.

What is left running is checked from outside, in /proc, by each process's command line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shardvault.local.stack import running_stack_pid

# A stack with one agent, as the demo and the tests run it, in the directory given.
STACK_WITH_AGENT = """
import sys, time
from pathlib import Path
from shardvault.local import demo
from shardvault.local.stack import LocalStack

root = Path(sys.argv[1])
stack = LocalStack(root, require_minio=True).start()
cluster = demo.sqlite_cluster(root, name="lifecycle", nodes=1, size_mb=1)
for config in cluster.agent_configs:
    stack.start_agent(config)
stack.wait_for_nodes([c["node_id"] for c in cluster.agent_configs])
print("ready", flush=True)
time.sleep(600)
"""


def command_lines() -> dict[int, list[str]]:
    """Every live process's argv (a zombie's is empty: it runs nothing)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:  # it ended meanwhile
                continue
            if argv[0]:
                found[int(entry.name)] = [a.decode(errors="replace") for a in argv if a]
    return found


def running_with(argument: str) -> list[int]:
    """Processes whose command line has ``argument`` (a data directory, a config file)."""
    return [pid for pid, argv in command_lines().items() if argument in argv]


def minio_of(root: Path) -> list[int]:
    return running_with(str(root / "minio"))


def agents_of(root: Path) -> list[int]:
    return [pid for path in (root / "agents").glob("*.yaml") for pid in running_with(str(path))]


def wait_until(done: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardvault.client.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env={**os.environ, "COLUMNS": "200"},
    )


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    """The stack's directory; whatever a failed test leaves running there is ended after it."""
    yield tmp_path / "stack"
    for pid in minio_of(tmp_path / "stack") + agents_of(tmp_path / "stack"):
        os.kill(pid, signal.SIGKILL)


def test_local_down_stops_the_stack_that_local_up_runs_and_its_minio(root: Path) -> None:
    log = root.parent / "up.log"
    with open(log, "wb") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "shardvault.client.cli", "local", "up", "--dir", str(root)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "COLUMNS": "200"},
        )
    try:
        wait_until(lambda: (root / "stack.env").exists() or up.poll() is not None, 120, "up")
        assert up.poll() is None, log.read_text()
        assert minio_of(root), "the stack runs no MinIO: it is required here"
        assert running_stack_pid(root) == up.pid

        second = cli("local", "up", "--dir", root)
        assert second.returncode == 3  # refused
        assert f"a local stack already runs in {root} (pid {up.pid})" in second.stderr
        assert "shardvault local down" in second.stderr
        assert minio_of(root), "the refused stack stopped the running one's MinIO"

        down = cli("local", "down", "--dir", root)
        assert down.returncode == 0, down.stdout + down.stderr
        assert f"(pid {up.pid}) stopped" in down.stdout
        assert up.wait(timeout=30) == 0
        assert "local stack stopped" in log.read_text()
        assert minio_of(root) == []
        assert not (root / "stack.pid").exists()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()

    again = cli("local", "down", "--dir", root)
    assert again.returncode == 3
    assert f"no local stack runs in {root}" in again.stderr


def test_a_killed_stack_takes_minio_and_its_agents_with_it(root: Path) -> None:
    stack = subprocess.Popen(
        [sys.executable, "-c", STACK_WITH_AGENT, str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert stack.stdout is not None
        assert stack.stdout.readline().strip() == "ready", stack.stdout.read()
        assert minio_of(root)
        assert agents_of(root)

        stack.send_signal(signal.SIGKILL)  # no handler, no atexit, no finally runs
        stack.wait(timeout=10)

        wait_until(lambda: not minio_of(root), 30, f"MinIO to stop: {minio_of(root)}")
        # Within seconds: the agent's last heartbeat to the gone control plane is tried once
        # (it took DynamoDB's ten tries, 25 s, before; the README says they die with it).
        # One fresh-clone CI run on this 2-core machine took just over 15 s: 30 s leaves room.
        wait_until(lambda: not agents_of(root), 30, f"agents to stop: {agents_of(root)}")
        assert running_stack_pid(root) is None  # the directory is free for a new stack
    finally:
        if stack.poll() is None:
            stack.kill()
            stack.wait()
