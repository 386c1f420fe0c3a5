"""Probe: each agent's round trip to the store, as ``shardvault check`` asks for it.

A backup's first part upload is the first time an agent meets the store: a firewall, a proxy,
a TLS trust store or an endpoint the node cannot resolve would fail the first night. The
probe state machine (``statemachines/probe.asl.json``) tries that path before: ``plan`` gives
each member agent a *probe* (a few bytes naming the node, a presigned PUT bound to their
CRC64NVME, as a part's URL is bound, and a presigned GET of the same object), the agent puts
and reads them back (its ``probe`` command) and ``finish`` deletes the objects and says, per
node, what the round trip found.

Probe objects live under the work prefix of the store's bucket (``_work/probes/<probe id>/``):
on AWS that is the staging bucket the backups go to. A probe whose execution died before
``finish`` leaves its objects; the next probe's ``plan`` deletes every probe object older than
a probe lives (``sweep_stale``), and on AWS the work lifecycle rule expires them as well.
"""

from __future__ import annotations

import base64
import os
import time
from typing import Any, Literal

from shardvault.assurance import copy_check
from shardvault.aws.services import Services
from shardvault.contracts.commands import Probed, parse_result
from shardvault.contracts.models import ClusterName, Frozen, new_backup_id
from shardvault.data.checksums import crc64nvme_of_bytes
from shardvault.errors import UnknownCluster
from shardvault.lifecycle import copies
from shardvault.workflow.causes import failure_cause
from shardvault.workflow.membership import claim_problem

PROBE_URL_TTL_SECONDS = 900  # the probe state machine's own timeout
PROBES_DIR = "probes"  # under the work prefix; the only keys the probe function may write
STALE_PROBE_SECONDS = PROBE_URL_TTL_SECONDS  # older than this, a probe object is a leftover


class ProbeRequest(Frozen):
    cluster: ClusterName


class ProbeStep(Frozen):
    """The probe function's input: ``plan`` from the request, ``finish`` with the results."""

    phase: Literal["plan", "finish"]
    request: dict[str, Any] = {}
    probe_id: str = ""
    results: list[dict[str, Any]] = []


def probes_prefix(svc: Services) -> str:
    return f"{svc.settings.work_prefix.rstrip('/')}/{PROBES_DIR}/"


def probe_key(svc: Services, probe_id: str, node_id: str) -> str:
    return f"{probes_prefix(svc)}{probe_id}/{node_id}"


def sweep_stale(svc: Services, now: float) -> list[str]:
    """Deletes the probe objects a probe that died before ``finish`` left (older than a probe
    lives); returns their keys."""
    stale = [
        o["Key"]
        for o in svc.store_bucket.objects(probes_prefix(svc))
        if o["LastModified"].timestamp() < now - STALE_PROBE_SECONDS
    ]
    for key in stale:
        svc.store_bucket.delete(key)
    return stale


def plan(request: ProbeRequest, svc: Services, now: float) -> dict[str, Any]:
    """Writes each member node's probe (bytes and URLs) to the work bucket; returns the nodes
    with the keys of their probes."""
    nodes = svc.nodes.in_cluster(request.cluster)
    policy = svc.policy()
    members = [
        n for n in nodes if policy is None or not claim_problem(request.cluster, n.node_id, policy)
    ]
    if not members:
        raise UnknownCluster(
            f"no member agent has registered for cluster {request.cluster!r}.",
            fix="start the cluster's agents (and list them under the cluster's 'nodes' in the "
            "policy, if it has such a list).",
        )
    sweep_stale(svc, now)
    probe_id = f"probe-{new_backup_id(now)}"
    bucket = svc.store_bucket
    out = []
    for node in members:
        key = probe_key(svc, probe_id, node.node_id)
        body = f"shardvault probe of {node.node_id}, {probe_id}\n".encode() + os.urandom(32)
        crc = crc64nvme_of_bytes(body)
        urls = {
            "body": base64.b64encode(body).decode(),
            "crc64nvme": crc,
            "put_url": bucket.presign_put(key, PROBE_URL_TTL_SECONDS, crc),
            "get_url": bucket.presign_get(key, PROBE_URL_TTL_SECONDS),
        }
        out.append({"node_id": node.node_id, "args_key": svc.put_urls(probe_id, key, urls)})
    return {"probe_id": probe_id, "nodes": out}


def finish(step: ProbeStep, svc: Services) -> dict[str, Any]:
    """Deletes the probe's objects (whatever each node managed) and reports each node: its
    round trip's seconds, or its error and cause (``shardvault.workflow.causes``)."""
    nodes = []
    for result in step.results:
        node_id = str(result["node_id"])
        key = probe_key(svc, step.probe_id, node_id)
        svc.store_bucket.delete(key)
        if error := result.get("error"):
            cause = failure_cause(error, svc, step.probe_id, [node_id])
            nodes.append(
                {"node_id": node_id, "ok": False, "error": error.get("Error"), "cause": cause}
            )
            continue
        probed = parse_result(Probed, node_id, result)
        seconds = {"put_seconds": probed.put_seconds, "get_seconds": probed.get_seconds}
        nodes.append({"node_id": node_id, "ok": True, **seconds})
    targets = copy_targets(step, svc, time.time())
    return {
        "probe_id": step.probe_id,
        "ok": all(n["ok"] for n in [*nodes, *targets]),
        "nodes": nodes,
        "targets": targets,
    }


def copy_targets(step: ProbeStep, svc: Services, now: float) -> list[dict[str, Any]]:
    """Each copy target of the cluster, tried as promotion will (``copy_check.check_target``)."""
    cluster = str(step.request.get("cluster", ""))
    return [
        copy_check.check_target(target, svc, step.probe_id, now, cluster)
        for target in copies.targets_of(svc, cluster)
    ]
