"""A store reached only through command hooks (the README's directory-checkpoint example, run
as it is documented): two nodes backed up, restored into one node and checked by the finish
hook; an incremental uploads only the new files' blocks; a checkpoint hook that fails ends the
backup by name and leaves nothing held."""

from __future__ import annotations

import os
from pathlib import Path

from shardvault.local import demo

from .conftest import FAST_AGENT, Cluster, names, output

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "hooks" / "directory-checkpoint"


def hooks(program: Path) -> dict[str, list[str] | float]:
    return {
        "checkpoint": [str(program), "checkpoint"],
        "release": [str(program), "release"],
        "finish": [str(program), "finish"],
        "timeout_seconds": 30,
    }


def store(root: Path, files: int) -> Path:
    """A directory of immutable files, as an LSM store writes them."""
    root.mkdir(parents=True)
    for n in range(files):
        (root / f"{n:06d}.sst").write_bytes(os.urandom(64 * 1024))
    (root / "CURRENT").write_text("MANIFEST-000001\n")
    return root


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def hooks_cluster(stack, tmp_path: Path, program: Path) -> Cluster:
    name = f"hooks{next(names)}"
    configs, sources = [], {}
    for i in (1, 2):
        shard_id = f"shard-{i}"
        sources[shard_id] = store(tmp_path / "stores" / f"node-{i}", files=8 * i)
        shard = {"shard_id": shard_id, "role": "leader", "data_dir": str(sources[shard_id])}
        config = demo.agent_config(tmp_path, name, f"{name}-node-{i}", "hooks", [shard])
        configs.append(config | FAST_AGENT | {"hooks": hooks(program)})
    env = {"SNAPSHOT_ROOT": str(tmp_path / "snapshots")}
    for config in configs:
        stack.start_agent(config, env)
    stack.wait_for_nodes([c["node_id"] for c in configs])
    return Cluster(stack, name, tmp_path, configs, sources)


def test_a_store_behind_hooks_backs_up_restores_and_sends_only_new_files(
    stack, tmp_path, make_target
):
    cluster = hooks_cluster(stack, tmp_path, EXAMPLE)
    try:
        full = cluster.backup()
        assert full.status == "SUCCEEDED", full.cause
        at_full = {s: tree(p) for s, p in cluster.sources.items()}
        new = cluster.sources["shard-1"] / "000100.sst"
        new.write_bytes(os.urandom(256 * 1024))
        incremental = cluster.backup(incremental=True)
        assert incremental.status == "SUCCEEDED", incremental.cause
        assert not list((tmp_path / "snapshots").rglob("*.sst"))  # every release ran

        records = {r["backup_id"]: r for r in cluster.records()}
        sent = records[incremental.record["backup_id"]]["data_bytes"]
        assert 256 * 1024 <= sent < 2 * 256 * 1024  # the new file, not the 1.5 MiB before it

        target = make_target(nodes=1, engine="hooks", agent={"hooks": hooks(EXAMPLE)})
        for backup, expected in (
            (full, at_full),
            (incremental, {s: tree(p) for s, p in cluster.sources.items()}),
        ):
            restored = target.restore(
                cluster.name, backup_id=backup.record["backup_id"], replace=True
            )
            assert restored.status == "SUCCEEDED", restored.cause
            for shard in output(restored)["shards"]:
                assert shard["checks"] == {"finish hook": "ok"}
                assert tree(Path(shard["path"])) == expected[shard["shard_id"]]
    finally:
        cluster.stop()


def test_a_failing_checkpoint_hook_fails_the_backup_by_name_and_holds_nothing(stack, tmp_path):
    failing = tmp_path / "failing-hook"
    failing.write_text(
        f'#!/bin/sh\n[ "$1" = checkpoint ] || exec {EXAMPLE} "$@"\n'
        "echo 'snapshot quota exceeded' >&2\nexit 3\n"
    )
    failing.chmod(0o755)
    cluster = hooks_cluster(stack, tmp_path, failing)
    try:
        progress = cluster.backup()
        assert progress.status == "FAILED"
        assert progress.error == "HookFailed", progress.cause
        assert "quota exceeded" in progress.cause
        assert cluster.held_checkpoints() == []
        held = [p for c in cluster.configs for p in (Path(c["state_dir"]) / "hooks").glob("*")]
        assert held == []
    finally:
        cluster.stop()
