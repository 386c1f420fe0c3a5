"""Agents and control planes of different releases.

An agent registers the *agent protocol* it speaks (``NodeRecord.protocol``). A control plane
that needs a newer one (``AGENT_PROTOCOL``) refuses backups and restores on that node by name
(``AgentOutdated``) before anything is written, instead of letting a command fail mid-backup;
``shardvault check`` says so too. The other way round, a registry item from a newer agent, with
fields this release does not know, is read rather than refused.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import shardvault_agent
from shardvault_agent import daemon

from shardvault import backup
from shardvault.assurance.readiness import findings
from shardvault.aws.services import Services
from shardvault.aws.tables import dynamo
from shardvault.backup import cuts
from shardvault.backup.cuts import CUT_PROTOCOL
from shardvault.contracts.models import (
    AGENT_PROTOCOL,
    BackupRequest,
    Engine,
    NodeRecord,
    ShardInfo,
)
from shardvault.errors import AgentOutdated
from shardvault.restore.admission import check_target_nodes

from .support import leader_node, moto_services, sqlite_agent
from .test_readiness import POLICY  # cluster a: sqlite, one daily full

OLD = 0  # what the registry holds for an agent released before agents said their protocol


@pytest.fixture
def svc(monkeypatch: pytest.MonkeyPatch) -> Iterator[Services]:
    with moto_services(monkeypatch) as services:
        yield services


def outdated(cluster: str, now: float) -> NodeRecord:
    return leader_node(cluster, now).model_copy(update={"protocol": OLD, "version": "0.0.9"})


def test_this_agent_registers_the_protocol_this_control_plane_needs(svc, tmp_path) -> None:
    agent = daemon.Agent(sqlite_agent(tmp_path), nodes_table="n", inbox_table="i")
    assert agent.record().protocol == shardvault_agent.PROTOCOL == CUT_PROTOCOL
    assert shardvault_agent.PROTOCOL >= AGENT_PROTOCOL  # a cut needs more than a backup


def test_a_cut_on_an_agent_before_cuts_is_refused_by_name_and_writes_nothing(svc) -> None:
    archived = ShardInfo(shard_id="s1", role="leader", wal_spool_bytes=0)
    old = {"protocol": CUT_PROTOCOL - 1, "engine": Engine.POSTGRES, "shards": [archived]}
    svc.nodes.put(outdated("c", time.time()).model_copy(update=old))
    with pytest.raises(AgentOutdated) as refused:
        cuts.plan(cuts.CutClusterRequest(cluster="c"), svc, time.time())
    assert f"needs agent protocol {CUT_PROTOCOL}" in refused.value.message
    assert "Backups and restores still run" in refused.value.fix
    assert svc.catalog.cuts("c") == []


def test_a_backup_on_an_outdated_agent_is_refused_by_name_before_anything_is_written(
    svc,
) -> None:
    now = time.time()
    svc.nodes.put(outdated("c", now))
    request = BackupRequest(cluster="c", execution_id="x")
    with pytest.raises(AgentOutdated) as refused:
        backup.validate(request, svc, now)
    assert "c-n1 (agent 0.0.9, protocol 0)" in refused.value.message
    assert f"needs agent protocol {AGENT_PROTOCOL}" in refused.value.message
    assert "upgrade shardvault-agent" in refused.value.fix
    assert svc.catalog.lock_holder("c") is None
    assert svc.catalog.backups("c") == []


def test_a_current_agent_is_not_refused(svc) -> None:
    now = time.time()
    svc.nodes.put(leader_node("c", now))
    context = backup.validate(BackupRequest(cluster="c", execution_id="x"), svc, now)
    assert [s.node_id for s in context.sources] == ["c-n1"]


def test_a_restore_onto_an_outdated_agent_is_refused_by_name() -> None:
    now = time.time()
    target = outdated("t", now).model_copy(update={"restore_free_bytes": 1 << 30})
    with pytest.raises(AgentOutdated, match="t-n1"):
        check_target_nodes("t", [target], None, now, 30)


def test_check_names_the_outdated_agent() -> None:
    now = time.time()
    found = {f.check: f for f in findings("a", [outdated("a", now)], [], POLICY, now, 30)}
    assert not found["agents current"].ok
    assert "a-n1 (agent 0.0.9, protocol 0)" in found["agents current"].detail
    assert found["agents up"].ok


def test_a_newer_agents_registry_item_is_read_not_refused(svc) -> None:
    now = time.time()
    item = leader_node("c", now).model_dump(mode="json")
    item["shards"][0]["read_rate_hint"] = 7  # fields of a later release
    svc.nodes.table.put_item(Item=dynamo({**item, "capabilities": ["x"]}))
    (read,) = svc.nodes.in_cluster("c")
    assert read.node_id == "c-n1"
    assert svc.nodes.get("c-n1") == read
