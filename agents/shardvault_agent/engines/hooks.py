"""Command hooks: any other store, through commands its operator names (a YugabyteDB
``yb-admin create_snapshot``, a Cassandra ``nodetool snapshot``, an LVM or file-system snapshot
of a block device mounted read-only, a copy of a RocksDB-style directory of immutable files).

Terms:
- *hook*: a command in the agent's configuration (``hooks``), an argument list run without a
  shell, with the shard's facts in its environment: ``SHARDVAULT_SHARD_ID``,
  ``SHARDVAULT_BACKUP_ID``, ``SHARDVAULT_DATA_DIR`` (the shard's ``data_dir``) and, for the
  restore hooks, ``SHARDVAULT_RESTORED_DIR``. Nothing from a request reaches a hook but the
  backup's id, which is a checked name.
- *checkpoint hook*: fixes a consistent set of files and prints one JSON object on its standard
  output: ``{"directory": "/path/to/files", "marker": {"name": "value", ...}}``; the directory
  (a snapshot, a mount of one, a checkpoint of hard links) must not change until the release
  hook runs. The marker (strings) is recorded with the backup.
- *release hook*: gives back what the checkpoint held (deletes the snapshot, unmounts it);
  it runs after the backup, after a failed checkpoint, and again for a checkpoint an agent
  restart left held, so it must be safe to run twice.
- *finish hook* (optional): run on a restored shard's directory; exit 0 means the copy passed.

A hook that exits non-zero is ``HookFailed`` (its exit code and the last lines of its standard
error), one that runs past ``hooks.timeout_seconds`` is killed with its whole process group
(``HookTimedOut``), a checkpoint hook whose output is not the JSON above is
``HookOutputInvalid``: each names the hook and the fix, and a failed checkpoint is released.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from shardvault.contracts.cut import CutRequest
from shardvault.errors import (
    CheckpointNotFound,
    HookFailed,
    HookOutputInvalid,
    HookTimedOut,
    ShardDataMissing,
    ShardVaultError,
)
from shardvault_agent.config import AgentConfig, HookCommands, ShardConfig
from shardvault_agent.engines.base import (
    Capture,
    CopySource,
    Finishing,
    NoServer,
    list_tree,
    size_or_zero,
    tree_bytes,
)
from shardvault_agent.statefiles import write_json

log = logging.getLogger("shardvault.agent.hooks")
HOOKS_FIX = "correct the command in the agent config's 'hooks', or the store it acts on"


class HooksAdapter(NoServer, CopySource):
    """The copy is what the checkpoint hook names (held: ``<state_dir>/hooks/<backup>/``)."""

    copies = "hooks"
    shard_fields = ("data_dir",)
    config_fields = ("hooks",)
    fsyncs_restored_files = False  # nothing is known of the store's own durability
    checkpoint_flushes = False  # the operator's flush hook may do anything

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.hooks: HookCommands = config.hooks or HookCommands()

    # --- backup ----------------------------------------------------------------------------
    def check(self, shard: ShardConfig) -> None:
        if shard.data_dir is None or not shard.data_dir.is_dir():
            raise ShardDataMissing(
                f"shard {shard.shard_id}: data_dir {shard.data_dir} is not a directory.",
                fix="correct 'data_dir' in the agent config: the directory the hooks act on.",
            )

    def check_ready(self, shard: ShardConfig) -> None:
        """``check``, and every configured hook a program this agent may run: a backup is
        refused by name before a hook that cannot start is reached."""
        self.check(shard)
        for name in ("flush", "checkpoint", "release", "finish"):
            command = getattr(self.hooks, name)
            if command and not os.access(command[0], os.X_OK):
                raise HookFailed(
                    f"the {name} hook's program {command[0]} does not exist or is not "
                    "executable by the agent's user.",
                    fix=f"{HOOKS_FIX}: install the program, or chmod +x it",
                )

    def shard_bytes(self, shard: ShardConfig) -> int:
        return size_or_zero(self, shard, lambda: tree_bytes(shard.data_dir))

    def flush(self, shard: ShardConfig) -> None:
        if self.hooks.flush:
            self._run("flush", self.hooks.flush, shard)

    def _held(self, backup_id: str, shard: ShardConfig) -> Path:
        """What a checkpoint holds, kept across agent restarts (the hook's JSON)."""
        return self.config.state_dir / "hooks" / backup_id / f"{shard.shard_id}.json"

    def checkpoint(
        self, shard: ShardConfig, backup_id: str, work_dir: Path, *, log_archived: bool = False
    ) -> Capture:
        self.check(shard)
        held = self._held(backup_id, shard)
        # Noted before the hook runs: a checkpoint that fails or dies halfway is released.
        write_json(held, {"directory": None})
        try:
            output = self._run("checkpoint", self.hooks.checkpoint, shard, backup_id=backup_id)
            directory, marker = checkpoint_output(output)
            write_json(held, {"directory": str(directory), "marker": marker})
            files = list_tree(directory)
        except BaseException:
            try:
                self.release(shard, backup_id)
            except ShardVaultError as error:  # the checkpoint's error is the one to report
                log.warning("release after a failed checkpoint failed (kept for later): %s", error)
            raise
        return Capture(root=directory, files=files, marker=marker, mutable=False)

    def holds(self, shard: ShardConfig, backup_id: str) -> bool:
        held = self._held(backup_id, shard)
        return held.exists() and json.loads(held.read_text()).get("directory") is not None

    def stop(
        self, shard: ShardConfig, backup_id: str, work_dir: Path, cut: CutRequest | None = None
    ) -> Capture:
        if not self.holds(shard, backup_id):
            raise CheckpointNotFound(
                f"no checkpoint of shard {shard.shard_id} for backup {backup_id}.",
                fix="retry the backup.",
            )
        directory = json.loads(self._held(backup_id, shard).read_text())["directory"]
        return Capture(root=Path(directory), files=[])  # no tail, no cut: the hook's point

    def release(self, shard: ShardConfig, backup_id: str) -> None:
        held = self._held(backup_id, shard)
        if not held.exists():
            return
        if self.hooks.release:
            self._run("release", self.hooks.release, shard, backup_id=backup_id)
        held.unlink()
        with contextlib.suppress(OSError):  # the backup's directory, once its last shard left
            held.parent.rmdir()

    def finish(self, job: Finishing) -> dict[str, Any]:
        checks = {}
        if self.hooks.finish:
            shard = ShardConfig(shard_id=job.shard_id, data_dir=job.root)
            try:
                self._run("finish", self.hooks.finish, shard, restored=job.root)
                checks["finish hook"] = "ok"
            except (HookFailed, HookTimedOut) as error:
                checks["finish hook"] = error.message
        return {
            "shard_id": job.shard_id,
            "node_id": self.config.node_id,
            "path": str(job.root),
            "checks": checks,
            "checks_passed": all(v == "ok" for v in checks.values()),
        }

    def adoptable(self, shard_id: str, result: dict[str, Any]) -> dict[str, Any]:
        return {"shard_id": shard_id, "data_dir": result["path"]}

    # --- running a hook --------------------------------------------------------------------
    def _run(
        self,
        name: str,
        command: list[str],
        shard: ShardConfig,
        *,
        backup_id: str = "",
        restored: Path | None = None,
    ) -> str:
        env = os.environ | {
            "SHARDVAULT_SHARD_ID": shard.shard_id,
            "SHARDVAULT_BACKUP_ID": backup_id,
            "SHARDVAULT_DATA_DIR": str(shard.data_dir or ""),
            "SHARDVAULT_RESTORED_DIR": str(restored or ""),
        }
        return run_hook(name, command, env, self.hooks.timeout_seconds, shard.shard_id)


def run_hook(
    name: str, command: list[str], env: dict[str, str], timeout: float, shard_id: str
) -> str:
    """Runs one hook in a process group of its own; returns its standard output."""
    where = f"the {name} hook of shard {shard_id} ({Path(command[0]).name})"
    try:
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd="/",
            start_new_session=True,  # its children are killed with it on a timeout
        )
    except OSError as error:
        raise HookFailed(f"{where} could not start: {error}.", fix=HOOKS_FIX) from None
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise HookTimedOut(
            f"{where} ran longer than {timeout:g} s and was killed.",
            fix=f"{HOOKS_FIX}; or raise hooks.timeout_seconds if it needs longer.",
        ) from None
    if process.returncode != 0:
        tail = " | ".join(err.strip().splitlines()[-5:]) or "(no standard error)"
        raise HookFailed(f"{where} exited with {process.returncode}: {tail}", fix=HOOKS_FIX)
    return out


def checkpoint_output(output: str) -> tuple[Path, dict[str, str]]:
    """The checkpoint hook's JSON: an existing directory, and a marker of string values."""
    fix = (
        'the checkpoint hook must print one JSON object: {"directory": "/absolute/path", '
        '"marker": {"name": "value"}}, and nothing else, on its standard output'
    )
    try:
        found = json.loads(output)
    except ValueError:
        raise HookOutputInvalid(
            f"the checkpoint hook printed {shorten(output)!r}, which is not JSON.", fix=fix
        ) from None
    if not isinstance(found, dict) or not isinstance(found.get("directory"), str):
        raise HookOutputInvalid(
            f"the checkpoint hook printed {shorten(output)!r}, which names no directory.",
            fix=fix,
        )
    directory = Path(found["directory"])
    if not directory.is_absolute() or not directory.is_dir():
        raise HookOutputInvalid(
            f"the checkpoint hook named {directory}, which is not an absolute path of a directory.",
            fix=fix,
        )
    marker = found.get("marker", {})
    if not isinstance(marker, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in marker.items()
    ):
        raise HookOutputInvalid("the checkpoint hook's marker is not names and strings.", fix=fix)
    return directory, marker


def shorten(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
