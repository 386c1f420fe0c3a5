"""The agent's configuration file (YAML), validated into ``AgentConfig``.

A *shard* entry says where one shard's data lives on this node and the node's role for it.
For SQLite, ``path`` is the database file; for PostgreSQL, ``data_dir`` and ``conninfo``
name the instance (one shard per instance).
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shardvault.errors import InvalidRequest
from shardvault.models import Engine, Role, check_name


class ShardConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    shard_id: str = Field(description="The shard's name, the same on every node that holds it.")
    role: Role = Field(Role.LEADER, description="leader or follower; backups read leaders.")
    path: Path | None = Field(None, description="SQLite: the database file.")
    data_dir: Path | None = Field(None, description="PostgreSQL: the data directory.")
    conninfo: str | None = Field(None, description="PostgreSQL: a libpq connection string.")


class AgentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    node_id: str = Field(description="Unique name of this node.")
    cluster: str = Field(description="Cluster this node belongs to.")
    engine: Engine = Field(description="postgres or sqlite.")
    shards: list[ShardConfig] = Field(description="The shards this node holds.")
    state_dir: Path = Field(description="Where the agent keeps checkpoints, spool and snapshots.")
    poll_interval_seconds: float = Field(
        0.5, description="How often an idle agent reads its inbox."
    )
    busy_poll_interval_seconds: float = Field(
        0.05,
        description="How often the inbox is read while a backup runs (commands come in bursts).",
    )
    busy_window_seconds: float = Field(
        30.0, description="How long after a command the agent counts as busy."
    )
    heartbeat_interval_seconds: float = Field(5.0, description="Registry heartbeat period.")
    task_heartbeat_seconds: float = Field(10.0, description="Task-token heartbeat period.")
    max_parallel_commands: int = Field(4, ge=1, description="Commands run at once.")
    upload_parallelism: int = Field(4, ge=1, description="Parts of one object sent at once.")
    part_attempts: int = Field(5, ge=1, description="Tries per part before the command fails.")
    rate_limit_bytes_per_second: int | None = Field(
        None, ge=1, description="Cap on bytes read per second (None: no cap)."
    )
    low_priority: bool = Field(False, description="Lower CPU (nice) and IO (ionice) priority.")
    restore_dir: Path | None = Field(
        None,
        description="Where restored shards go, one directory each (None: no restores here).",
    )
    restore_capacity_bytes: int | None = Field(
        None, ge=0, description="Cap on the bytes restores may place here (None: free space)."
    )
    restore_ports: tuple[int, int] = Field(
        (5433, 5532), description="PostgreSQL: the port range restored instances listen on."
    )
    validation_jobs: int = Field(
        default_factory=lambda: min(4, os.cpu_count() or 1),
        ge=1,
        description="PostgreSQL: connections pg_amcheck checks a restored instance with "
        "(its --jobs; default: the cores, at most 4).",
    )

    @model_validator(mode="after")
    def _check(self) -> AgentConfig:
        check_name("node_id", self.node_id)
        check_name("cluster", self.cluster)
        for shard in self.shards:
            check_name("shard_id", shard.shard_id)
            if self.engine == Engine.SQLITE and shard.path is None:
                raise ValueError(f"shard {shard.shard_id}: sqlite shards need 'path'")
            if self.engine == Engine.POSTGRES and (
                shard.data_dir is None or shard.conninfo is None
            ):
                raise ValueError(
                    f"shard {shard.shard_id}: postgres shards need 'data_dir' and 'conninfo'"
                )
        return self


def load_config(path: Path) -> AgentConfig:
    try:
        return AgentConfig.model_validate(yaml.safe_load(path.read_text()))
    except FileNotFoundError:
        raise InvalidRequest(
            f"agent config {path} does not exist.",
            fix="pass --config with the path of an existing file.",
        ) from None
    except (ValidationError, ValueError) as error:
        raise InvalidRequest(
            f"agent config {path} is invalid: {error}", fix="correct the fields named above."
        ) from None
