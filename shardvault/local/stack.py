"""The local stack: the AWS deployment's moving parts on one machine, with no AWS account.

- moto's server, in this process, with its Step Functions interpreter executing the real ASL
  files (``execute_state_machine``), plus DynamoDB, SNS and the S3 *work* bucket that the
  Distributed Map's ItemReader reads plans from;
- the Lambda handlers, served in-process by ``LambdaBridge``;
- the *store*: MinIO when its binary is present (real S3 checksum semantics), else a bucket in
  moto's S3, verified by reading objects back since moto's checksums cannot be trusted;
- the *vault*: a bucket in moto's S3 with Object Lock (it keeps archive storage classes, which
  MinIO refuses); clusters of ``policy.yaml`` beside this module are promoted into it;
- agents as separate OS processes, given control-plane endpoints but no store credentials.

``stack.env`` in the stack's directory records the endpoints and names, so CLI commands run
from another shell reach the same stack.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import yaml

from shardvault import lambda_support
from shardvault.local.lambda_bridge import LambdaBridge
from shardvault.local.ports import free_port
from shardvault.services import Services
from shardvault.settings import Settings
from shardvault.store import s3_client

REGION = "us-east-1"
ACCOUNT = "123456789012"
ROOT = Path(__file__).resolve().parents[2]
STATE_MACHINES = ROOT / "statemachines"
FUNCTIONS = {
    "ValidateBackupFunctionArn": "validate_backup",
    "DispatchFunctionArn": "dispatch",
    "PlanBackupFunctionArn": "plan_backup",
    "SignPartsFunctionArn": "sign_parts",
    "CompleteUploadFunctionArn": "complete_upload",
    "CheckUploadsFunctionArn": "check_uploads",
    "FinalizeBackupFunctionArn": "finalize_backup",
    "CleanupBackupFunctionArn": "cleanup_backup",
    "ValidateRestoreFunctionArn": "validate_restore",
    "PlanRestoreFunctionArn": "plan_restore",
    "ThawObjectsFunctionArn": "thaw_objects",
    "SignDownloadFunctionArn": "sign_download",
    "RecordDownloadFunctionArn": "record_download",
    "FinalizeRestoreFunctionArn": "finalize_restore",
    "CleanupRestoreFunctionArn": "cleanup_restore",
    "PromoteBackupFunctionArn": "promote_backup",
    "RecordPromotionFailureFunctionArn": "record_promotion_failure",
    "DecideRetentionFunctionArn": "decide_retention",
    "ExpireBackupFunctionArn": "expire_backup",
}
NAMES = {
    "catalog_table": "shardvault-catalog",
    "nodes_table": "shardvault-nodes",
    "inbox_table": "shardvault-inbox",
    "work_bucket": "shardvault-work",
    "store_bucket": "shardvault-store",
    "vault_bucket": "shardvault-vault",
}
LOCAL_POLICY = Path(__file__).with_name("policy.yaml")


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
    policy_file: Path = LOCAL_POLICY
    moto_port: int = 0
    settings: Settings | None = None
    state_machine_arn: str = ""
    restore_state_machine_arn: str = ""
    retention_state_machine_arn: str = ""
    endpoint: str = ""
    _server: Any = None
    _minio: Any = None
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
        self._start_moto()
        store_url, store_endpoint, credentials = self._start_store()
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
            topic_arn=self._create_resources(),
            heartbeat_max_age_seconds=self.heartbeat_max_age,
            thaw_first_wait_seconds=1,
            vault_url=f"s3://{NAMES['vault_bucket']}/backups",
            vault_endpoint=self.endpoint,
            policy_file=str(self.policy_file),
        )
        lambda_support.use_settings(self.settings)
        self.state_machine_arn = self._create_state_machine("backup")
        self.restore_state_machine_arn = self._create_state_machine("restore")
        self.retention_state_machine_arn = self._create_state_machine("retention")
        self._write_env_file()
        return self

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
        LambdaBridge({f"shardvault-{n}": f"functions.{n}" for n in FUNCTIONS.values()}).install()
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

    def client_config(self) -> Any:
        """What the CLI's operations need to reach this stack."""
        from shardvault.operations import ClientConfig

        return ClientConfig(
            self.state_machine_arn,
            self.settings.catalog_table,
            self.settings.nodes_table,
            self.restore_state_machine_arn,
            self.retention_state_machine_arn,
        )

    def store_client(self) -> Any:
        """An S3 client for the store, with the store's own credentials (the control plane's)."""
        return self.services().store_s3

    def services(self) -> Services:
        return Services(self.settings)

    def _create_resources(self) -> str:
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
        return boto3.client("sns").create_topic(Name="shardvault-notifications")["TopicArn"]

    def _create_state_machine(self, name: str) -> str:
        definition = render_asl(
            STATE_MACHINES / f"{name}.asl.json", substitutions(NAMES["work_bucket"])
        )
        response = boto3.client("stepfunctions").create_state_machine(
            name=f"shardvault-{name}",
            definition=definition,
            roleArn=f"arn:aws:iam::{ACCOUNT}:role/shardvault-{name}",
        )
        return response["stateMachineArn"]

    def _write_env_file(self) -> None:
        env = {
            **control_plane_env(self.endpoint),
            "SHARDVAULT_STATE_MACHINE_ARN": self.state_machine_arn,
            "SHARDVAULT_RESTORE_STATE_MACHINE_ARN": self.restore_state_machine_arn,
            "SHARDVAULT_RETENTION_STATE_MACHINE_ARN": self.retention_state_machine_arn,
            "SHARDVAULT_CATALOG_TABLE": self.settings.catalog_table,
            "SHARDVAULT_NODES_TABLE": self.settings.nodes_table,
            "SHARDVAULT_INBOX_TABLE": self.settings.inbox_table,
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
        process = subprocess.Popen(
            [sys.executable, "-m", "shardvault_agent.cli", "run", "--config", str(path)],
            env=self.agent_env(extra_env),
            stdout=log,
            stderr=subprocess.STDOUT,
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
        from shardvault.tables import NodeRegistry, table

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

    # --- stop --------------------------------------------------------------------------------
    def stop(self) -> None:
        for node_id in list(self.agents):
            self.stop_agent(node_id)
        if self._minio is not None:
            self._minio.stop()
            self._minio = None
        if self._server is not None:
            self._server.stop()
            self._server = None

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
