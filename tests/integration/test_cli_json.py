"""``--json`` on the read commands gives scripts one JSON document on stdout: the catalog's
record of each backup with what the table shows computed (bytes read and stored, an
incremental's share of its full), and the registered nodes."""

from __future__ import annotations

import json

import pytest
import shardvault_agent

from shardvault.contracts.models import Manifest
from shardvault.data.frames import unpack_frames

from .conftest import run_cli

pytestmark = pytest.mark.minio


def cli_json(stack, *args: str):
    done = run_cli(stack, *args, "--json", columns=40)  # narrow: JSON must not wrap
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_list_show_and_nodes_print_json(make_cluster, policy_for):
    cluster = make_cluster(nodes=1, size_mb=2)
    policy_for(cluster.name)
    full_id, incr_id = cluster.full_then_incremental()

    listed = {r["backup_id"]: r for r in cli_json(cluster.stack, "list", cluster.name)}
    assert set(listed) == {full_id, incr_id}
    assert listed[full_id]["kind"] == "full"
    assert "share_of_full" not in listed[full_id]
    incr = listed[incr_id]
    assert (incr["kind"], incr["parent_id"], incr["depth"]) == ("incremental", full_id, 1)
    assert 0 < incr["stored_bytes"] < listed[full_id]["stored_bytes"]
    assert incr["share_of_full"] == incr["stored_bytes"] / listed[full_id]["stored_bytes"]
    assert incr["read_bytes"] >= incr["bytes"]
    records = {r["backup_id"]: r for r in cluster.records()}  # the catalog, read directly
    assert incr["status"] == records[incr_id]["status"] == "COMPLETE"

    shown = cli_json(cluster.stack, "show", cluster.name, incr_id)
    assert shown == incr

    (node,) = cli_json(cluster.stack, "nodes", cluster.name)
    assert node["node_id"] == cluster.configs[0]["node_id"]
    assert node["cluster"] == cluster.name
    assert node["protocol"] == shardvault_agent.PROTOCOL  # a running agent says what it speaks
    assert [s["shard_id"] for s in node["shards"]] == list(cluster.sources)


def test_show_counts_what_the_store_holds(make_cluster):
    cluster = make_cluster(nodes=1, size_mb=2)  # no vault: the backup stays in the store
    full_id, incr_id = cluster.full_then_incremental()
    keys = cluster.store_keys()
    for backup_id in (full_id, incr_id):
        done = run_cli(cluster.stack, "show", cluster.name, backup_id)
        assert done.returncode == 0, done.stderr
        (objects,) = [line for line in done.stdout.splitlines() if "+ 1 manifest" in line]
        stored = sum(backup_id in key for key in keys)
        assert f"= {stored} stored" in objects, (objects, stored)
        assert "none (each shard restores" in done.stdout  # SQLite: no cut, said so


def test_show_says_what_packing_cost_and_at_which_levels(make_cluster):
    """The full's packing CPU and frames per zstd level (``compression.level: auto``), as the
    manifest in the store records them: every frame of every object the agent packed is
    counted at one level, 1 or 3."""
    cluster = make_cluster(nodes=1, size_mb=4)
    full_id, _ = cluster.full_then_incremental()
    (shown,) = [
        r for r in cli_json(cluster.stack, "list", cluster.name) if r["backup_id"] == full_id
    ]
    stored = cluster.stack.services().store_bucket.get(shown["manifest_key"])
    manifest = Manifest.model_validate_json(stored["Body"].read())
    objects = [o for s in manifest.shards for stream in s.streams for o in stream.objects]
    objects += [s.blockmap for s in manifest.shards if s.blockmap]
    frames = sum(len(unpack_frames(o.frames)) for o in objects)
    assert frames > 0
    assert {int(k): v for k, v in shown["frame_levels"].items()} == manifest.frame_levels
    assert set(manifest.frame_levels or {}) <= {1, 3}
    assert sum((manifest.frame_levels or {}).values()) == frames
    assert 0 < shown["pack_cpu_seconds"] == manifest.pack_cpu_seconds

    done = run_cli(cluster.stack, "show", cluster.name, full_id)
    assert done.returncode == 0, done.stderr
    assert "packing CPU" in done.stdout
    assert "frames per zstd level" in done.stdout
