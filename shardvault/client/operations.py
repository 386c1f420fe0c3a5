"""What the CLI does, as plain functions: start a backup, follow it, list and show backups.

They talk to Step Functions and the catalog only, so they work the same against AWS and the
local stack; which one is chosen by ``ClientConfig`` (from the environment or ``stack.env``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3

from shardvault.assurance.drills import DrillRequest
from shardvault.aws.stack_outputs import stack_variables
from shardvault.aws.tables import Catalog, NodeRegistry, table
from shardvault.backup.admission import registered_nodes
from shardvault.contracts.catalog import (
    ArchiveTotals,
    BackupItem,
    CatalogItem,
    CutItem,
    DrillItem,
    Outcome,
    RestoreItem,
)
from shardvault.contracts.models import BackupRequest, BackupStatus, NodeRecord, RestoreRequest
from shardvault.errors import BackupNotFound, InvalidRequest
from shardvault.workflow.causes import readable_cause

TERMINAL = {"SUCCEEDED", "FAILED", "TIMED_OUT", "ABORTED"}
# How long a node may be silent and still count as live for ``nodes --remove`` (the stack's
# own heartbeat_max_age_seconds default).
LIVE_NODE_SECONDS = 30.0


@dataclass(frozen=True)
class ClientConfig:
    state_machine_arn: str
    catalog_table: str
    nodes_table: str = "shardvault-nodes"
    restore_state_machine_arn: str = ""
    retention_state_machine_arn: str = ""
    verify_state_machine_arn: str = ""
    probe_state_machine_arn: str = ""
    drill_state_machine_arn: str = ""
    cut_state_machine_arn: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> ClientConfig:
        missing = [
            k
            for k in ("SHARDVAULT_STATE_MACHINE_ARN", "SHARDVAULT_CATALOG_TABLE")
            if not env.get(k)
        ]
        if missing:
            raise InvalidRequest(
                f"{', '.join(missing)} not set.",
                fix="pass --stack ShardVault (a deployed stack's name) for AWS, or --stack-env "
                "local-stack/stack.env for the local stack.",
            )
        return cls(
            env["SHARDVAULT_STATE_MACHINE_ARN"],
            env["SHARDVAULT_CATALOG_TABLE"],
            env.get("SHARDVAULT_NODES_TABLE", "shardvault-nodes"),
            env.get("SHARDVAULT_RESTORE_STATE_MACHINE_ARN", ""),
            env.get("SHARDVAULT_RETENTION_STATE_MACHINE_ARN", ""),
            env.get("SHARDVAULT_VERIFY_STATE_MACHINE_ARN", ""),
            env.get("SHARDVAULT_PROBE_STATE_MACHINE_ARN", ""),
            env.get("SHARDVAULT_DRILL_STATE_MACHINE_ARN", ""),
            env.get("SHARDVAULT_CUT_STATE_MACHINE_ARN", ""),
        )


# How the CLI's clients are made: with the caller's credentials, as they come; run inside
# the local stack's process (the demo), bound by its IAM gate to the operator's policy, so that
# the demo's calls are judged as a CLI's in another shell are (``act_as``).
def as_they_come(client: Any) -> Any:
    return client


CLIENTS: dict[str, Callable[[Any], Any]] = {"bind": as_they_come}


def act_as(bind: Callable[[Any], Any] | None) -> None:
    """Makes the CLI's clients through ``bind`` from now on (None: as they come)."""
    CLIENTS["bind"] = bind or as_they_come


def _client(service: str) -> Any:
    return CLIENTS["bind"](boto3.client(service))


def _table(name: str) -> Any:
    dynamo_table = table(name)
    CLIENTS["bind"](dynamo_table.meta.client)
    return dynamo_table


def load_env_file(path: Path) -> None:
    """Loads ``KEY=value`` lines (a local stack's ``stack.env``) into the environment."""
    fix = "pass the stack.env that 'shardvault local up' wrote in its --dir (local-stack/)."
    if not path.exists():
        raise InvalidRequest(
            f"{path} does not exist.", fix="start the local stack first ('shardvault local up')."
        )
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise InvalidRequest(f"{path} cannot be read: {error.strerror}.", fix=fix) from None
    except UnicodeDecodeError:
        raise InvalidRequest(f"{path} is not a text file.", fix=fix) from None
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            os.environ[key] = value


# A deployed stack's output -> the variable the CLI reads (``--stack``).
STACK_OUTPUTS = {
    "BackupStateMachineArn": "SHARDVAULT_STATE_MACHINE_ARN",
    "RestoreStateMachineArn": "SHARDVAULT_RESTORE_STATE_MACHINE_ARN",
    "RetentionStateMachineArn": "SHARDVAULT_RETENTION_STATE_MACHINE_ARN",
    "VerifyStateMachineArn": "SHARDVAULT_VERIFY_STATE_MACHINE_ARN",
    "ProbeStateMachineArn": "SHARDVAULT_PROBE_STATE_MACHINE_ARN",
    "DrillStateMachineArn": "SHARDVAULT_DRILL_STATE_MACHINE_ARN",
    "CutStateMachineArn": "SHARDVAULT_CUT_STATE_MACHINE_ARN",
    "CatalogTableName": "SHARDVAULT_CATALOG_TABLE",
    "NodesTableName": "SHARDVAULT_NODES_TABLE",
}


def load_stack_outputs(stack: str, cloudformation: Any = None) -> dict[str, str]:
    """Sets the CLI's variables from a deployed stack's outputs (CloudFormation
    ``DescribeStacks``, in the configured region); returns them."""
    values = stack_variables(stack, STACK_OUTPUTS, cloudformation or boto3.client("cloudformation"))
    os.environ.update(values)
    return values


@dataclass
class Progress:
    status: str
    bytes_done: int = 0
    bytes_total: int = 0
    objects_done: int = 0
    objects_total: int = 0
    refused: bool = False  # failed at the workflow's validation, before any side effect
    record: dict[str, Any] | None = None
    error: str = ""
    cause: str = ""


def check_cluster(config: ClientConfig, cluster: str) -> None:
    """Refuses a cluster no agent has registered for (``UnknownCluster``), as the backup's
    Validate step would, before an execution starts: a script learns it from the exit status."""
    registered_nodes(NodeRegistry(_table(config.nodes_table)), cluster)


def check_drill(config: ClientConfig, cluster: str, target: str | None) -> None:
    """Refuses, before an execution starts, the drills the catalog alone shows cannot run (as
    the drill's StartDrill step would, later): a cluster without a complete backup to restore,
    a target that is itself backed up (a drill removes what it restored there)."""
    catalog = Catalog(_table(config.catalog_table))
    if catalog.newest_backup(cluster, BackupStatus.COMPLETE) is None:
        raise BackupNotFound(
            f"cluster {cluster!r} has no complete backup to drill.",
            fix="check the cluster name ('shardvault list'), or run a backup first.",
        )
    if target is not None and (target == cluster or catalog.backups(target)):
        raise InvalidRequest(
            f"a drill of {cluster!r} cannot restore into {target!r}: that cluster is backed "
            "up, and a drill removes what it restored there.",
            fix=f"drill into a cluster of drill nodes only (e.g. '{cluster}-drill').",
        )


def start_execution(machine_arn: str, machine: str, prefix: str, payload: dict[str, Any]) -> str:
    """Starts an execution of one of the stack's state machines (``machine``: BACKUP, RESTORE,
    RETENTION, VERIFY, PROBE, DRILL, CUT), named ``<prefix>-<time>-<random>``; a machine the
    configuration does not name is refused with the variable and the stack output that give
    it."""
    if not machine_arn:
        infix = "" if machine == "BACKUP" else f"{machine}_"
        variable = f"SHARDVAULT_{infix}STATE_MACHINE_ARN"
        raise InvalidRequest(
            f"{variable} is not set.",
            fix=f"set it from the ShardVault stack's {machine.title()}StateMachineArn output, "
            "or pass --stack-env for the local stack.",
        )
    name = f"{prefix}-{time.strftime('%Y%m%dT%H%M%S')}-{os.urandom(2).hex()}"[:80]
    return _client("stepfunctions").start_execution(
        stateMachineArn=machine_arn, name=name, input=json.dumps(payload)
    )["executionArn"]


def run_to_end(execution_arn: str, timeout: float) -> Progress:
    """Waits for an execution that keeps no catalog progress (retention, verify, probe)."""
    return wait_for(
        lambda: execution_progress(execution_arn, "", lambda _: []), lambda _: None, 0.5, timeout
    )


# The states each workflow fails in when it refuses a request before any side effect.
REFUSING_STATES = frozenset({"RequestRejected", "DrillRefused"})


def refused(execution_arn: str) -> bool:
    """Whether a failed execution ended in one of ``REFUSING_STATES`` (the CLI then exits 3,
    as for a refusal it makes itself)."""
    return any(
        event.get("type") == "FailStateEntered"
        and event.get("stateEnteredEventDetails", {}).get("name") in REFUSING_STATES
        for event in execution_history(execution_arn)
    )


def exit_status(outcome: Progress) -> int:
    """0 done, 3 refused before anything started, 1 ran and failed (docs/reference/cli.md)."""
    if outcome.status == "SUCCEEDED":
        return 0
    return 3 if outcome.refused else 1


def execution_history(execution_arn: str) -> list[dict[str, Any]]:
    """Every event of an execution's history, across pages."""
    sfn = _client("stepfunctions")
    events: list[dict[str, Any]] = []
    kwargs: dict[str, Any] = {"executionArn": execution_arn, "maxResults": 1000}
    while True:
        page = sfn.get_execution_history(**kwargs)
        events += page["events"]
        if "nextToken" not in page:
            return events
        kwargs["nextToken"] = page["nextToken"]


def start_backup(config: ClientConfig, request: BackupRequest) -> str:
    payload = request.model_dump(exclude_none=True, exclude={"execution_id"})
    return start_execution(config.state_machine_arn, "BACKUP", request.cluster, payload)


def backup_progress(config: ClientConfig, execution_arn: str) -> Progress:
    """The backup's state: the execution's status, and bytes and objects uploaded so far from
    its catalog record (merged with the summary once it succeeded)."""
    catalog = Catalog(_table(config.catalog_table))
    return execution_progress(execution_arn, "cluster", catalog.backups)


def execution_progress(
    execution_arn: str, cluster_field: str, records: Callable[[str], Sequence[CatalogItem]]
) -> Progress:
    """An execution's status and output (or error), with the counts of the catalog record
    it wrote: ``records(cluster)`` lists the records of the cluster its input names."""
    sfn = _client("stepfunctions")
    execution = sfn.describe_execution(executionArn=execution_arn)
    progress = Progress(status=execution["status"])
    if execution["status"] == "SUCCEEDED":
        progress.record = json.loads(execution.get("output") or "{}")
    elif execution["status"] in TERMINAL:
        progress.error = execution.get("error", "")
        progress.cause = readable_cause(execution.get("cause", ""))
        progress.refused = execution["status"] == "FAILED" and refused(execution_arn)
    request = json.loads(execution.get("input") or "{}")
    cluster = request.get(cluster_field, "") if isinstance(request, dict) else ""
    record = next(
        (
            r
            for r in (records(cluster) if cluster else [])
            if isinstance(r, Outcome | DrillItem) and r.execution_id == execution_arn
        ),
        None,
    )
    if record:
        progress.record = {**as_row(record), **(progress.record or {})}
        if isinstance(record, Outcome):
            progress.bytes_done, progress.bytes_total = record.bytes_done, record.bytes_total or 0
            progress.objects_done = record.objects_done
            progress.objects_total = record.objects_total or 0
        if progress.status in TERMINAL and record.status in ("FAILED", "failed"):
            # The failure path's cause: it names silent agents and carries an agent's cause
            # where the execution's lost it (shardvault.workflow.causes).
            progress.error = progress.error or record.error or ""
            progress.cause = record.cause or progress.cause
    return progress


def as_row(item: CatalogItem) -> dict[str, Any]:
    """A catalog item as the CLI prints it (``--json``, tables): JSON types, unset fields
    left out."""
    return item.stored()


def wait_backup(
    config: ClientConfig,
    execution_arn: str,
    on_progress: Callable[[Progress], None] = lambda _: None,
    interval: float = 0.5,
    timeout: float = 3600,
) -> Progress:
    return wait_for(lambda: backup_progress(config, execution_arn), on_progress, interval, timeout)


def wait_for(
    poll: Callable[[], Progress],
    on_progress: Callable[[Progress], None],
    interval: float,
    timeout: float,
) -> Progress:
    """Polls until the execution ends (or ``timeout`` passes: its progress then is running)."""
    deadline = time.monotonic() + timeout
    while True:
        progress = poll()
        on_progress(progress)
        if progress.status in TERMINAL or time.monotonic() > deadline:
            return progress
        time.sleep(interval)


def list_backups(config: ClientConfig, cluster: str | None) -> list[BackupItem]:
    catalog = Catalog(_table(config.catalog_table))
    records = catalog.backups(cluster) if cluster else catalog.all_backups()
    return sorted(records, key=lambda r: (r.cluster, r.backup_id))


def archive_totals(config: ClientConfig, cluster: str) -> ArchiveTotals | None:
    """The cluster's WAL archive counters (``Catalog.count_archived``); None: never archived."""
    return Catalog(_table(config.catalog_table)).archive_totals(cluster)


def list_nodes(config: ClientConfig, cluster: str | None) -> list[NodeRecord]:
    registry = NodeRegistry(_table(config.nodes_table))
    clusters = [cluster] if cluster else registry.clusters()
    return [node for name in clusters for node in registry.in_cluster(name)]


def remove_node(
    config: ClientConfig, node_id: str, *, force: bool = False, now: float | None = None
) -> NodeRecord:
    """Forgets a decommissioned node, so validation stops waiting for its agent. A node whose
    agent is up and heartbeating is refused (it would register again at its next heartbeat,
    and a running backup or restore would lose it) unless ``force``."""
    registry = NodeRegistry(_table(config.nodes_table))
    node = registry.get(node_id)
    if node is None:
        raise InvalidRequest(
            f"no node {node_id} is registered.", fix="list nodes with 'shardvault nodes'."
        )
    now = time.time() if now is None else now
    if not force and not node.is_unavailable(now, LIVE_NODE_SECONDS):
        raise InvalidRequest(
            f"node {node_id}'s agent is up (it heartbeated {now - node.heartbeat_at:.0f} s ago).",
            fix="stop the agent on that node first (it then says it stopped), or pass --force.",
        )
    registry.remove(node_id)
    return node


def show_backup(config: ClientConfig, cluster: str, backup_id: str) -> BackupItem:
    record = Catalog(_table(config.catalog_table)).get(cluster, backup_id)
    if record is None:
        raise InvalidRequest(
            f"no backup {backup_id} of cluster {cluster}.",
            fix="list backups with 'shardvault list'.",
        )
    return record


# --- restore -------------------------------------------------------------------------------------
def start_restore(config: ClientConfig, request: RestoreRequest) -> str:
    payload = request.model_dump(mode="json", exclude={"execution_id"})
    return start_execution(
        config.restore_state_machine_arn, "RESTORE", request.target_cluster, payload
    )


def restore_progress(config: ClientConfig, execution_arn: str) -> Progress:
    """The restore's state: the execution's status, and bytes and objects downloaded so far
    from its catalog record (``record`` once it succeeded: the summary, or the plan)."""
    catalog = Catalog(_table(config.catalog_table))
    return execution_progress(execution_arn, "target_cluster", catalog.restores)


def wait_restore(
    config: ClientConfig,
    execution_arn: str,
    on_progress: Callable[[Progress], None] = lambda _: None,
    interval: float = 0.5,
    timeout: float = 3600,
) -> Progress:
    return wait_for(lambda: restore_progress(config, execution_arn), on_progress, interval, timeout)


def list_restores(config: ClientConfig, cluster: str) -> list[RestoreItem]:
    return Catalog(_table(config.catalog_table)).restores(cluster)


# --- drills --------------------------------------------------------------------------------------
def start_drill(config: ClientConfig, request: DrillRequest) -> str:
    """Starts a restore drill."""
    payload = request.model_dump(mode="json", exclude_none=True)
    return start_execution(
        config.drill_state_machine_arn, "DRILL", f"drill-{request.cluster}", payload
    )


def drill_progress(config: ClientConfig, execution_arn: str) -> Progress:
    """The drill's state: the execution's status, and its catalog record (``drill#<id>``)."""
    catalog = Catalog(_table(config.catalog_table))
    return execution_progress(execution_arn, "cluster", catalog.drills)


def wait_drill(
    config: ClientConfig,
    execution_arn: str,
    on_progress: Callable[[Progress], None] = lambda _: None,
    interval: float = 0.5,
    timeout: float = 7 * 24 * 3600,
) -> Progress:
    return wait_for(lambda: drill_progress(config, execution_arn), on_progress, interval, timeout)


def list_drills(config: ClientConfig, cluster: str) -> list[DrillItem]:
    """The cluster's drills, newest first."""
    drills = Catalog(_table(config.catalog_table)).drills(cluster)
    return sorted(drills, key=lambda r: r.started_at, reverse=True)


# --- scheduled cuts ------------------------------------------------------------------------------
def start_cut(config: ClientConfig, cluster: str, requested_by: str) -> str:
    """Starts a cluster-wide cut (``shardvault.backup.cuts``)."""
    payload = {"cluster": cluster, "requested_by": requested_by}
    return start_execution(config.cut_state_machine_arn, "CUT", f"cut-{cluster}", payload)


def wait_cut(config: ClientConfig, execution_arn: str, timeout: float = 900) -> Progress:
    """Waits for a cut; its record is the cut's catalog item (the execution's output)."""
    return run_to_end(execution_arn, timeout)


def list_cuts(config: ClientConfig, cluster: str) -> list[CutItem]:
    """The cluster's cuts, newest first."""
    cuts = Catalog(_table(config.catalog_table)).cuts(cluster)
    return sorted(cuts, key=lambda c: c.instant, reverse=True)


# --- retention -----------------------------------------------------------------------------------
def run_retention(
    config: ClientConfig, cluster: str | None, dry_run: bool, timeout: float = 3600
) -> Progress:
    """Runs the retention state machine (one cluster or all) and waits for its decision."""
    payload = {"dry_run": dry_run, **({"cluster": cluster} if cluster else {})}
    arn = start_execution(config.retention_state_machine_arn, "RETENTION", "retention", payload)
    return run_to_end(arn, timeout)


# --- verify ------------------------------------------------------------------------------------
def run_verify(
    config: ClientConfig,
    cluster: str,
    backup_id: str,
    read_data_percent: float,
    timeout: float = 3600,
    from_vault: str | None = None,
) -> Progress:
    """Runs the verify state machine on one backup (and its chain) and waits for it;
    ``from_vault``: in that copy target."""
    payload: dict[str, Any] = {
        "cluster": cluster,
        "backup_id": backup_id,
        "read_data_percent": read_data_percent,
    }
    if from_vault is not None:
        payload["from_vault"] = from_vault
    arn = start_execution(config.verify_state_machine_arn, "VERIFY", f"verify-{cluster}", payload)
    return run_to_end(arn, timeout)


# --- check -------------------------------------------------------------------------------------
def check_readiness(
    config: ClientConfig, cluster: str, policy: Any, probe: bool = True
) -> list[Any]:
    """``shardvault check``: the cluster's findings (``shardvault.assurance.readiness``), from the
    registry and the catalog as they are now; with ``probe``, then each agent's round trip to
    the store (the probe state machine)."""
    from shardvault.assurance.readiness import (
        drill_findings,
        findings,
        probe_findings,
        probe_not_run,
    )
    from shardvault.config.settings import Settings

    registry, catalog = (
        NodeRegistry(_table(config.nodes_table)),
        Catalog(_table(config.catalog_table)),
    )
    nodes = registry.in_cluster(cluster)
    records = catalog.backups(cluster)
    max_age = Settings.model_fields["heartbeat_max_age_seconds"].default
    now = time.time()
    found = findings(cluster, nodes, records, policy, now, max_age)
    if nodes:  # an unknown cluster has nothing more to check
        spec = policy.clusters[cluster].drill if policy and cluster in policy.clusters else None
        target = registry.in_cluster(spec.target_cluster) if spec else []
        found += drill_findings(cluster, policy, catalog.drills(cluster), target, now, max_age)
    if not probe or not nodes:
        return found
    if not config.probe_state_machine_arn:
        return [*found, probe_not_run()]
    return found + probe_findings(run_probe(config, cluster))


def run_probe(config: ClientConfig, cluster: str, timeout: float = 900) -> Progress:
    """Runs the probe state machine (``shardvault.assurance.probe``) and waits for it."""
    arn = start_execution(
        config.probe_state_machine_arn, "PROBE", f"probe-{cluster}", {"cluster": cluster}
    )
    return run_to_end(arn, timeout)
