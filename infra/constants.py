"""Names the CDK app and its tests share: paths, key prefixes, function specs, placeholders.

A *function spec* is what differs between the Lambda functions (module, timeout,
memory); everything else about them is common. A *placeholder* is a ``${Name}`` in the state
machine's ASL file, filled by ``definition_substitutions``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
STATE_MACHINES_DIR = REPO_ROOT / "statemachines"
BACKUP_ASL = STATE_MACHINES_DIR / "backup.asl.json"
RESTORE_ASL = STATE_MACHINES_DIR / "restore.asl.json"
RETENTION_ASL = STATE_MACHINES_DIR / "retention.asl.json"
VERIFY_ASL = STATE_MACHINES_DIR / "verify.asl.json"
PROBE_ASL = STATE_MACHINES_DIR / "probe.asl.json"
DRILL_ASL = STATE_MACHINES_DIR / "drill.asl.json"
CUT_ASL = STATE_MACHINES_DIR / "cut.asl.json"
# The deployment's policy file (CDK context ``policy`` overrides): clusters, schedules, vault.
DEFAULT_POLICY = REPO_ROOT / "examples" / "shardvault.yaml"
LAMBDA_REQUIREMENTS = REPO_ROOT / "requirements-lambda.txt"
# What the Lambda code asset copies from the repository (the handlers import both).
LAMBDA_SOURCE_DIRS = ("shardvault", "functions")

STACK_NAME = "ShardVault"  # the default (CDK context stackName: another stack in the account)


def state_machine_name(stack_name: str, workflow: str) -> str:
    """A state machine's name, fixed so that roles can name its executions without
    referencing it (a reference would close a cycle: the state machine references the
    functions), and the stack's own, so that two stacks share an account and region."""
    return f"{stack_name}-{workflow}"


# The default stack's names (the local stack and the tests use them).
BACKUP_STATE_MACHINE_NAME = state_machine_name(STACK_NAME, "backup")
RESTORE_STATE_MACHINE_NAME = state_machine_name(STACK_NAME, "restore")
RETENTION_STATE_MACHINE_NAME = state_machine_name(STACK_NAME, "retention")
VERIFY_STATE_MACHINE_NAME = state_machine_name(STACK_NAME, "verify")
PROBE_STATE_MACHINE_NAME = state_machine_name(STACK_NAME, "probe")
DRILL_STATE_MACHINE_NAME = state_machine_name(STACK_NAME, "drill")
CUT_STATE_MACHINE_NAME = state_machine_name(STACK_NAME, "cut")

WORK_PREFIX = "_work/"  # control objects: plans, listings, per-object results
BACKUPS_PREFIX = "backups/"  # backup data and manifests (STORE_URL points here)

POWERTOOLS_SERVICE_NAME = "shardvault"
POWERTOOLS_METRICS_NAMESPACE = "ShardVault"

# The agents' managed policy says so in its description (IAM names are CloudFormation's: unique
# per stack, so that two stacks share an account).
AGENT_POLICY_DESCRIPTION = (
    "ShardVault agent: its own inbox items, node record and doorbell, task answers, backup "
    "statuses."
)
# The principal tag that names an agent's node; DynamoDB LeadingKeys must equal it.
NODE_ID_TAG = "shardvault:node_id"
CLUSTER_TAG = "shardvault:cluster"  # on a node role: the cluster whose data keys it unwraps
# Set on a staging object once its backup is in the vault; lifecycle expires tagged objects.
PROMOTED_TAG = "shardvault:promoted"


@dataclass(frozen=True)
class FunctionSpec:
    """One Lambda function: ``functions/<module>.py`` holds its ``lambda_handler``."""

    module: str
    placeholder: str | None  # the ASL placeholder that receives its ARN (None: not in an ASL)
    timeout_seconds: int = 60
    memory_mb: int = 512

    @property
    def handler(self) -> str:
        return f"functions/{self.module}.lambda_handler"


FUNCTIONS: tuple[FunctionSpec, ...] = (
    FunctionSpec("validate_backup", "ValidateBackupFunctionArn"),
    FunctionSpec("dispatch", "DispatchFunctionArn"),
    FunctionSpec("plan_backup", "PlanBackupFunctionArn"),
    FunctionSpec("prepare_scan", "PrepareScanFunctionArn"),
    # After each per-node Distributed Map: the first node's own error
    # (shardvault/workflow/fanout.py).
    FunctionSpec("check_nodes", "CheckNodesFunctionArn"),
    FunctionSpec("sign_parts", "SignPartsFunctionArn"),
    # These read objects back when an attribute check cannot verify them: more time.
    FunctionSpec("complete_upload", "CompleteUploadFunctionArn", 300, 1024),
    # After the data phase's Upload map: verifies the objects signed at plan, names any
    # object that was not uploaded and verified. Finalize does the same after the tail's.
    FunctionSpec("check_uploads", "CheckUploadsFunctionArn", 300, 1024),
    FunctionSpec("finalize_backup", "FinalizeBackupFunctionArn", 300, 1024),
    # A synthesized full's copies of its chain, for up to promote_budget_seconds per call.
    FunctionSpec("synthesize_full", "SynthesizeFullFunctionArn", 900, 1024),
    FunctionSpec("cleanup_backup", "CleanupBackupFunctionArn"),
    # Promotion copies for up to 10 minutes per call (promote_budget_seconds), then returns.
    FunctionSpec("promote_backup", "PromoteBackupFunctionArn", 900, 1024),
    FunctionSpec("record_promotion_failure", "RecordPromotionFailureFunctionArn"),
    FunctionSpec("validate_restore", "ValidateRestoreFunctionArn"),
    FunctionSpec("plan_restore", "PlanRestoreFunctionArn", 120),
    # Heads every object of the backup (and asks archived ones to thaw).
    FunctionSpec("thaw_objects", "ThawObjectsFunctionArn", 300),
    # After a restore's Prepare map: the first node's error, or an agent too old to prefetch.
    FunctionSpec("check_prepared", "CheckPreparedFunctionArn"),
    FunctionSpec("sign_download", "SignDownloadFunctionArn"),
    FunctionSpec("record_download", "RecordDownloadFunctionArn"),
    FunctionSpec("finalize_restore", "FinalizeRestoreFunctionArn"),
    FunctionSpec("cleanup_restore", "CleanupRestoreFunctionArn"),
    FunctionSpec("decide_retention", "DecideRetentionFunctionArn", 120),
    # Deletes every version of a backup's objects in batches of 1,000 keys.
    FunctionSpec("expire_backup", "ExpireBackupFunctionArn", 900),
    # Daily: aborts uploads and deletes partial objects no running backup owns.
    FunctionSpec("sweep_store", "SweepStoreFunctionArn", 900),
    # Heads every object of a backup's chain, reads a sample back (shardvault/assurance/verify.py).
    FunctionSpec("verify_backup", "VerifyBackupFunctionArn", 900, 1024),
    # shardvault check: each agent's round trip to the store (shardvault/assurance/probe.py).
    FunctionSpec("probe_store", "ProbeStoreFunctionArn"),
    # Restore drills (shardvault/assurance/drills.py): start, verdict and RTO, what was torn down.
    FunctionSpec("start_drill", "StartDrillFunctionArn"),
    FunctionSpec("record_drill", "RecordDrillFunctionArn"),
    FunctionSpec("note_teardown", "NoteTeardownFunctionArn"),
    # Scheduled cuts (shardvault/backup/cuts.py): plan the cut, record its restore points.
    FunctionSpec("cut_cluster", "CutClusterFunctionArn"),
    # Run by an EventBridge rule when a backup execution is aborted or times out.
    FunctionSpec("reap_execution", None, 300),
    # Run every WATCH_MINUTES by an EventBridge rule: backup ages and silent agents.
    FunctionSpec("watch_clusters", None, 120),
    # Invoked by the agents themselves: continuous WAL archiving (shardvault/wal/archive.py).
    FunctionSpec("archive_wal", None),
)

WORK_BUCKET_PLACEHOLDER = "WorkBucket"
# A state machine another one starts as a nested execution (the drill starts restores).
RESTORE_MACHINE_PLACEHOLDER = "RestoreStateMachineArn"
SUBSTITUTION_KEYS: frozenset[str] = frozenset(
    {spec.placeholder for spec in FUNCTIONS if spec.placeholder}
    | {WORK_BUCKET_PLACEHOLDER, RESTORE_MACHINE_PLACEHOLDER}
)
