"""Settings of the control plane (the Lambda functions and the local stack), from the environment.

Every option is declared once here with its default and meaning. Handlers parse them at cold
start; the core receives a ``Settings`` and never reads the environment itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pydantic import BaseModel, Field, SecretStr


class Settings(BaseModel):
    catalog_table: str = Field(description="DynamoDB table of backups (one item per backup).")
    nodes_table: str = Field(description="DynamoDB table of registered nodes.")
    inbox_table: str = Field(description="DynamoDB table of agent commands.")
    work_bucket: str = Field(
        description="Bucket of control objects (plans) the state machine reads."
    )
    work_prefix: str = Field("_work/", description="Key prefix of control objects.")
    store_url: str = Field(description="Where backups go: s3://bucket/prefix.")
    store_endpoint: str | None = Field(
        None, description="S3 endpoint of the store (MinIO); none on AWS."
    )
    store_access_key_id: str | None = Field(
        None, description="Store key (local stack only; on AWS the function's role is used)."
    )
    store_secret_access_key: SecretStr | None = Field(
        None, description="Store secret (local only)."
    )
    vault_url: str | None = Field(
        None,
        description="Where verified backups are promoted: s3://bucket/prefix, a bucket with "
        "Object Lock. None: backups stay in the store.",
    )
    vault_endpoint: str | None = Field(None, description="S3 endpoint of the vault; none on AWS.")
    vault_access_key_id: str | None = Field(None, description="Vault key (local stack only).")
    vault_secret_access_key: SecretStr | None = Field(
        None, description="Vault secret (local only)."
    )
    policy_file: str | None = Field(
        None,
        description="The deployment's policy file (shardvault.yaml): each cluster's vault "
        "class and Object Lock come from it.",
    )
    policy: str | None = Field(
        None,
        description="The policy itself (YAML or JSON text), as the stack passes it to its "
        "functions; wins over policy_file.",
    )
    gcs_endpoint: str | None = Field(
        None,
        description="Endpoint of a GCS emulator for every GCS vault copy (the local stack); "
        "none on AWS, where copies reach GCS through workload identity federation.",
    )
    aws_copy_endpoint: str | None = Field(
        None,
        description="S3 endpoint of every aws vault copy, in another account (the local "
        "stack's second moto account); none on AWS, where each target's region is used.",
    )
    gcs_retry_seconds: float = Field(
        45.0,
        description="How long a GCS call keeps retrying (429, 5xx, lost connections) before "
        "the copy to that target fails.",
    )
    stage_budget_seconds: float = Field(
        180.0,
        description="How long one thaw call stages a copy target's objects into the store "
        "before it is called again (the thaw function runs for at most 300 s).",
    )
    promote_budget_seconds: float = Field(
        600.0,
        description="How long one promotion or synthesis call copies before it is called again.",
    )
    topic_arn: str | None = Field(None, description="SNS topic for backup outcomes.")
    data_key_id: str | None = Field(
        None,
        description="The KMS key that wraps the data keys of clusters whose policy says "
        "encryption: kms; none: such backups are refused.",
    )
    url_ttl_seconds: int = Field(3600, description="Lifetime of presigned part URLs.")
    heartbeat_max_age_seconds: float = Field(
        30.0, description="A node whose agent has not heartbeated for longer is unavailable."
    )
    sweep_grace_seconds: float = Field(
        6 * 3600.0,
        description="The daily sweep leaves uploads and partial objects younger than this.",
    )
    thaw_first_wait_seconds: int = Field(
        60, description="First wait for archived objects to thaw; each later wait doubles."
    )
    verify_mode: str = Field(
        "attributes",
        description="'attributes' verifies by GetObjectAttributes (no download), falling back to "
        "reading back on a mismatch; 'readback' always reads objects back.",
    )

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Settings:
        fields = {name: env[name.upper()] for name in cls.model_fields if env.get(name.upper())}
        return cls.model_validate(fields)

    @property
    def vault_credentials(self) -> tuple[str, str] | None:
        if self.vault_access_key_id and self.vault_secret_access_key:
            return self.vault_access_key_id, self.vault_secret_access_key.get_secret_value()
        return None

    @property
    def store_credentials(self) -> tuple[str, str] | None:
        if self.store_access_key_id and self.store_secret_access_key:
            return self.store_access_key_id, self.store_secret_access_key.get_secret_value()
        return None
