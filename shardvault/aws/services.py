"""The clients a workflow step needs, built once per process from ``Settings``.

Steps receive a ``Services`` rather than building clients, so tests can hand them clients
pointed at moto, MinIO or anything else. ``bind`` sees every client built here before it is
used: the local stack has each function's clients make their calls as that function's role
(``shardvault/local/iam``), and a client of a role assumed in another account (``assumed``,
an aws vault copy's) as that role.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import boto3
from botocore.exceptions import ClientError

from shardvault.aws.store import Bucket, StoreLocation, is_missing, s3_client
from shardvault.aws.tables import Catalog, Inbox, NodeRegistry, table
from shardvault.config.settings import Settings

log = logging.getLogger("shardvault.aws.services")
# Under an operation's work prefix: the agents' answers of listing commands, one per phase and
# node. The dispatcher may sign PUTs here and nowhere else (infra/stack.py).
ANSWERS_DIR = "answers"
WORK_READS = 16  # work objects read side by side (``get_works``): each read waits on the store


def unbound(client: Any, role_arn: str | None = None) -> Any:
    return client


# A role session in another account lasts this long; a promotion call (at most 15 minutes)
# assumes the role again at its start, so no session ends under it.
ASSUMED_SECONDS = 3600
ASSUMED_REUSE_SECONDS = 1200  # longer than any call that starts with the client (15 minutes)


@dataclass
class Services:
    settings: Settings
    # bind(client): the function's role; bind(client, role_arn=ARN): a role it assumed
    bind: Callable[..., Any] = unbound
    # (role, external ID, region, session) -> an assumed role's client, when its session ends
    _assumed: dict[tuple[str, str, str, str], tuple[Any, float]] = field(
        default_factory=dict, repr=False
    )
    _assuming: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _table(self, name: str) -> Any:
        dynamo_table = table(name)
        self.bind(dynamo_table.meta.client)
        return dynamo_table

    @cached_property
    def catalog(self) -> Catalog:
        return Catalog(self._table(self.settings.catalog_table))

    @cached_property
    def nodes(self) -> NodeRegistry:
        return NodeRegistry(self._table(self.settings.nodes_table))

    @cached_property
    def inbox(self) -> Inbox:
        return Inbox(self._table(self.settings.inbox_table))

    @cached_property
    def store(self) -> StoreLocation:
        settings = self.settings
        return StoreLocation.parse(
            settings.store_url, settings.store_endpoint, settings.store_credentials
        )

    @cached_property
    def store_s3(self) -> Any:
        return self.bind(self.store.client())

    @cached_property
    def store_bucket(self) -> Bucket:
        """The store's bucket: where backups are staged, and the WAL archive."""
        return self.store.bucket_through(self.store_s3)

    @cached_property
    def vault(self) -> StoreLocation | None:
        settings = self.settings
        if not settings.vault_url:
            return None
        return StoreLocation.parse(
            settings.vault_url, settings.vault_endpoint, settings.vault_credentials
        )

    @cached_property
    def vault_s3(self) -> Any:
        return self.bind(self.vault.client()) if self.vault else None

    @cached_property
    def vault_bucket(self) -> Bucket | None:
        """The vault's bucket (Object Lock), if the deployment has one."""
        return self.vault.bucket_through(self.vault_s3) if self.vault else None

    def policy(self) -> Any:
        """The deployment's policy (None when it has none); read at each call, so an edited
        file counts from the next backup on."""
        from shardvault.config.policy import load_policy, parse_policy

        if self.settings.policy:
            return parse_policy(self.settings.policy, source="the deployed policy")
        return load_policy(self.settings.policy_file) if self.settings.policy_file else None

    @cached_property
    def sts(self) -> Any:
        return self.bind(boto3.client("sts"))

    def assumed_s3(self, role_arn: str, external_id: str, region: str, session: str) -> Any:
        """An S3 client of ``role_arn`` (a role in another account whose trust policy asks for
        ``external_id``), for the buckets of ``region``: a session named ``session`` (in B's
        CloudTrail) of ``ASSUMED_SECONDS``, kept while it has ``ASSUMED_REUSE_SECONDS`` left
        (a chain's manifests are read side by side: one AssumeRole serves them all)."""
        place = (role_arn, external_id, region, session)
        with self._assuming:  # threads of one call ask at once: one session, one client
            kept = self._assumed.get(place)
            if kept is not None and kept[1] - time.monotonic() > ASSUMED_REUSE_SECONDS:
                return kept[0]
            client = self._assume(role_arn, external_id, region, session)
            self._assumed[place] = (client, time.monotonic() + ASSUMED_SECONDS)
            return client

    def _assume(self, role_arn: str, external_id: str, region: str, session: str) -> Any:
        credentials = self.sts.assume_role(
            RoleArn=role_arn,
            RoleSessionName=session[:64],
            ExternalId=external_id,
            DurationSeconds=ASSUMED_SECONDS,
        )["Credentials"]
        client = s3_client(
            self.settings.aws_copy_endpoint,
            (credentials["AccessKeyId"], credentials["SecretAccessKey"]),
            session_token=credentials["SessionToken"],
            region=region,
        )
        return self.bind(client, role_arn=role_arn)

    @cached_property
    def kms(self) -> Any:
        return self.bind(boto3.client("kms"))

    @cached_property
    def cloudwatch(self) -> Any:
        return self.bind(boto3.client("cloudwatch"))

    @cached_property
    def work_s3(self) -> Any:
        return self.bind(s3_client())

    @cached_property
    def work_bucket(self) -> Bucket:
        """The work bucket: what steps hand each other, and the agents' answers."""
        return Bucket(self.work_s3, self.settings.work_bucket)

    @cached_property
    def sns(self) -> Any:
        return self.bind(boto3.client("sns"))

    @cached_property
    def sfn(self) -> Any:
        return self.bind(boto3.client("stepfunctions"))

    @cached_property
    def doorbells(self) -> Any:
        """SQS, to ring a node's doorbell after posting to its inbox (``dispatch.ring``)."""
        return self.bind(boto3.client("sqs"))

    def work_key(self, backup_id: str, *parts: str) -> str:
        return "/".join([self.settings.work_prefix.rstrip("/"), backup_id, *parts])

    def put_work(self, key: str, value: Any) -> None:
        body = json.dumps(value, separators=(",", ":")).encode()
        self.work_bucket.put(key, body)

    def put_urls(self, operation_id: str, object_key: str, urls: dict[str, Any]) -> str:
        """Keeps presigned URLs in the work bucket for the dispatcher, which inlines them into
        the node's inbox item (``args_key``); returns their key. Execution history (kept 90
        days, readable by whoever may read executions) never holds a URL."""
        digest = hashlib.sha256(object_key.encode()).hexdigest()[:32]
        key = self.work_key(operation_id, "urls", f"{digest}.json")
        self.put_work(key, urls)
        return key

    def get_work(self, key: str) -> Any:
        return json.loads(self.get_work_bytes(key))

    def find_work(self, key: str) -> Any | None:
        """A work object that may not exist yet (a budgeted loop's progress before its first
        call ends): None when it is missing, which S3 says (404, not 403) to a role that may
        list the work prefix."""
        try:
            return self.get_work(key)
        except ClientError as error:
            if is_missing(error):
                return None
            raise

    def get_works(self, keys: list[str]) -> list[Any]:
        """Several work objects, in the order of ``keys``, read side by side: a Lambda that
        reads a backup's results or listings one by one waits on each read in turn."""
        if len(keys) < 2:
            return [self.get_work(key) for key in keys]
        _ = self.work_bucket  # built once, before the threads share it
        with ThreadPoolExecutor(min(WORK_READS, len(keys))) as pool:
            return list(pool.map(self.get_work, keys))

    def get_work_bytes(self, key: str) -> bytes:
        return self.work_bucket.read(key)

    def work_url(self, key: str) -> str:
        """A presigned GET URL of a work object (for an agent: it holds no credentials)."""
        return self.work_bucket.presign_get(key, self.settings.url_ttl_seconds)

    def scan_args_key(self, backup_id: str, node_id: str) -> str:
        """A node's scan arguments (its shards' parent block maps: ``backup.scanning``)."""
        return self.work_key(backup_id, "scan", f"{node_id}.json")

    def answer_key(self, operation_id: str, phase: str, node_id: str) -> str:
        """Where a node's agent hands its answer of a listing command (``dispatch.ANSWERED``)."""
        return self.work_key(operation_id, ANSWERS_DIR, phase, f"{node_id}.json")

    def work_put_url(self, key: str, ttl_seconds: int) -> str:
        """A presigned PUT of one work object, for an agent's answer. It cannot bind the
        content (the agent has not produced it yet): the answer's reader checks the object
        against the checksum the agent sent through its task token instead."""
        return self.work_bucket.presign_put(key, ttl_seconds)

    def list_work(self, prefix: str) -> list[str]:
        return self.work_bucket.keys(prefix)

    def notify(self, subject: str, message: dict[str, Any]) -> bool:
        """Best effort: a notification that cannot be sent must never fail (and so clean up)
        a backup that is complete. Returns whether it was sent."""
        if not self.settings.topic_arn:
            return False
        try:
            self.sns.publish(
                TopicArn=self.settings.topic_arn, Subject=subject[:100], Message=json.dumps(message)
            )
        except Exception as error:
            log.warning("notification %r not sent: %s", subject, error)
            return False
        return True
