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
LAMBDA_REQUIREMENTS = REPO_ROOT / "requirements-lambda.txt"
# What the Lambda code asset copies from the repository (the handlers import both).
LAMBDA_SOURCE_DIRS = ("shardvault", "functions")

STACK_NAME = "ShardVault"
# Fixed so that roles can name the state machine's executions without referencing it
# (a reference would close a cycle: the state machine references the functions).
BACKUP_STATE_MACHINE_NAME = f"{STACK_NAME}-backup"

WORK_PREFIX = "_work/"  # control objects: plans, listings, per-object results
BACKUPS_PREFIX = "backups/"  # backup data and manifests (STORE_URL points here)

POWERTOOLS_SERVICE_NAME = "shardvault"
POWERTOOLS_METRICS_NAMESPACE = "ShardVault"

AGENT_POLICY_NAME = "ShardVaultAgentPolicy"
AGENT_ROLE_NAME = "ShardVaultAgentRole"
# The principal tag that names an agent's node; DynamoDB LeadingKeys must equal it.
NODE_ID_TAG = "shardvault:node_id"


@dataclass(frozen=True)
class FunctionSpec:
    """One Lambda function: ``functions/<module>.py`` holds its ``lambda_handler``."""

    module: str
    placeholder: str  # the ASL placeholder that receives its ARN
    timeout_seconds: int = 60
    memory_mb: int = 512

    @property
    def handler(self) -> str:
        return f"functions/{self.module}.lambda_handler"


FUNCTIONS: tuple[FunctionSpec, ...] = (
    FunctionSpec("validate_backup", "ValidateBackupFunctionArn"),
    FunctionSpec("dispatch", "DispatchFunctionArn"),
    FunctionSpec("plan_backup", "PlanBackupFunctionArn"),
    FunctionSpec("sign_parts", "SignPartsFunctionArn"),
    # These two read objects back when an attribute check cannot verify them: more time.
    FunctionSpec("complete_upload", "CompleteUploadFunctionArn", 300, 1024),
    # After each Upload map: names the objects that were not uploaded and verified.
    FunctionSpec("check_uploads", "CheckUploadsFunctionArn"),
    FunctionSpec("finalize_backup", "FinalizeBackupFunctionArn", 300),
    FunctionSpec("cleanup_backup", "CleanupBackupFunctionArn"),
)

WORK_BUCKET_PLACEHOLDER = "WorkBucket"
SUBSTITUTION_KEYS: frozenset[str] = frozenset(
    {spec.placeholder for spec in FUNCTIONS} | {WORK_BUCKET_PLACEHOLDER}
)
