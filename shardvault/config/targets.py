"""A cluster's vault copies: the places beside the stack's own vault that each verified backup
is also copied to (docs/design/vault-targets.md).

Terms:
- *target*: one place a verified backup lands, named in the policy. The stack's own vault
  (``vault``, named ``stack`` unless ``vault.name`` says otherwise) is always one; each entry
  of ``vault.copies`` is another:
  - ``gcs``: a Google Cloud Storage bucket in class NEARLINE, COLDLINE or ARCHIVE, every
    object under a Locked retention, reached through workload identity federation.
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


class Selection(StrEnum):
    ALL = "all"
    FULLS = "fulls"
    WEEKLY = "weekly"


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
    name: Annotated[str, AfterValidator(target_name)] = Field(
        description="The copy's name, as restore --from-vault and the catalog use it."
    )
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
    select: Selection = Field(
        Selection.ALL,
        description="Which backups go: all, fulls, or weekly (the first full of each ISO "
        "week); an incremental goes only when its parent is there.",
    )
    stack_key_only: bool = Field(
        False,
        strict=True,
        description="For a cluster with encryption: kms, true accepts copies whose data keys "
        "only the stack account's KMS key unwraps (restoring them needs that key).",
    )

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


VaultCopy = GcsTarget  # one kind so far; a union (discriminated by kind) once there are more


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
        if copy.retention.days < lock_days:
            raise invalid(
                f"copy {copy.name!r} retains for {copy.retention.days} days, less than the "
                f"stack vault's lock of {lock_days}",
                f"set its retention.days to at least {lock_days}: a backup the stack vault "
                "holds must not be gone from a copy sooner",
            )
