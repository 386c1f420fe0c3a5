"""Named errors of ShardVault.

Every error a user or the state machine must tell apart has its own class. A Lambda's
``errorType`` is the class name, so the state machine retries transient errors and catches
terminal ones by name; an agent answers ``SendTaskFailure(error=<class name>)`` the same way.

Each error carries ``fix``: one sentence that tells the operator what to do about it.
"""

from __future__ import annotations


class ShardVaultError(Exception):
    """Base class: a message that names the problem, and a fix that names the remedy."""

    transient = False

    def __init__(self, message: str, *, fix: str = "") -> None:
        self.message = message
        self.fix = fix
        super().__init__(f"{message} Fix: {fix}" if fix else message)

    @property
    def name(self) -> str:
        return type(self).__name__


# --- Request validation (terminal; raised before any side effect) -----------------------------
class InvalidRequest(ShardVaultError):
    """The request itself is malformed (missing field, bad name, bad option)."""


class UnknownCluster(ShardVaultError):
    """No agent has registered for the cluster named in the request."""


class AgentUnavailable(ShardVaultError):
    """A node's agent has stopped or has not heartbeated recently."""


class AgentOutdated(ShardVaultError):
    """A node's agent speaks an older protocol than this control plane needs."""


class NoShards(ShardVaultError):
    """The cluster's agents hold no shards: a backup would succeed with nothing in it."""


class ShardWithoutLeader(ShardVaultError):
    """A shard has replicas but no healthy leader to read from."""


class ShardWithManyLeaders(ShardVaultError):
    """Several nodes claim leadership of one shard (split brain): refusing to pick one."""


class NotAMember(ShardVaultError):
    """An agent claims a cluster the deployment's policy does not give its node."""


class MixedEngines(ShardVaultError):
    """Nodes of one cluster report different database engines."""


class BackupAlreadyRunning(ShardVaultError):
    """Another backup of the same cluster is still running."""


class PlanTooLarge(ShardVaultError):
    """A requested part size would exceed a store limit (part count or size)."""


# --- Transfer and verification -----------------------------------------------------------------
class PresignedUrlExpired(ShardVaultError):
    """A part's presigned URL expired before the agent could use it: sign again."""

    transient = True


class PartUploadFailed(ShardVaultError):
    """A part could not be uploaded after the agent's per-part retries."""

    transient = True


class SourceChanged(ShardVaultError):
    """Bytes read for upload differ from the bytes whose checksum was signed."""


class ChecksumMismatch(ShardVaultError):
    """A stored object's checksum differs from the checksum the agent computed."""


class FrameUnreadable(ShardVaultError):
    """A stored frame does not open or decompress: damaged or tampered with in the store."""


class WrongKey(ShardVaultError):
    """The data key at hand is not the one the backup was encrypted with."""


class ParentUnavailable(ShardVaultError):
    """An incremental's parent backup is missing, failed, expired or cannot be continued."""


class KeyUnavailable(ShardVaultError):
    """KMS would not wrap or unwrap a backup's data key (permission, key state, context)."""


class UploadIncomplete(ShardVaultError):
    """Objects of a planned phase have no verified result (an upload task failed)."""


class AnswerMismatch(ShardVaultError):
    """An agent's answer in the work bucket is missing, too large, or not the one its task
    token vouched for (checksum, size or node)."""


# --- Agent-side --------------------------------------------------------------------------------
class EngineError(ShardVaultError):
    """The database engine refused a flush, checkpoint or release."""


class HookFailed(EngineError):
    """A command hook (the ``hooks`` engine) exited non-zero, or could not start."""


class HookTimedOut(EngineError):
    """A command hook ran past ``hooks.timeout_seconds`` and was killed."""


class HookOutputInvalid(EngineError):
    """A checkpoint hook printed something other than its JSON object."""


class CheckpointNotFound(ShardVaultError):
    """A command refers to a checkpoint this agent does not hold (e.g. after a restart)."""


class BackupReleased(CheckpointNotFound):
    """A command of a backup this node already released: the backup's failure path (or the
    reaper) ended it while the command waited or ran. A consequence of another failure, never
    its cause: the agent notes no cause for it."""


class UnknownCommand(ShardVaultError):
    """The inbox holds a command this agent version does not know."""


class ShardDataMissing(ShardVaultError):
    """A configured shard's data is not where the agent's configuration says: a missing or
    misspelled SQLite ``path`` or PostgreSQL ``data_dir``, a file or directory that holds no
    database, or a ``data_dir`` of another instance than the one ``conninfo`` reaches."""


class ShardNotReady(ShardVaultError):
    """A shard's engine cannot be backed up now (a setting, a privilege, a server that does
    not answer), as its agent reports it with each heartbeat."""


class SourceLogFull(ShardVaultError):
    """A backup held more of the source's write-ahead log than the policy allows, or the disk
    that holds it came near full: the backup fails and lets the log go before the disk fills."""


class ArchiveRefused(ShardVaultError):
    """The WAL archive function refused an agent's call, or could not be reached: the spool
    keeps the WAL until a later try succeeds."""


class WalNotArchived(ShardVaultError):
    """A backup whose tail refers to the WAL archive ended before the archive held that WAL
    (the server did not push it, or the agent could not store it, in time)."""


# --- Restore (validation errors are raised before any side effect) -----------------------------
class BackupNotFound(ShardVaultError):
    """The backup named for a restore is not in the catalog (or the cluster has none)."""


class DrillAlreadyRunning(ShardVaultError):
    """A restore drill of the cluster is still running (or keeping its copy up)."""


class BackupNotRestorable(ShardVaultError):
    """The backup exists but did not complete and verify (failed or still running)."""


class TargetOutOfRange(ShardVaultError):
    """A point-in-time restore's target is outside what the backups and the WAL archive can
    reach (before the oldest backup, past the archived WAL, or across a gap in it)."""


class TargetUnsupported(ShardVaultError):
    """A point-in-time target for an engine without a WAL archive (SQLite), or a replay that
    would re-create a tablespace made after its base."""


class EngineMismatch(ShardVaultError):
    """The target cluster runs another database engine than the backup's."""


class TargetNotReady(ShardVaultError):
    """A target node accepts no restores (no restore_dir in its agent config)."""


class TargetTooSmall(ShardVaultError):
    """The target nodes have too little room for the shards placed on them."""


class TargetNotEmpty(ShardVaultError):
    """A target node already holds data where a shard would be restored."""


class PartDownloadFailed(ShardVaultError):
    """A part could not be downloaded after the agent's per-part retries."""

    transient = True


class StoreObjectDamaged(ShardVaultError):
    """The store cannot serve an object's bytes (it cuts every read at the same byte, as MinIO
    does when its own checksums find bitrot): retrying never helps."""


class RestoreWriteFailed(ShardVaultError):
    """A target node could not write restored bytes to its disk (other than a full disk,
    which is ``TargetTooSmall``)."""


class ManifestDamaged(ShardVaultError):
    """A backup's manifest is in the store but cannot be read as a manifest."""


class DownloadIncomplete(ShardVaultError):
    """A shard is asked to finish while some of its objects are not downloaded."""


class RestoreValidationFailed(ShardVaultError):
    """A restored shard failed its engine checks or a validation query."""


class BackupDamaged(ShardVaultError):
    """Verification found a backup (or an ancestor it needs) missing objects, or holding
    objects other than its manifest says."""


# --- Vault ---------------------------------------------------------------------------------------
class PromotionFailed(ShardVaultError):
    """A verified backup could not be copied into the vault (it stays in the store)."""


class ExpiryFailed(ShardVaultError):
    """The store refused to delete some objects of an expiring backup."""


# What AWS answers an identity that may not do something, or whose credentials are not valid
# (the CLI and the agent's start each say so in one line, with their own fix).
AWS_DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "AccessDeniedException",
        "UnrecognizedClientException",
        "InvalidClientTokenId",
        "ExpiredTokenException",
    }
)
