"""The local stack: the AWS deployment's moving parts on one machine, with no AWS account.

- moto's server, in this process, with its Step Functions interpreter executing the real ASL
  files (``execute_state_machine``), plus DynamoDB, SNS, SQS (each agent creates its node's
  doorbell queue there, and the dispatcher rings it, as on AWS) and the S3 *work* bucket that
  the Distributed Map's ItemReader reads plans from;
- the Lambda handlers, served in-process by ``LambdaBridge``;
- the *store*: MinIO when its binary is present (real S3 checksum semantics), else a bucket in
  moto's S3, verified by reading objects back since moto's checksums cannot be trusted;
- the *vault*: a bucket in moto's S3 with Object Lock (it keeps archive storage classes, which
  MinIO refuses); clusters of ``policy.yaml`` beside this module are promoted into it;
- *GCS*: fake-gcs-server behind a proxy that answers as GCS does on retention; the policy's
  GCS copy targets land there (``gcs_endpoint``);
- *account B*: a second moto account, where the policy's aws copy targets' buckets and role
  are (``shardvault.local.account_b``), judged by the gate as B's IAM would judge them;
- agents as separate OS processes, given control-plane endpoints but no store credentials.

``stack.env`` in the stack's directory records the endpoints and names, so CLI commands run
from another shell reach the same stack. ``stack.pid`` holds the pid of the process running
it, under an exclusive ``flock`` held while it runs (the kernel drops it when the process
dies, however it dies): a second stack in the same directory is refused, and ``shardvault
local down`` finds what to stop. MinIO and the agents get a parent-death signal
(``processes.die_with_parent``), so a stack killed outright takes them with it.

*Reaper*: on AWS an EventBridge rule sends backup and restore executions that end ABORTED or
TIMED_OUT to the ``reap_execution`` Lambda; moto emits no events, so ``ExecutionReaper``
watches those executions and invokes it with the event AWS would send.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import boto3
import yaml

from shardvault.aws import lambda_support
from shardvault.aws.services import Services
from shardvault.aws.store import s3_client
from shardvault.backup import REAPED_STATUSES
from shardvault.client.operations import STACK_OUTPUTS
from shardvault.config.settings import Settings
from shardvault.config.targets import AwsTarget
from shardvault.errors import InvalidRequest
from shardvault.gcp.storage import COPY_WRITER_PERMISSIONS
from shardvault.local import moto_fidelity, moto_inprocess, moto_speedups
from shardvault.local.account_b import AccountB
from shardvault.local.agent_faults import VARIABLE as FAULTS_VARIABLE
from shardvault.local.fakegcs import start_fake_gcs
from shardvault.local.gcs_answers import GcsAnswersProxy
from shardvault.local.gcs_iam import ADMIN_HEADER
from shardvault.local.iam.gate import Gate, load_gate
from shardvault.local.iam.resolve import LocalNames
from shardvault.local.iam.template import OPERATOR
from shardvault.local.lambda_bridge import LambdaBridge
from shardvault.local.ports import free_port
from shardvault.local.processes import die_with_parent
from shardvault.local.s3_answers import presign_through

REGION = "us-east-1"
ACCOUNT = "123456789012"
ROOT = Path(__file__).resolve().parents[2]
STATE_MACHINES = ROOT / "statemachines"
FUNCTIONS = {
    "ValidateBackupFunctionArn": "validate_backup",
    "DispatchFunctionArn": "dispatch",
    "PlanBackupFunctionArn": "plan_backup",
    "PrepareScanFunctionArn": "prepare_scan",
    "CheckNodesFunctionArn": "check_nodes",
    "SignPartsFunctionArn": "sign_parts",
    "CompleteUploadFunctionArn": "complete_upload",
    "CheckUploadsFunctionArn": "check_uploads",
    "FinalizeBackupFunctionArn": "finalize_backup",
    "SynthesizeFullFunctionArn": "synthesize_full",
    "CleanupBackupFunctionArn": "cleanup_backup",
    "ValidateRestoreFunctionArn": "validate_restore",
    "PlanRestoreFunctionArn": "plan_restore",
    "ThawObjectsFunctionArn": "thaw_objects",
    "SignDownloadFunctionArn": "sign_download",
    "CheckPreparedFunctionArn": "check_prepared",
    "RecordDownloadFunctionArn": "record_download",
    "FinalizeRestoreFunctionArn": "finalize_restore",
    "CleanupRestoreFunctionArn": "cleanup_restore",
    "PromoteBackupFunctionArn": "promote_backup",
    "RecordPromotionFailureFunctionArn": "record_promotion_failure",
    "DecideRetentionFunctionArn": "decide_retention",
    "ExpireBackupFunctionArn": "expire_backup",
    "SweepStoreFunctionArn": "sweep_store",
    "VerifyBackupFunctionArn": "verify_backup",
    "ProbeStoreFunctionArn": "probe_store",
    "StartDrillFunctionArn": "start_drill",
    "RecordDrillFunctionArn": "record_drill",
    "NoteTeardownFunctionArn": "note_teardown",
    "CutClusterFunctionArn": "cut_cluster",
}
NAMES = {
    "catalog_table": "shardvault-catalog",
    "nodes_table": "shardvault-nodes",
    "inbox_table": "shardvault-inbox",
    "work_bucket": "shardvault-work",
    "store_bucket": "shardvault-store",
    "vault_bucket": "shardvault-vault",
}
# Invoked by an EventBridge rule on AWS (no ASL names it): here by ExecutionReaper.
REAPER_FUNCTION = "reap_execution"
# Invoked by the agents themselves (shardvault.wal.archive): through moto's server here.
ARCHIVE_FUNCTION = "archive_wal"
# Invoked by an EventBridge rule on AWS every WATCH_MINUTES: here by whoever asks (a test).
WATCH_FUNCTION = "watch_clusters"
# The name a deployed stack has unless `-c stackName=` says otherwise (what the template's
# grants name: the agent's and the operators' DescribeStacks).
DEPLOYED_NAME = "ShardVault"
# What the local stack's CloudFormation stack outputs: the CLI's and the agents' (the agent's
# bootstrap.OUTPUTS: the tables and the archive function).
DESCRIBED_OUTPUTS = STACK_OUTPUTS | {
    "InboxTableName": "SHARDVAULT_INBOX_TABLE",
    "ArchiveFunctionName": "SHARDVAULT_ARCHIVE_FUNCTION",
}
LOCAL_POLICY = Path(__file__).with_name("policy.yaml")
DATA_KEY_ALIAS = "alias/shardvault-data"
PID_FILE = "stack.pid"
log = logging.getLogger("shardvault.local.stack")


def function_arn(name: str) -> str:
    return f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:shardvault-{name}"


def substitutions(work_bucket: str) -> dict[str, str]:
    """The values of the ASL placeholders, as CDK fills them on AWS."""
    return {key: function_arn(name) for key, name in FUNCTIONS.items()} | {
        "WorkBucket": work_bucket
    }


def render_asl(path: Path, values: dict[str, str]) -> str:
    text = path.read_text()
    for key, value in values.items():
        text = text.replace("${" + key + "}", value)
    if "${" in text:
        raise ValueError(f"{path.name} has a placeholder without a value")
    return text


def with_heartbeat(definition: str, seconds: int) -> str:
    """A definition whose tasks' ``HeartbeatSeconds`` are at most ``seconds``."""

    def lower(node: Any) -> Any:
        if isinstance(node, dict):
            return {
                key: min(value, seconds) if key == "HeartbeatSeconds" else lower(value)
                for key, value in node.items()
            }
        if isinstance(node, list):
            return [lower(value) for value in node]
        return node

    return json.dumps(lower(json.loads(definition)))


def minio_available() -> bool:
    from shardvault.local.minio import find_minio_binary

    return find_minio_binary() is not None


def control_plane_env(endpoint: str) -> dict[str, str]:
    """Environment of any process that talks to the local control plane (moto)."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "local",
        "AWS_SECRET_ACCESS_KEY": "local",
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
    }


def key_schema(hash_key: str, range_key: str) -> list[dict[str, str]]:
    return [
        {"AttributeName": hash_key, "KeyType": "HASH"},
        {"AttributeName": range_key, "KeyType": "RANGE"},
    ]


def string_attributes(*names: str) -> list[dict[str, str]]:
    return [{"AttributeName": name, "AttributeType": "S"} for name in names]


def create_tables(ddb: Any, *, catalog_table: str, nodes_table: str, inbox_table: str) -> None:
    """The control plane's DynamoDB tables, keyed as infra/ declares them (``ddb``: a boto3
    DynamoDB client). Used by the local stack and by tests that need the tables alone."""
    ddb.create_table(
        TableName=catalog_table,
        KeySchema=key_schema("cluster", "backup_id"),
        AttributeDefinitions=string_attributes("cluster", "backup_id"),
        BillingMode="PAY_PER_REQUEST",
    )
    ddb.create_table(
        TableName=nodes_table,
        KeySchema=[{"AttributeName": "node_id", "KeyType": "HASH"}],
        AttributeDefinitions=string_attributes("node_id", "cluster"),
        GlobalSecondaryIndexes=[
            {
                "IndexName": "by_cluster",
                "KeySchema": key_schema("cluster", "node_id"),
                "Projection": {"ProjectionType": "ALL"},
            }
        ],
        BillingMode="PAY_PER_REQUEST",
    )
    ddb.create_table(
        TableName=inbox_table,
        KeySchema=key_schema("node_id", "command_id"),
        AttributeDefinitions=string_attributes("node_id", "command_id"),
        BillingMode="PAY_PER_REQUEST",
    )


@dataclass
class LocalStack:
    root: Path
    use_minio: bool = True
    require_minio: bool = False  # tests: a missing MinIO is an error, never a silent fallback
    heartbeat_max_age: float = 15.0
    # Tests: the agents' tasks' HeartbeatSeconds, lower than the state machines' (a killed
    # agent is then noticed in seconds, not a minute); None keeps the definitions' own.
    task_heartbeat_seconds: int | None = None
    policy_file: Path = LOCAL_POLICY
    moto_port: int = 0
    settings: Settings | None = None
    state_machine_arn: str = ""
    restore_state_machine_arn: str = ""
    retention_state_machine_arn: str = ""
    verify_state_machine_arn: str = ""
    probe_state_machine_arn: str = ""
    drill_state_machine_arn: str = ""
    cut_state_machine_arn: str = ""
    endpoint: str = ""
    _server: Any = None
    _minio: Any = None
    _fake_gcs: Any = None
    gcs: GcsAnswersProxy | None = None  # GCS as it answers: the copy targets' emulator
    _reaper: ExecutionReaper | None = None
    _pid_file: IO[str] | None = None
    gate: Gate | None = None  # IAM, as the synthesized template grants it
    account_b: AccountB | None = None  # aws copy targets: a second account
    _presign_endpoint: str | None = None  # the S3 answers' proxy, while a test uses it
    agents: dict[str, subprocess.Popen] = field(default_factory=dict)

    # --- start -------------------------------------------------------------------------------
    def start(self) -> LocalStack:
        try:
            return self._start()
        except BaseException:
            self.stop()  # a stack that failed to start leaves no server behind
            raise

    def _start(self) -> LocalStack:
        self.root.mkdir(parents=True, exist_ok=True)
        self._pid_file = claim_stack_dir(self.root)
        self._start_moto()
        store_url, store_endpoint, credentials = self._start_store()
        gcs_endpoint = self._start_gcs()
        topic_arn, topic_key = self._create_resources()
        data_key = self._create_data_key()
        self.settings = Settings(
            catalog_table=NAMES["catalog_table"],
            nodes_table=NAMES["nodes_table"],
            inbox_table=NAMES["inbox_table"],
            work_bucket=NAMES["work_bucket"],
            store_url=store_url,
            store_endpoint=store_endpoint,
            store_access_key_id=credentials[0] if credentials else None,
            store_secret_access_key=credentials[1] if credentials else None,
            verify_mode="attributes" if credentials else "readback",
            topic_arn=topic_arn,
            data_key_id=data_key,
            heartbeat_max_age_seconds=self.heartbeat_max_age,
            thaw_first_wait_seconds=1,
            vault_url=f"s3://{NAMES['vault_bucket']}/backups",
            vault_endpoint=self.endpoint,
            policy_file=str(self.policy_file),
            gcs_endpoint=gcs_endpoint,
            gcs_retry_seconds=5.0,
            aws_copy_endpoint=self.endpoint,  # account B's buckets are moto's too
        )
        self._create_gcs_buckets()
        self._start_gate(topic_key)
        self._create_account_b()
        self.state_machine_arn = self._create_state_machine("backup")
        self.restore_state_machine_arn = self._create_state_machine("restore")
        self.retention_state_machine_arn = self._create_state_machine("retention")
        self.verify_state_machine_arn = self._create_state_machine("verify")
        self.probe_state_machine_arn = self._create_state_machine("probe")
        self.drill_state_machine_arn = self._create_state_machine(
            "drill", RestoreStateMachineArn=self.restore_state_machine_arn
        )
        self.cut_state_machine_arn = self._create_state_machine("cut")
        self._reaper = ExecutionReaper(
            [self.state_machine_arn, self.restore_state_machine_arn]
        ).start()
        self._write_env_file()
        self._describe_as_deployed()
        return self

    def _describe_as_deployed(self) -> None:
        """A CloudFormation stack named as a deployed one, holding the outputs its clients
        read (``shardvault --stack``, ``shardvault-agent init --stack``): their path on AWS,
        and their DescribeStacks grants, run here too."""
        env = dict(
            line.split("=", 1) for line in (self.root / "stack.env").read_text().splitlines()
        )
        outputs = {name: env[variable] for name, variable in DESCRIBED_OUTPUTS.items()}
        template = {
            "Resources": {"Outputs": {"Type": "AWS::CloudFormation::WaitConditionHandle"}},
            "Outputs": {name: {"Value": value} for name, value in outputs.items()},
        }
        cloudformation = boto3.client("cloudformation", region_name=REGION)
        with contextlib.suppress(cloudformation.exceptions.ClientError):
            cloudformation.delete_stack(StackName=DEPLOYED_NAME)  # an earlier stack's, here
        with warnings.catch_warnings():  # moto creates no WaitConditionHandle: none is needed
            warnings.simplefilter("ignore", UserWarning)
            cloudformation.create_stack(StackName=DEPLOYED_NAME, TemplateBody=json.dumps(template))

    def _start_gate(self, topic_key: str) -> None:
        """Every function's calls and every agent's are authorized as their roles' would be
        on AWS, by the synthesized template's grants (``shardvault/local/iam``)."""
        key_arn = f"arn:aws:kms:{REGION}:{ACCOUNT}:key/"
        names = LocalNames(
            region=REGION,
            account=ACCOUNT,
            store_bucket=NAMES["store_bucket"],
            work_bucket=NAMES["work_bucket"],
            vault_bucket=NAMES["vault_bucket"],
            tables={
                "catalog": NAMES["catalog_table"],
                "nodes": NAMES["nodes_table"],
                "inbox": NAMES["inbox_table"],
            },
            topic_arn=self.settings.topic_arn,
            topic_key_arn=key_arn + topic_key,
            data_key_arn=key_arn + self.settings.data_key_id,
            function_prefix="shardvault-",
        )
        self.gate = load_gate(names, key_aliases={DATA_KEY_ALIAS: self.settings.data_key_id})
        lambda_support.use_settings(self.settings, bind_for=self._bind_for)
        self._server._server.app = self.gate.wsgi(self._server._server.app)

    def _bind_for(self, module: str) -> Callable[[Any], Any]:
        """How the clients of the function ``module`` are made: bound to its role by the
        gate, and the store's pointed at the S3 answers' proxy while a test asks for it."""
        assert self.gate is not None
        as_role = functools.partial(self.gate.bind, principal=self.gate.function(module))
        through = presign_through(self._presign_endpoint) if self._presign_endpoint else None

        def bind(client: Any, role_arn: str | None = None) -> Any:
            client = as_role(client, role_arn=role_arn)
            if through is not None and client.meta.endpoint_url == self.settings.store_endpoint:
                client = through(client)
            return client

        return bind

    def _start_moto(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        logging.getLogger("moto").setLevel(logging.CRITICAL)  # failed executions are reported by us
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))  # the handlers live in the repository's functions/
        self.moto_port = self.moto_port or free_port()
        # moto's interpreter reaches "Lambda" and S3 at MOTO_PORT; the bridge answers Lambda.
        os.environ["MOTO_PORT"] = str(self.moto_port)
        self.endpoint = f"http://127.0.0.1:{self.moto_port}"
        os.environ.update(control_plane_env(self.endpoint))
        os.environ.setdefault("POWERTOOLS_TRACE_DISABLED", "true")
        os.environ.setdefault("POWERTOOLS_METRICS_DISABLED", "true")
        self._log_functions_to(self.root / "functions.log")
        served = [*FUNCTIONS.values(), REAPER_FUNCTION, ARCHIVE_FUNCTION, WATCH_FUNCTION]
        bridge = LambdaBridge({f"shardvault-{n}": f"functions.{n}" for n in served})
        bridge.install()
        bridge.serve_http()
        moto_inprocess.install(self.moto_port)
        moto_speedups.install()
        moto_fidelity.install()
        self._server = ThreadedMotoServer(
            ip_address="127.0.0.1", port=self.moto_port, verbose=False
        )
        self._server.start()
        request = urllib.request.Request(
            f"{self.endpoint}/moto-api/config",
            data=json.dumps({"stepfunctions": {"execute_state_machine": True}}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        urllib.request.urlopen(request, timeout=10).read()

    @staticmethod
    def _log_functions_to(path: Path) -> None:
        """The handlers' logs go to a file, as they would go to CloudWatch, not the console."""
        for name in ("shardvault", "aws_lambda_powertools"):
            logger = logging.getLogger(name)
            for old in list(logger.handlers):
                logger.removeHandler(old)
                handler = logging.FileHandler(path)
                handler.setFormatter(old.formatter)  # keep Powertools' JSON lines
                logger.addHandler(handler)
            if not logger.handlers:
                logger.addHandler(logging.FileHandler(path))
            logger.propagate = False

    def _start_store(self) -> tuple[str, str, tuple[str, str] | None]:
        """MinIO when its binary is found, else a bucket in moto's S3."""
        if self.require_minio and not minio_available():
            from shardvault.local.minio import MinioNotFound

            raise MinioNotFound("MinIO is required here but its binary was not found.")
        if self.use_minio and minio_available():
            from shardvault.local.minio import start_minio

            self._minio = start_minio(self.root / "minio", log_path=self.root / "minio.log")
            endpoint = self._minio.endpoint
            credentials = (self._minio.access_key, self._minio.secret_key)
        else:
            endpoint, credentials = self.endpoint, None
        s3 = s3_client(endpoint, credentials)
        # A stack restarted on the same directory keeps its earlier backups.
        with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou):
            s3.create_bucket(Bucket=NAMES["store_bucket"])
        return f"s3://{NAMES['store_bucket']}/backups", endpoint, credentials

    def _start_gcs(self) -> str:
        """fake-gcs-server behind the proxy that answers as GCS does on retention
        (``shardvault.local.gcs_answers``): every GCS copy target of the policy lands there."""
        self._fake_gcs = start_fake_gcs(self.root / "fake-gcs.log")
        self.gcs = GcsAnswersProxy(
            self._fake_gcs.endpoint, permissions=COPY_WRITER_PERMISSIONS
        ).start()
        return self.gcs.endpoint

    def gcs_admin(self) -> Any:
        """A storage client of the stack's GCS that is not held to the copy writers' role
        (``gcs_iam``): an operator's, making buckets; a test's, writing behind ShardVault."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        assert self.gcs is not None
        return storage.Client(
            project="shardvault-local",
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": self.gcs.endpoint},
            extra_headers={ADMIN_HEADER: "1"},
        )

    def _create_gcs_buckets(self) -> None:
        """The policy's GCS buckets, as an operator creates them (object retention on)."""
        policy = self.services().policy()
        client = self.gcs_admin()
        for cluster in policy.clusters.values() if policy else []:
            for target in cluster.vault.copies:
                if target.kind == "gcs" and client.lookup_bucket(target.bucket) is None:
                    client.create_bucket(target.bucket, enable_object_retention=True)

    def _create_account_b(self) -> None:
        """Account B, a second moto account, with the policy's aws copy targets' buckets and
        role (``shardvault.local.account_b``)."""
        assert self.gate is not None
        self.account_b = AccountB(self.endpoint, REGION, self.gate)
        policy = self.services().policy()
        for cluster in policy.clusters.values() if policy else []:
            for target in cluster.vault.copies:
                if isinstance(target, AwsTarget):
                    self.account_b.add(target)

    def presign_store_through(self, endpoint: str | None) -> None:
        """Tests: the store's presigned URLs (the ones agents receive) name ``endpoint``, a
        fault proxy in front of MinIO (``shardvault.local.s3_answers``), or the store again
        (None); the functions' own store calls still go direct. The handlers' clients are
        built anew, still bound to their roles."""
        self._presign_endpoint = endpoint
        lambda_support.use_settings(self.settings, bind_for=self._bind_for)

    def operator_binding(self) -> Callable[[Any], Any]:
        """Binds a client made in this process to the operator's policy (the CLI's grants):
        the demo's CLI calls are judged as those of a CLI in another shell are."""
        assert self.gate is not None
        return functools.partial(self.gate.bind, principal=self.gate.principal(OPERATOR))

    def refused_calls(self) -> list[tuple[str, str, str]]:
        """(holder, action, resource) of every call refused that no test asked for."""
        assert self.gate is not None
        return sorted(self.gate.recorder.refused)

    def client_config(self) -> Any:
        """What the CLI's operations need to reach this stack."""
        from shardvault.client.operations import ClientConfig

        return ClientConfig(
            self.state_machine_arn,
            self.settings.catalog_table,
            self.settings.nodes_table,
            self.restore_state_machine_arn,
            self.retention_state_machine_arn,
            self.verify_state_machine_arn,
            self.probe_state_machine_arn,
            self.drill_state_machine_arn,
            self.cut_state_machine_arn,
        )

    def store_client(self) -> Any:
        """An S3 client for the store, with the store's own credentials (the control plane's)."""
        return self.services().store_s3

    def services(self) -> Services:
        return Services(self.settings)

    def _create_resources(self) -> tuple[str, str]:
        """The tables, the work and vault buckets, and the notifications topic, encrypted
        with its own KMS key as on AWS; returns the topic's ARN and its key's id."""
        ddb = boto3.client("dynamodb")
        create_tables(
            ddb,
            catalog_table=NAMES["catalog_table"],
            nodes_table=NAMES["nodes_table"],
            inbox_table=NAMES["inbox_table"],
        )
        s3 = boto3.client("s3")
        s3.create_bucket(Bucket=NAMES["work_bucket"])
        # The vault: moto's S3 keeps archive storage classes and Object Lock as S3 does.
        s3.create_bucket(Bucket=NAMES["vault_bucket"], ObjectLockEnabledForBucket=True)
        kms = boto3.client("kms")
        topic_key = kms.create_key(Description="ShardVault notifications")["KeyMetadata"]["KeyId"]
        topic = boto3.client("sns").create_topic(
            Name="shardvault-notifications", Attributes={"KmsMasterKeyId": topic_key}
        )
        return topic["TopicArn"], topic_key

    def _create_data_key(self) -> str:
        """The KMS key (moto's) that wraps data keys, as the stack's key does on AWS."""
        kms = boto3.client("kms")
        key_id = kms.create_key(Description="ShardVault data keys")["KeyMetadata"]["KeyId"]
        kms.create_alias(AliasName=DATA_KEY_ALIAS, TargetKeyId=key_id)
        return key_id

    def _create_state_machine(self, name: str, **machines: str) -> str:
        """``machines``: the ARNs of the state machines this one starts (the drill: restores)."""
        definition = render_asl(
            STATE_MACHINES / f"{name}.asl.json", substitutions(NAMES["work_bucket"]) | machines
        )
        if self.task_heartbeat_seconds is not None:
            definition = with_heartbeat(definition, self.task_heartbeat_seconds)
        response = boto3.client("stepfunctions").create_state_machine(
            name=f"ShardVault-{name}",  # as infra/constants.py names them: grants name them
            definition=definition,
            roleArn=f"arn:aws:iam::{ACCOUNT}:role/shardvault-{name}",
        )
        return response["stateMachineArn"]

    def _write_env_file(self) -> None:
        """What a CLI run from another shell needs: the names, and the operator's key (its
        calls are authorized by the stack's operator policy). An agent set up from it by hand
        (``shardvault-agent init --stack-env``) takes the harness's key instead
        (``LOCAL_AGENT_KEY``): the local stack cannot tell which node it will run."""
        env = {
            **control_plane_env(self.endpoint),
            "AWS_ACCESS_KEY_ID": self.gate.operator_key(),
            "SHARDVAULT_LOCAL_AGENT_ACCESS_KEY_ID": control_plane_env("")["AWS_ACCESS_KEY_ID"],
            "SHARDVAULT_STATE_MACHINE_ARN": self.state_machine_arn,
            "SHARDVAULT_RESTORE_STATE_MACHINE_ARN": self.restore_state_machine_arn,
            "SHARDVAULT_RETENTION_STATE_MACHINE_ARN": self.retention_state_machine_arn,
            "SHARDVAULT_VERIFY_STATE_MACHINE_ARN": self.verify_state_machine_arn,
            "SHARDVAULT_PROBE_STATE_MACHINE_ARN": self.probe_state_machine_arn,
            "SHARDVAULT_DRILL_STATE_MACHINE_ARN": self.drill_state_machine_arn,
            "SHARDVAULT_CUT_STATE_MACHINE_ARN": self.cut_state_machine_arn,
            "SHARDVAULT_CATALOG_TABLE": self.settings.catalog_table,
            "SHARDVAULT_NODES_TABLE": self.settings.nodes_table,
            "SHARDVAULT_INBOX_TABLE": self.settings.inbox_table,
            "SHARDVAULT_ARCHIVE_FUNCTION": f"shardvault-{ARCHIVE_FUNCTION}",
            "SHARDVAULT_STORE_URL": self.settings.store_url,
            "SHARDVAULT_STORE_ENDPOINT": self.settings.store_endpoint or "",
        }
        (self.root / "stack.env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))

    # --- agents ------------------------------------------------------------------------------
    def agent_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """A clean environment for an agent: control plane only, never the store's keys."""
        keep = {
            k: v
            for k, v in os.environ.items()
            if k in {"PATH", "HOME", "LANG", "PYTHONPATH", "TMPDIR"}
        }
        return {
            **keep,
            **control_plane_env(self.endpoint),
            "SHARDVAULT_NODES_TABLE": self.settings.nodes_table,
            "SHARDVAULT_INBOX_TABLE": self.settings.inbox_table,
            "SHARDVAULT_CATALOG_TABLE": self.settings.catalog_table,  # reconcile at start
            "SHARDVAULT_ARCHIVE_FUNCTION": f"shardvault-{ARCHIVE_FUNCTION}",
            **(extra or {}),
        }

    def start_agent(
        self, config: dict[str, Any], extra_env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        node_id = config["node_id"]
        path = self.root / "agents" / f"{node_id}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        log = open(self.root / "agents" / f"{node_id}.log", "ab")  # noqa: SIM115
        # The node's own access key: moto's server authorizes its calls as its role's.
        role = {"AWS_ACCESS_KEY_ID": self.gate.agent_key(node_id, config["cluster"])}
        env = self.agent_env(role | (extra_env or {}))
        # An agent the tests inject faults into runs under the harness that wraps its uploads
        # (shardvault/local/agent_faults.py); the agent's own code holds no fault hook.
        runner = (
            "shardvault.local.agent_faults" if FAULTS_VARIABLE in env else "shardvault_agent.cli"
        )
        process = subprocess.Popen(
            [sys.executable, "-m", runner, "run", "--config", str(path)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent(),  # noqa: PLW1509 - only prctl runs before exec
        )
        self.agents[node_id] = process
        return process

    def stop_agent(self, node_id: str, *, kill: bool = False) -> None:
        process = self.agents.pop(node_id, None)
        if process is None:
            return
        if kill:
            process.kill()
        else:
            process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def wait_for_nodes(self, node_ids: list[str], timeout: float = 30.0) -> None:
        from shardvault.aws.tables import NodeRegistry, table

        registry = NodeRegistry(table(self.settings.nodes_table))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            records = {n: registry.get(n) for n in node_ids}
            if all(
                r and r.status == "up" and time.time() - r.heartbeat_at < 10
                for r in records.values()
            ):
                return
            for node_id, process in self.agents.items():
                if process.poll() is not None:
                    log = (self.root / "agents" / f"{node_id}.log").read_text()[-2000:]
                    raise RuntimeError(f"agent {node_id} exited with {process.returncode}:\n{log}")
            time.sleep(0.2)
        raise TimeoutError(f"agents {node_ids} did not register within {timeout} s")

    def drop_reaper_event(self, execution_arn: str) -> None:
        """Tests: the reaper never hears of this execution, as when EventBridge's event is
        lost or comes after the next backup has taken the lock over."""
        if self._reaper is not None:
            self._reaper.finished.add(execution_arn)

    # --- stop --------------------------------------------------------------------------------
    def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.stop()
            self._reaper = None
        for node_id in list(self.agents):
            self.stop_agent(node_id)
        if self._minio is not None:
            self._minio.stop()
            self._minio = None
        if self.gcs is not None:
            self.gcs.stop()
            self.gcs = None
        if self._fake_gcs is not None:
            self._fake_gcs.stop()
            self._fake_gcs = None
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._pid_file is not None:  # last: 'local down' waits for this
            (self.root / PID_FILE).unlink(missing_ok=True)
            self._pid_file.close()
            self._pid_file = None

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- the stack's directory: stack.pid ---------------------------------------------------------
def claim_stack_dir(root: Path) -> IO[str]:
    """Takes ``root/stack.pid`` for this process (its lock, then its pid), or refuses a
    directory a running stack holds. Closing the returned file releases it."""
    handle = open(root / PID_FILE, "a+")  # noqa: SIM115 - held open while the stack runs
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        pid = handle.read().strip()
        handle.close()
        raise InvalidRequest(
            f"a local stack already runs in {root} (pid {pid}).",
            fix=f"stop it with 'shardvault local down --dir {root}', or start this one with "
            "another --dir.",
        ) from None
    handle.truncate(0)
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def running_stack_pid(root: Path) -> int | None:
    """The pid of the stack running in ``root``; None when none does (no ``stack.pid``, or
    one whose lock nobody holds: its stack was killed)."""
    try:
        handle = open(root / PID_FILE)  # noqa: SIM115 - closed below, the lock with it
    except FileNotFoundError:
        return None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = handle.read().strip()
            return int(pid) if pid.isdigit() else None  # empty for an instant while claimed
        return None


def stop_running_stack(root: Path, timeout: float = 90.0) -> int:
    """``shardvault local down``: SIGTERM to the stack running in ``root`` (it stops its
    agents, MinIO and moto, then releases ``stack.pid``); SIGKILL if it has not within
    ``timeout`` seconds (its children then get their parent-death signal). Returns its pid."""
    pid = running_stack_pid(root)
    if pid is None:
        raise InvalidRequest(
            f"no local stack runs in {root}.",
            fix="pass the --dir the stack was started with ('shardvault local up --dir DIR').",
        )
    os.kill(pid, signal.SIGTERM)
    if not _released(root, timeout):
        os.kill(pid, signal.SIGKILL)
        _released(root, 10.0)
    return pid


def _released(root: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while running_stack_pid(root) is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


# --- the reaper's events ------------------------------------------------------------------------
# Each poll lists both state machines' ABORTED and TIMED_OUT executions: four requests to
# moto's server, about 9 ms of CPU each (client and server, in the stack's process) that the
# agents' machine pays, every poll of every stack; at 1 s the listing was most of an idle
# stack's CPU (docs/BENCHMARKS.md).
REAP_POLL_SECONDS = 2.0
# EventBridge delivers some time after the execution ended; so does this watcher. A reaper
# invoked by hand right after a stop (the older integration tests do) thus goes first, and
# the watcher's invocation then finds nothing to do, as a second delivery would.
REAP_AFTER_SECONDS = 2.0
REAP_ATTEMPTS = 5  # the first delivery and EventBridge's retries (infra: retry_attempts=4)


def epoch_millis(moment: datetime) -> int:
    return round(moment.timestamp() * 1000)


def status_change_event(execution: dict[str, Any]) -> dict[str, Any]:
    """The "Step Functions Execution Status Change" event AWS sends when an execution ends,
    built from its DescribeExecution response: what the reaper's rule hands the Lambda."""
    stopped = execution.get("stopDate") or datetime.now(UTC)
    return {
        "version": "0",
        "id": str(uuid.uuid4()),
        "detail-type": "Step Functions Execution Status Change",
        "source": "aws.states",
        "account": ACCOUNT,
        "time": stopped.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "region": REGION,
        "resources": [execution["executionArn"]],
        "detail": {
            "executionArn": execution["executionArn"],
            "stateMachineArn": execution["stateMachineArn"],
            "name": execution["name"],
            "status": execution["status"],
            "startDate": epoch_millis(execution["startDate"]),
            "stopDate": epoch_millis(stopped),
            "input": execution.get("input"),
            "output": execution.get("output"),
        },
    }


class ExecutionReaper:
    """A thread doing EventBridge's part for the reaper: every ``REAP_POLL_SECONDS`` it lists
    the executions of the watched state machines that ended ABORTED or TIMED_OUT, and invokes
    ``reap_execution`` once for each (again after a failed invocation, up to
    ``REAP_ATTEMPTS`` in all). Its clients are made in the starting thread."""

    def __init__(self, state_machine_arns: list[str]) -> None:
        self.state_machine_arns = state_machine_arns
        self.sfn = boto3.client("stepfunctions")
        self.lambda_client = boto3.client("lambda")
        self.seen: dict[str, float] = {}  # execution ARN -> when first seen ended (monotonic)
        self.attempts: dict[str, int] = {}  # execution ARN -> invocations so far
        self.finished: set[str] = set()  # reaped, or given up on
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="execution-reaper", daemon=True)

    def start(self) -> ExecutionReaper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=60)

    def _watch(self) -> None:
        while not self._stopping.wait(REAP_POLL_SECONDS):
            try:
                self.reap_ended()
            except Exception:  # e.g. moto stopping under it: keep watching until stopped
                log.exception("reaper: listing or reaping executions failed")

    def ended(self) -> Iterator[dict[str, Any]]:
        """Executions of the watched state machines that ended ABORTED or TIMED_OUT."""
        pages = self.sfn.get_paginator("list_executions")
        for arn in self.state_machine_arns:
            for status in sorted(REAPED_STATUSES):
                try:
                    for page in pages.paginate(stateMachineArn=arn, statusFilter=status):
                        yield from page["executions"]
                except self.sfn.exceptions.StateMachineDoesNotExist:
                    # moto was reset under the stack (a test's own mock_aws): nothing of this
                    # stack is left to reap, and saying so every poll only buries real logs.
                    continue

    def reap_ended(self) -> list[str]:
        """Invokes the reaper for each ended execution not handled yet, once it has been seen
        ended for ``REAP_AFTER_SECONDS`` (moto lists no stop date for a timed-out one); the
        ARNs invoked."""
        now = time.monotonic()
        invoked = []
        for execution in self.ended():
            arn = execution["executionArn"]
            seen = self.seen.setdefault(arn, now)
            if arn in self.finished or now - seen < REAP_AFTER_SECONDS:
                continue
            invoked.append(arn)
            self.attempts[arn] = self.attempts.get(arn, 0) + 1
            if self.invoke(arn) or self.attempts[arn] >= REAP_ATTEMPTS:
                self.finished.add(arn)
        return invoked

    def invoke(self, execution_arn: str) -> bool:
        """One delivery of the execution's event to ``reap_execution``; True if it ran."""
        event = status_change_event(self.sfn.describe_execution(executionArn=execution_arn))
        response = self.lambda_client.invoke(
            FunctionName=function_arn(REAPER_FUNCTION), Payload=json.dumps(event)
        )
        result = json.loads(response["Payload"].read() or b"null")
        if "FunctionError" in response:
            log.error("reaper: %s failed: %s", execution_arn, result)
            return False
        log.info("reaper: %s %s: %s", execution_arn, event["detail"]["status"], result)
        return True
