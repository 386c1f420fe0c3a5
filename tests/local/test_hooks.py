"""The command-hook engine runs real programs: a hook that fails, one that hangs past its
timeout (with a child of its own) and one that prints garbage each end as a named error, and
nothing is left held: the release hook ran, the agent's state holds no checkpoint, and no hook
process is left running."""

from __future__ import annotations

import json
import stat
import sys
import time
from pathlib import Path

import pytest
from shardvault_agent.config import AgentConfig, ShardConfig
from shardvault_agent.engines.hooks import HooksAdapter

from shardvault.errors import HookFailed, HookOutputInvalid, HookTimedOut


def script(path: Path, body: str) -> list[str]:
    path.write_text(f"#!{sys.executable}\nimport json, os, sys, time, pathlib\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return [str(path)]


@pytest.fixture
def node(tmp_path: Path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "000001.sst").write_bytes(b"sst" * 1000)
    released = tmp_path / "released"

    def adapter(checkpoint_body: str, timeout: float = 30, release_fails: bool = False):
        record = (
            f"pathlib.Path({str(released)!r}).open('a').write("
            "os.environ['SHARDVAULT_BACKUP_ID'] + '\\n')"
        )
        hooks = {
            "checkpoint": script(tmp_path / "checkpoint", checkpoint_body),
            "release": script(tmp_path / "release", "sys.exit(4)" if release_fails else record),
            "timeout_seconds": timeout,
        }
        config = AgentConfig(
            node_id="n1",
            cluster="c",
            engine="hooks",
            hooks=hooks,
            shards=[ShardConfig(shard_id="s1", data_dir=data)],
            state_dir=tmp_path / "state",
        )
        return HooksAdapter(config)

    return adapter, released, tmp_path


def nothing_held(adapter: HooksAdapter, released: Path) -> None:
    assert adapter.held_backups() == set()
    assert released.read_text().splitlines() == ["b1"]  # the release hook ran, once


def test_a_checkpoint_hook_names_a_directory_and_a_marker(node):
    make, released, tmp_path = node
    snapshot = tmp_path / "snap"
    adapter = make(
        f"snap = pathlib.Path({str(snapshot)!r}); snap.mkdir()\n"
        "os.link(pathlib.Path(os.environ['SHARDVAULT_DATA_DIR']) / '000001.sst', "
        "snap / '000001.sst')\n"
        "print(json.dumps({'directory': str(snap), 'marker': {'seq': '42'}}))"
    )
    shard = adapter.config.shards[0]
    capture = adapter.checkpoint(shard, "b1", tmp_path / "work")
    assert capture.root == snapshot
    assert [f.path for f in capture.files] == ["000001.sst"]
    assert capture.marker == {"seq": "42"}
    assert adapter.held_backups() == {"b1"}
    assert adapter.stop(shard, "b1", tmp_path / "work").files == []
    adapter.release(shard, "b1")
    nothing_held(adapter, released)


def test_a_failing_hook_is_named_with_its_exit_code_and_stderr(node):
    make, released, tmp_path = node
    adapter = make("sys.stderr.write('snapshot quota exceeded\\n'); sys.exit(3)")
    with pytest.raises(HookFailed, match=r"checkpoint hook of shard s1.*exited with 3.*quota"):
        adapter.checkpoint(adapter.config.shards[0], "b1", tmp_path / "work")
    nothing_held(adapter, released)


def test_a_hook_past_its_timeout_is_killed_with_its_children(node):
    make, released, tmp_path = node
    pids = tmp_path / "pids"
    adapter = make(
        "import subprocess\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"pathlib.Path({str(pids)!r}).write_text(f'{{os.getpid()}} {{child.pid}}')\n"
        "time.sleep(600)",
        timeout=1,
    )
    started = time.monotonic()
    with pytest.raises(HookTimedOut, match="longer than 1 s"):
        adapter.checkpoint(adapter.config.shards[0], "b1", tmp_path / "work")
    assert time.monotonic() - started < 30
    nothing_held(adapter, released)
    time.sleep(0.2)
    for pid in map(int, pids.read_text().split()):
        assert not running(pid), pid


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # PID 1 here may not reap: a zombie is not running


@pytest.mark.parametrize(
    ("output", "why"),
    [
        ("snapshot done", "not JSON"),
        (json.dumps({"marker": {}}), "names no directory"),
        (json.dumps({"directory": "relative/dir"}), "not an absolute path"),
        (json.dumps({"directory": "/nonexistent/dir"}), "not an absolute path of a directory"),
        (json.dumps({"directory": "/", "marker": {"seq": 42}}), "marker is not"),
    ],
)
def test_garbage_from_a_checkpoint_hook_is_named(node, output, why):
    make, released, tmp_path = node
    adapter = make(f"print({output!r})")
    with pytest.raises(HookOutputInvalid, match=why):
        adapter.checkpoint(adapter.config.shards[0], "b1", tmp_path / "work")
    nothing_held(adapter, released)


def test_hooks_are_absolute_programs_and_required(tmp_path):
    base = {"node_id": "n1", "cluster": "c", "shards": [], "state_dir": str(tmp_path)}
    with pytest.raises(ValueError, match=r"hooks agents need hooks\.checkpoint and hooks\.release"):
        AgentConfig(engine="hooks", **base)
    with pytest.raises(ValueError, match="not an absolute path"):
        AgentConfig(
            engine="hooks", hooks={"checkpoint": ["snap"], "release": ["/bin/true"]}, **base
        )


def test_a_hook_that_cannot_run_is_reported_before_any_backup(node, tmp_path):
    make, released, _ = node
    adapter = make("print('{}')")
    shard = adapter.config.shards[0]
    adapter.check_ready(shard)
    (tmp_path / "release").chmod(0o644)
    with pytest.raises(HookFailed, match=r"release hook's program .* not executable"):
        adapter.check_ready(shard)
    assert not released.exists()


def test_a_release_that_fails_after_a_failed_checkpoint_is_kept_for_later(node, tmp_path):
    make, _, _ = node
    adapter = make("sys.exit(3)", release_fails=True)
    with pytest.raises(HookFailed, match=r"checkpoint hook .* exited with 3"):
        adapter.checkpoint(adapter.config.shards[0], "b1", tmp_path / "work")
    assert adapter.held_backups() == {"b1"}  # a starting agent's reconcile releases it again
