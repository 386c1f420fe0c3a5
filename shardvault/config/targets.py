"""A cluster's vault copies: the places beside the stack's own vault that each verified backup
is also copied to (docs/design/vault-targets.md).

Terms:
- *target*: one place a verified backup lands, named in the policy. The stack's own vault
  (``vault``, named ``stack`` unless ``vault.name`` says otherwise) is always one; each entry
  of ``vault.copies`` is another:
  - ``gcs``: a Google Cloud Storage bucket in class NEARLINE, COLDLINE or ARCHIVE, every
    object under a Locked retention, reached through workload identity federation;
  - ``aws``: an S3 bucket with Object Lock in *another AWS account* (account B), every object
    locked in COMPLIANCE mode and encrypted under B's own KMS key, reached through a role in B
    that the promote function assumes with an external ID (``shardvault.aws.copy_target``).
- *recovery key*: for a cluster whose frames are sealed (``encryption: kms``), a KMS key in
  account B (``recovery_key``) that the copy's manifest wraps each data key under instead of
  the stack's, so that restoring the copy never needs the stack account's key
  (``shardvault.aws.keys``); or ``stack_key_only: true``, which accepts that it does.
- *selection*: which backups a copy target takes (``select``): ``all``; ``fulls``; or
  ``weekly``, the first full of each ISO week. A target keeps whole chains: an incremental
  goes to it only when its parent is there, so it never holds a backup it cannot restore.
- *retention style*: ``object``, a Locked retention set on each object as it lands (it can be
  extended for a chain, never shortened); or ``bucket``, the bucket's own locked retention
  policy, which counts from each object's creation and cannot be extended per object, so such
  a target takes fulls only.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from shardvault.contracts.models import LOCK_DAYS_MAX, Frozen
from shardvault.pricing.prices import GCS_VAULT_CLASSES, VAULT_CLASSES

STACK_TARGET = "stack"  # the stack vault's name unless the policy gives another
TARGET_NAME = re.compile(r"^[a-z][a-z0-9-]{0,39}$")
# Google's bucket naming rules (without the dotted, domain-verified form).
GCS_BUCKET = re.compile(r"^[a-z0-9][a-z0-9_-]{1,61}[a-z0-9]$")
WIF_AUDIENCE = re.compile(
    r"^//iam\.googleapis\.com/projects/\d+/locations/global/"
    r"workloadIdentityPools/[a-z0-9-]+/providers/[a-z0-9-]+$"
)
SERVICE_ACCOUNT = re.compile(
    r"^[a-z][a-z0-9-]{4,28}[a-z0-9]@[a-z0-9-]+\.iam\.gserviceaccount\.com$"
)
AWS_ACCOUNT = re.compile(r"^\d{12}$")
S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
AWS_REGION = re.compile(r"^[a-z]{2}(-[a-z]+)+-\d$")
ROLE_ARN = re.compile(r"^arn:aws[a-z-]*:iam::(\d{12}):role/[\w+=,.@/-]{1,64}$")
KMS_KEY_ARN = re.compile(r"^arn:aws[a-z-]*:kms:([a-z0-9-]+):(\d{12}):key/[a-zA-Z0-9-]+$")
# What STS accepts as an external ID (2 to 1,224 of these characters).
EXTERNAL_ID = re.compile(r"^[\w+=,.@:/-]{2,1224}$")


def invalid(message: str, fix: str) -> PydanticCustomError:
    """A validation error that carries its fix to ``load_policy``."""
    return PydanticCustomError("policy", message, {"fix": fix})


def target_name(value: str) -> str:
    if not TARGET_NAME.match(value):
        raise invalid(
            f"target name {value!r} is not lowercase letters, digits and dashes",
            "name it like gcs-archive (a letter first, up to 40 characters): restore "
            "--from-vault NAME uses it",
        )
    return value


def _pattern(regex: re.Pattern[str], what: str, example: str) -> Any:
    def check(value: str) -> str:
        if not regex.match(value):
            raise invalid(f"{value!r} is not {what}", f"write it like {example}")
        return value

    return AfterValidator(check)


def _gcs_class(value: Any) -> Any:
    """Before the literal's own check: an S3 class name gets GCS's nearest as its fix."""
    if value in GCS_VAULT_CLASSES:
        return value
    if isinstance(value, str) and value.upper() in GCS_VAULT_CLASSES:
        fix = f"write it in capitals: {value.upper()}"
    elif value in VAULT_CLASSES:
        nearest = {"GLACIER": "COLDLINE", "DEEP_ARCHIVE": "ARCHIVE"}.get(value, "NEARLINE")
        fix = f"{value} is an S3 class; GCS's nearest is {nearest}"
    else:
        fix = f"use one of {', '.join(GCS_VAULT_CLASSES)}"
    raise invalid(f"{value!r} is not a storage class GCS has for a vault", fix)


def _compliance(value: Any) -> Any:
    """Before the literal's own check: GOVERNANCE gets the reason it is refused."""
    if value == "GOVERNANCE":
        raise invalid(
            "an aws copy target's object_lock.mode is GOVERNANCE",
            "set mode: COMPLIANCE: a GOVERNANCE lock can be lifted by anyone granted "
            "s3:BypassGovernanceRetention, which is what a copy out of the source account's "
            "reach must not allow",
        )
    return value


class Selection(StrEnum):
    ALL = "all"
    FULLS = "fulls"
    WEEKLY = "weekly"


# The fields every kind of copy target has, written once.
CopyName = Annotated[
    str,
    AfterValidator(target_name),
    Field(description="The copy's name, as restore --from-vault and the catalog use it."),
]
Selected = Annotated[
    Selection,
    Field(
        description="Which backups go: all, fulls, or weekly (the first full of each ISO "
        "week); an incremental goes only when its parent is there."
    ),
]
StackKeyOnly = Annotated[
    bool,
    Field(
        strict=True,
        description="For a cluster with encryption: kms, true accepts copies whose data keys "
        "only the stack account's KMS key unwraps (restoring them needs that key).",
    ),
]


class GcsRetention(Frozen):
    style: Literal["object", "bucket"] = Field(
        "object",
        description="object: a Locked retention set on each object as it lands (extended for "
        "a chain, never shortened); bucket: the bucket's own retention policy, which must be "
        "locked and takes fulls only.",
    )
    days: int = Field(
        ge=1,
        le=LOCK_DAYS_MAX,
        strict=True,
        description="Days each copy stays retained after it lands; at least the stack "
        "vault's object_lock.days.",
    )


class WorkloadIdentity(Frozen):
    audience: Annotated[
        str,
        _pattern(
            WIF_AUDIENCE,
            "a workload identity provider's audience",
            "//iam.googleapis.com/projects/123456789/locations/global/"
            "workloadIdentityPools/shardvault/providers/aws",
        ),
    ] = Field(description="The AWS provider of the workload identity pool the promote role uses.")
    service_account: (
        Annotated[
            str,
            _pattern(
                SERVICE_ACCOUNT,
                "a service account's email",
                "shardvault-vault@acme-backups.iam.gserviceaccount.com",
            ),
        ]
        | None
    ) = Field(
        None,
        description="A service account to impersonate; null: the pool's principal holds the "
        "bucket's role itself.",
    )


class GcsTarget(Frozen):
    name: CopyName
    kind: Literal["gcs"] = Field(description="gcs: a Google Cloud Storage bucket.")
    project: str = Field(min_length=1, description="The Google Cloud project of the bucket.")
    bucket: Annotated[
        str, _pattern(GCS_BUCKET, "a GCS bucket name", "acme-backups-eu (3 to 63 characters)")
    ] = Field(description="The bucket; it must be created with object retention enabled.")
    prefix: str = Field(
        "shardvault", description="Key prefix of the copies; the store's layout follows it."
    )
    storage_class: Annotated[
        Literal["NEARLINE", "COLDLINE", "ARCHIVE"], BeforeValidator(_gcs_class)
    ] = Field(description="The class copies land in: NEARLINE, COLDLINE or ARCHIVE.")
    retention: GcsRetention = Field(description="How each copy is held against deletion.")
    workload_identity: WorkloadIdentity | None = Field(
        None,
        description="How the promote function reaches GCS without a key; null only on the "
        "local stack, whose gcs_endpoint setting names the emulator.",
    )
    select: Selected = Selection.ALL
    stack_key_only: StackKeyOnly = False

    @property
    def held_days(self) -> int:
        """Days each copy is held against deletion once it lands."""
        return self.retention.days

    @model_validator(mode="after")
    def _bucket_retention_takes_fulls(self) -> GcsTarget:
        if self.retention.style == "bucket" and self.select == Selection.ALL:
            raise invalid(
                f"copy {self.name!r} uses the bucket's retention policy and selects all backups",
                "set select: fulls (or weekly), or use retention.style: object: a bucket "
                "retention counts from each object's creation and cannot be extended for an "
                "incremental's chain",
            )
        return self


class AwsObjectLock(Frozen):
    mode: Annotated[Literal["COMPLIANCE"], BeforeValidator(_compliance)] = Field(
        "COMPLIANCE",
        description="COMPLIANCE only: nobody, not even account B's root, can shorten or remove it.",
    )
    days: int = Field(
        ge=1,
        le=LOCK_DAYS_MAX,
        strict=True,
        description="Days each copy stays locked after the backup completed; at least the "
        "stack vault's object_lock.days, at most account B's bucket policy cap.",
    )


class AwsTarget(Frozen):
    name: CopyName
    kind: Literal["aws"] = Field(description="aws: an Object Lock bucket in another account.")
    account: Annotated[
        str, _pattern(AWS_ACCOUNT, "a 12-digit AWS account id", '"222233334444" (quoted)')
    ] = Field(description="Account B: the account that owns the bucket, the role and the key.")
    bucket: Annotated[
        str, _pattern(S3_BUCKET, "an S3 bucket name", "acme-vault-b (3 to 63 characters)")
    ] = Field(description="The bucket in account B; created with Object Lock enabled.")
    region: Annotated[str, _pattern(AWS_REGION, "an AWS region", "eu-west-1")] = Field(
        description="The bucket's region (and its KMS key's)."
    )
    role_arn: Annotated[
        str,
        _pattern(
            ROLE_ARN, "an IAM role's ARN", "arn:aws:iam::222233334444:role/shardvault-vault-writer"
        ),
    ] = Field(description="The role in account B the stack's functions assume.")
    external_id: Annotated[
        str, _pattern(EXTERNAL_ID, "an external ID", "acme-shardvault-7f3 (2 to 1,224 characters)")
    ] = Field(description="The external ID the role's trust policy asks for.")
    kms_key: Annotated[
        str,
        _pattern(
            KMS_KEY_ARN,
            "a KMS key's ARN",
            "arn:aws:kms:eu-west-1:222233334444:key/1234abcd-12ab-34cd-56ef-1234567890ab",
        ),
    ] = Field(description="Account B's KMS key every copy is encrypted under (SSE-KMS).")
    prefix: str = Field(
        "shardvault", description="Key prefix of the copies; the store's layout follows it."
    )
    storage_class: Literal["STANDARD_IA", "GLACIER_IR", "GLACIER", "DEEP_ARCHIVE"] = Field(
        description="The class copies land in: STANDARD_IA, GLACIER_IR, GLACIER or "
        "DEEP_ARCHIVE (the last two need a thaw before a restore reads them)."
    )
    object_lock: AwsObjectLock = Field(description="The COMPLIANCE lock each copy gets.")
    select: Selected = Selection.ALL
    stack_key_only: StackKeyOnly = False
    recovery_key: (
        Annotated[
            str,
            _pattern(
                KMS_KEY_ARN,
                "a KMS key's ARN",
                "arn:aws:kms:us-east-1:222233334444:key/1234abcd-12ab-34cd-56ef-1234567890ab",
            ),
        ]
        | None
    ) = Field(
        None,
        description="For a cluster with encryption: kms, account B's KMS key (in the stack's "
        "region) that the copy's data keys are wrapped under, so that restoring the copy "
        "needs no key of the stack's account.",
    )

    @property
    def held_days(self) -> int:
        return self.object_lock.days

    @model_validator(mode="after")
    def _everything_in_account_b(self) -> AwsTarget:
        role = ROLE_ARN.match(self.role_arn)
        key = KMS_KEY_ARN.match(self.kms_key)
        if role and role.group(1) != self.account:
            raise invalid(
                f"copy {self.name!r}: role_arn is in account {role.group(1)}, not {self.account}",
                "name the role account B made for the copies: a role in the source account "
                "would leave the copies within its reach",
            )
        if key and (key.group(2), key.group(1)) != (self.account, self.region):
            raise invalid(
                f"copy {self.name!r}: kms_key is in account {key.group(2)}, region "
                f"{key.group(1)}, not account {self.account}, region {self.region}",
                "name a key account B owns in the bucket's region (S3 encrypts with a key of "
                "the bucket's region only)",
            )
        recovery = KMS_KEY_ARN.match(self.recovery_key or "")
        if recovery and recovery.group(2) != self.account:
            raise invalid(
                f"copy {self.name!r}: recovery_key is in account {recovery.group(2)}, not "
                f"{self.account}",
                "name a key account B owns: a key of the stack's account is what a copy "
                "out of its reach must not depend on",
            )
        if self.recovery_key and self.kms_key == self.recovery_key:
            raise invalid(
                f"copy {self.name!r}: recovery_key is its kms_key",
                "name a key of its own: the role the stack assumes may Decrypt with kms_key "
                "(S3 encrypts the copies under it), and nobody in the stack's account may "
                "with the recovery key",
            )
        if self.recovery_key and self.stack_key_only:
            raise invalid(
                f"copy {self.name!r} has a recovery_key and stack_key_only: true",
                "drop stack_key_only: with a recovery key, the copy needs no stack key",
            )
        return self


# A copy target, told apart by its kind.
VaultCopy = Annotated[GcsTarget | AwsTarget, Field(discriminator="kind")]


def recovery_key_of(copy: VaultCopy) -> str | None:
    """The copy's *recovery key* (only an aws copy takes one; None: the stack's key, or none)."""
    return copy.recovery_key if isinstance(copy, AwsTarget) else None


def check_copies(stack_name: str, lock_days: int, copies: list[VaultCopy]) -> None:
    """Refuses copies that share a name (with each other or the stack vault), and a retention
    shorter than the stack vault's lock: every copy holds a backup at least as long."""
    names = [stack_name, *(c.name for c in copies)]
    if duplicated := sorted({n for n in names if names.count(n) > 1}):
        raise invalid(
            f"two vault targets are named {duplicated[0]!r}",
            "give each copy its own name, different from the stack vault's "
            f"({stack_name!r}): restore --from-vault NAME picks one",
        )
    for copy in copies:
        if copy.held_days < lock_days:
            field = "retention.days" if copy.kind == "gcs" else "object_lock.days"
            raise invalid(
                f"copy {copy.name!r} retains for {copy.held_days} days, less than the "
                f"stack vault's lock of {lock_days}",
                f"set its {field} to at least {lock_days}: a backup the stack vault "
                "holds must not be gone from a copy sooner",
            )
