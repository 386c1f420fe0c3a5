"""The agent's configuration file (YAML), validated into ``AgentConfig``.

Terms:
- *shard entry*: where one shard's data lives on this node and the node's role for it. For
  SQLite, ``path`` is the database file; for PostgreSQL, ``data_dir`` and ``conninfo`` name
  the instance (one shard per instance).
- *field path*: where in the file a problem is, e.g. ``shards.1.path`` (the second shard's
  path). ``load_config`` refuses a file naming every problem by its field path, one line
  each, with its fix.
- *host check* (``check_host``): what only this host can tell: ``state_dir`` and
  ``restore_dir`` are writable directories (or can be created), and each shard's data is
  where its entry says (the engine adapter's ``check``). It reads only: nothing is created.

``shardvault-agent check`` and ``run`` both load the file and check the host, so a file that
``check`` accepts is one the daemon starts with.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import stat
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from shardvault.contracts.models import Engine, Role, check_name
from shardvault.errors import InvalidRequest, ShardDataMissing

CONFIG_ERROR = "agent_config"  # the pydantic error type of problems that carry their own fix
FIELDS_REFERENCE = "docs/reference/agent-config.md lists every field"
Port = Annotated[int, Field(ge=1, le=65535)]


def invalid(message: str, fix: str) -> PydanticCustomError:
    """A validation problem that carries its fix to ``load_config``."""
    return PydanticCustomError(CONFIG_ERROR, message, {"fix": fix})


def valid_name(kind: str, value: str) -> str:
    try:
        return check_name(kind, value)
    except InvalidRequest as error:
        raise invalid(error.message.rstrip("."), error.fix.rstrip(".")) from None


class ShardConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    shard_id: str = Field(description="The shard's name, the same on every node that holds it.")
    role: Role = Field(Role.LEADER, description="leader or follower; backups read leaders.")
    path: Path | None = Field(None, description="SQLite: the database file.")
    data_dir: Path | None = Field(
        None,
        description="PostgreSQL, MariaDB: the data directory; RocksDB: the database directory; "
        "hooks: the directory the hooks act on.",
    )
    conninfo: str | None = Field(None, description="PostgreSQL: a libpq connection string.")
    socket: Path | None = Field(None, description="MariaDB: the server's Unix socket.")
    wal_spool_dir: Path | None = Field(
        None,
        description="PostgreSQL, continuous archiving: the directory the server's "
        "archive_command (shardvault-wal-push --spool DIR) fills; the agent stores what it "
        "finds there and then removes it (None: no archiving).",
    )
    archive_binlogs: bool = Field(
        False,
        description="MariaDB, continuous archiving: the agent stores the server's closed "
        "binary logs (closing the open one after the policy's archive.max_delay_seconds) and "
        "purges each from the server once stored.",
    )

    @field_validator("shard_id")
    @classmethod
    def _valid_shard_id(cls, value: str) -> str:
        return valid_name("shard_id", value)


class HookCommands(BaseModel):
    """The commands of the ``hooks`` engine (``engines.hooks`` defines what each must do)."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: list[str] = Field(
        default_factory=list,
        description='hooks: fixes the shard\'s files and prints {"directory": ..., '
        '"marker": {...}} as JSON (an argument list, run without a shell).',
    )
    release: list[str] = Field(
        default_factory=list,
        description="hooks: gives back what checkpoint held (may run twice).",
    )
    flush: list[str] = Field(
        default_factory=list, description="hooks: optional, before checkpoint."
    )
    finish: list[str] = Field(
        default_factory=list,
        description="hooks: optional, checks a restored shard (exit 0: it passed).",
    )
    timeout_seconds: float = Field(
        300, gt=0, description="hooks: a hook running longer is killed (HookTimedOut)."
    )

    @field_validator("checkpoint", "release", "flush", "finish")
    @classmethod
    def _absolute_program(cls, command: list[str], info: ValidationInfo) -> list[str]:
        if command and not Path(command[0]).is_absolute():
            raise invalid(
                f"the {info.field_name} hook's program {command[0]!r} is not an absolute path",
                "name the program by its absolute path (hooks run without a shell or PATH "
                "lookup), e.g. ['/usr/local/bin/snapshot', 'create']",
            )
        return command


class AgentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    node_id: str = Field(description="Unique name of this node.")
    cluster: str = Field(description="Cluster this node belongs to.")
    engine: Engine = Field(
        description="postgres, mariadb, sqlite, rocksdb or hooks (command hooks)."
    )
    hooks: HookCommands | None = Field(
        None,
        validate_default=True,
        description="hooks: the commands that flush, checkpoint, release and finish shards.",
    )
    shards: list[ShardConfig] = Field(description="The shards this node holds.")
    state_dir: Path = Field(description="Where the agent keeps checkpoints, spool and snapshots.")
    poll_interval_seconds: float = Field(
        0.5,
        gt=0,
        description="How often an idle agent without a working doorbell reads its inbox.",
    )
    busy_poll_interval_seconds: float = Field(
        0.05,
        gt=0,
        description="How often the inbox is read while a backup runs (commands come in bursts) "
        "and no doorbell works.",
    )
    busy_ring_poll_seconds: float = Field(
        1.0,
        gt=0,
        description="While busy with a working doorbell, how often the inbox is read anyway (a "
        "ring wakes the agent at once; a lost ring delays a command at most this long).",
    )
    busy_window_seconds: float = Field(
        30.0, gt=0, description="How long after a command the agent counts as busy."
    )
    doorbell_wait_seconds: int = Field(
        20,
        ge=1,
        le=20,
        description="How long one listen to the doorbell queue waits for a ring (an SQS long "
        "poll; 20 at most).",
    )
    idle_listen_pause_seconds: float = Field(
        10.0,
        ge=0,
        description="While idle, the pause between two listens to the doorbell: each listen is "
        "a paid SQS request, and a ring waits in the queue, so a command posted to an idle "
        "agent starts at most this much later (busy agents listen without a pause).",
    )
    idle_inbox_poll_seconds: float = Field(
        45.0,
        gt=0,
        description="While idle with a doorbell, how often the inbox is read anyway (a lost "
        "ring delays a command at most this long: below the workflows' 60 s task heartbeat, "
        "which fails a command nobody picked up).",
    )
    heartbeat_interval_seconds: float = Field(
        5.0, gt=0, description="Registry heartbeat period while busy."
    )
    idle_heartbeat_seconds: float = Field(
        300.0, gt=0, description="Registry heartbeat period while idle."
    )
    task_heartbeat_seconds: float = Field(10.0, gt=0, description="Task-token heartbeat period.")
    max_parallel_commands: int = Field(4, ge=1, description="Commands run at once.")
    upload_parallelism: int = Field(4, ge=1, le=64, description="Parts of one object sent at once.")
    part_attempts: int = Field(5, ge=1, description="Tries per part before the command fails.")
    rate_limit_bytes_per_second: int | None = Field(
        None, ge=1, description="Cap on bytes read per second (None: no cap)."
    )
    low_priority: bool = Field(False, description="Lower CPU (nice) and IO (ionice) priority.")
    throttle_stall_margin: float = Field(
        0.10,
        gt=0,
        le=1,
        description="Adaptive throttling (the policy's upload.throttle): the share of time a "
        "backup may add to the database server's CPU or IO stall (Linux PSI) over what it "
        "was the minute before; above it the read rate is cut.",
    )
    throttle_latency_ratio: float = Field(
        1.25,
        gt=1,
        description="Adaptive throttling: how much slower than before the backup the "
        "server may answer the agent's probe while other clients are connected.",
    )
    throttle_latency_slack_ms: float = Field(
        2.0,
        ge=0,
        description="Adaptive throttling: the probe may always be this much slower than before "
        "the backup (a fast answer's ratio alone is noise).",
    )
    archive_parallelism: int = Field(
        2, ge=1, description="WAL batches of the shards' spools stored at once."
    )
    archive_poll_seconds: float = Field(
        1.0, gt=0, description="How often the agent looks into its shards' WAL spools."
    )
    archive_handoff_mib: float = Field(
        128.0,
        ge=0,
        description="PostgreSQL with archiving: once a backup holds more WAL than this on its "
        "source, it lets its slot go and takes its WAL from the archive (copied at Finalize); "
        "a backup that held less copies its few segments itself. 0: always from the archive.",
    )
    restore_dir: Path | None = Field(
        None,
        description="Where restored shards go, one directory each (None: no restores here).",
    )
    restore_link_dirs: list[Path] = Field(
        default_factory=list,
        description="Directories under which a restore may place a remapped tablespace "
        "(shardvault restore --tablespace NAME=DIR); none: tablespaces go only to restore_dir.",
    )
    restore_capacity_bytes: int | None = Field(
        None, ge=0, description="Cap on the bytes restores may place here (None: free space)."
    )
    restore_ports: tuple[Port, Port] = Field(
        (5433, 5532),
        description="PostgreSQL: the port range restored instances listen on (low, high; "
        "each 1-65535).",
    )
    validation_jobs: int = Field(
        default_factory=lambda: min(4, os.cpu_count() or 1),
        ge=1,
        description="PostgreSQL: connections pg_amcheck checks a restored instance with "
        "(its --jobs; default: the cores, at most 4).",
    )

    @field_validator("node_id", "cluster")
    @classmethod
    def _valid_name(cls, value: str, info: ValidationInfo) -> str:
        return valid_name(info.field_name or "name", value)

    @field_validator("hooks")
    @classmethod
    def _hooks_where_needed(
        cls, hooks: HookCommands | None, info: ValidationInfo
    ) -> HookCommands | None:
        from shardvault_agent.engines import adapter_class  # the adapters import this module

        engine = info.data.get("engine")
        needs = engine is not None and info.field_name in adapter_class(engine).config_fields
        if needs and (hooks is None or not hooks.checkpoint or not hooks.release):
            raise invalid(
                f"{engine} agents need hooks.checkpoint and hooks.release",
                "add a 'hooks' section naming the commands (docs/guide/hooks.md)",
            )
        return hooks

    @field_validator("restore_ports")
    @classmethod
    def _ordered_ports(cls, ports: tuple[int, int]) -> tuple[int, int]:
        low, high = ports
        if low > high:
            raise invalid(
                f"the range {low}-{high} ends below its start",
                f"write the lower port first: [{high}, {low}]",
            )
        return ports

    @field_validator("shards")
    @classmethod
    def _consistent_shards(
        cls, shards: list[ShardConfig], info: ValidationInfo
    ) -> list[ShardConfig]:
        """Each shard once, each source once, and the fields its engine needs."""
        problems = [
            *_engine_fields(info.data.get("engine"), shards),
            *_repeats(shards, "shard_id", "a node holds each shard once (its role says how)"),
            *_repeats(shards, "path", "each shard is its own database file"),
            *_repeats(shards, "data_dir", "each shard is its own server"),
        ]
        if problems:
            # Raised as a ValidationError so pydantic reports each problem at its own path.
            raise ValidationError.from_exception_data("shards", problems)
        return shards


def _engine_fields(engine: Engine | None, shards: list[ShardConfig]) -> list[InitErrorDetails]:
    from shardvault_agent.engines import adapter_class  # the adapters import this module

    needs = adapter_class(engine).shard_fields if engine is not None else ()
    return [
        InitErrorDetails(
            type=invalid(
                f"{engine} shards need {name}",
                f"add {name} ({ShardConfig.model_fields[name].description.rstrip('.')})",
            ),
            loc=(index, name),
            input=None,
        )
        for index, shard in enumerate(shards)
        for name in needs
        if getattr(shard, name) is None
    ]


def _repeats(shards: list[ShardConfig], field: str, why: str) -> list[InitErrorDetails]:
    """Shard entries that repeat an earlier entry's ``field`` (the daemon would keep one)."""
    first: dict[Any, int] = {}
    problems = []
    for index, shard in enumerate(shards):
        value = getattr(shard, field)
        if value is None:
            continue
        key = value.absolute() if isinstance(value, Path) else value
        if key in first:
            problems.append(
                InitErrorDetails(
                    type=invalid(
                        f"{str(value)!r} is also shards.{first[key]}.{field}",
                        f"give each shard entry its own {field}: {why}",
                    ),
                    loc=(index, field),
                    input=value,
                )
            )
        else:
            first[key] = index
    return problems


# --- Loading -----------------------------------------------------------------------------------
def load_config(path: Path) -> AgentConfig:
    """Reads and validates an agent config; raises ``InvalidRequest`` naming every problem."""
    data = _read_yaml(path)
    try:
        return AgentConfig.model_validate(data)
    except ValidationError as error:
        lines = "".join(f"- {problem_line(item)}\n" for item in error.errors())
        raise InvalidRequest(
            f"agent config {path} has {error.error_count()} problem(s):\n{lines}",
            fix=f"correct each field named above ({FIELDS_REFERENCE}).",
        ) from None


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise InvalidRequest(
            f"agent config {path} does not exist.",
            fix="pass --config with the path of an existing file.",
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or "it is not a text file"
        raise InvalidRequest(
            f"agent config {path} cannot be read: {reason}.",
            fix="pass --config with the path of a readable YAML file.",
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error)
        raise InvalidRequest(
            f"agent config {path} is not valid YAML{where}: {problem}.",
            fix="correct the YAML there: one 'field: value' per line, nested lines indented "
            "with spaces, and values holding ': ' or starting with '*', '&', '[' or '{' quoted.",
        ) from None
    if not isinstance(data, dict):
        raise InvalidRequest(
            f"agent config {path} holds no mapping of fields.",
            fix=f"write one 'field: value' per line, starting with node_id ({FIELDS_REFERENCE}).",
        )
    return data


def problem_line(error: Any) -> str:
    """One pydantic error as '<field path>: <problem>, got <value>. Fix: <fix>.'"""
    loc = [str(part) for part in error["loc"]]
    path = ".".join(loc) or "(top level)"
    kind, ctx = error["type"], error.get("ctx", {})
    field = _field_at(loc)
    message = "unknown field" if kind == "extra_forbidden" else error["msg"]
    if kind not in ("missing", "extra_forbidden", CONFIG_ERROR):
        message += f", got {_short(error['input'])}"
    if kind == CONFIG_ERROR:
        fix = ctx["fix"]
    elif kind == "extra_forbidden":
        fix = _unknown_field_fix(loc)
    else:
        fix = _constraint_fix(kind, ctx, loc[-1] if loc else "")
        if field is not None and field.description:
            fix += f" ({_field_name(loc)}: {field.description.rstrip('.')})"
    return f"{path}: {message.rstrip('.')}. Fix: {fix.rstrip('.')}."


def _constraint_fix(kind: str, ctx: dict[str, Any], leaf: str) -> str:
    if kind == "missing":
        return f"add {leaf}"
    limits = {"gt": "more than", "ge": "at least", "lt": "less than", "le": "at most"}
    for key, words in limits.items():
        if key in ctx:
            limit = ctx[key]
            return f"use a value {words} {f'{limit:g}' if isinstance(limit, float) else limit}"
    if kind in ("enum", "literal_error"):
        return f"use one of {ctx['expected']}"
    if kind.startswith(("int_", "float_")):
        return "write a number without quotes" + (", a whole one" if kind.startswith("int") else "")
    if kind in ("list_type", "tuple_type"):
        return f"write {leaf} as a YAML list"
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return f"write {leaf} as a mapping of fields"
    if kind in ("too_short", "too_long"):
        return "give exactly two ports: [low, high]"
    return "see the field's meaning"


def _model_of(loc: list[str]) -> type[BaseModel]:
    """The model whose field ``loc`` ends in: a shard entry's (``shards.<i>.<name>``) or the
    agent's."""
    return ShardConfig if loc[:1] == ["shards"] and len(loc) >= 3 else AgentConfig


def _field_name(loc: list[str]) -> str:
    return loc[2] if _model_of(loc) is ShardConfig else (loc[0] if loc else "")


def _field_at(loc: list[str]) -> Any:
    return _model_of(loc).model_fields.get(_field_name(loc))


def _unknown_field_fix(loc: list[str]) -> str:
    known = list(_model_of(loc).model_fields)
    guess = difflib.get_close_matches(loc[-1], known, n=1)
    meant = f": did you mean {guess[0]}?" if guess else ""
    return f"remove {loc[-1]} or correct its spelling{meant} (known here: {', '.join(known)})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --- The host ----------------------------------------------------------------------------------
def check_host(config: AgentConfig) -> None:
    """Refuses, naming every problem with its fix, a configuration this host cannot run:
    directories the agent cannot write, and shards whose data is not where their entries
    say. Reads only."""
    from shardvault_agent.engines import adapter_for  # the adapters import this module

    problems = [
        problem
        for field in ("state_dir", "restore_dir")
        if (problem := directory_problem(field, getattr(config, field))) is not None
    ]
    problems += placement_problems(config)
    engine = adapter_for(config)
    for index, shard in enumerate(config.shards):
        try:
            engine.check(shard)
        except ShardDataMissing as error:
            problems.append(f"shards.{index}: {error}")
    if problems:
        lines = "".join(f"- {problem}\n" for problem in problems)
        raise InvalidRequest(
            f"node {config.node_id} cannot run on this host: {len(problems)} problem(s):\n{lines}",
            fix="correct each problem named above, then check again.",
        )


def placement_problems(config: AgentConfig) -> list[str]:
    """Directories that would overlap: restored shards written into the agent's own state or
    over a source shard's data; a relative directory (run from systemd, it would be under /)."""
    problems = [
        f"{field}: {path} is relative. Fix: give {field} as an absolute path."
        for field in ("state_dir", "restore_dir")
        if (path := getattr(config, field)) is not None and not path.is_absolute()
    ]
    restore_dir = config.restore_dir.absolute() if config.restore_dir else None
    if restore_dir is None:
        return problems
    state_dir = config.state_dir.absolute()
    if overlaps(restore_dir, state_dir):
        problems.append(
            f"restore_dir: {restore_dir} overlaps state_dir {state_dir}. Fix: give restored "
            "shards a directory of their own (a restore would replace the agent's state)."
        )
    for link_dir in config.restore_link_dirs:
        if not link_dir.is_absolute():
            problems.append(
                f"restore_link_dirs: {link_dir} is relative. Fix: give it as an absolute path."
            )
        elif clash := [
            p
            for p in (state_dir, *(s.data_dir for s in config.shards if s.data_dir))
            if overlaps(link_dir, p.absolute())
        ]:
            problems.append(
                f"restore_link_dirs: {link_dir} overlaps {clash[0]}. Fix: give restored "
                "tablespaces a directory apart from the agent's state and the node's own data."
            )
    for index, shard in enumerate(config.shards):
        source = shard.data_dir or shard.path
        clash = source is not None and (
            overlaps(restore_dir, source.absolute())
            if shard.data_dir
            else restore_dir in source.absolute().parents  # a SQLite file inside it
        )
        if clash:
            problems.append(
                f"restore_dir: {restore_dir} overlaps shards.{index}'s data {source}. Fix: "
                "give restored shards a directory apart from the node's own data."
            )
    return problems


def overlaps(one: Path, other: Path) -> bool:
    return one == other or one in other.parents or other in one.parents


# How often a check starts again when a directory it found vanished under it.
VANISHED_RETRIES = 10


def directory_problem(field: str, path: Path | None) -> str | None:
    """Why ``path`` is not a directory the agent can write and cannot become one (the agent
    creates a missing one, with its parents); None when it is or can. The check tries what
    ``run`` does (create it, write a file in it) and then removes what it made: a permission
    bit or a filesystem (``/proc``) can refuse what ``os.access`` allows.

    Agents on one host start together and check siblings under one parent: one check removes
    the parent it made while another is between finding it and writing in it. A directory that
    vanishes mid-check is such a neighbour, not a problem, so the check starts again."""
    if path is None:
        return None
    target = path.absolute()
    for _ in range(VANISHED_RETRIES):
        try:
            return directory_problem_once(field, target)
        except (FileNotFoundError, FileExistsError) as error:
            vanished = error  # a neighbour's cleanup, or a filesystem that refuses (/proc)
    return unwritable(field, target, vanished)


def directory_problem_once(field: str, target: Path) -> str | None:
    """One try of ``directory_problem``; raises FileNotFoundError or FileExistsError (from
    ``mkdir``, which finds a parent gone that it was told exists) when a directory it found
    vanishes before it is done."""
    nearest = next(p for p in (target, *target.parents) if os.path.lexists(p))
    if not stat.S_ISDIR(os.stat(nearest).st_mode):  # FileNotFoundError: it vanished
        what = "is" if nearest == target else f"cannot be created: {nearest} is"
        return (
            f"{field}: {target} {what} not a directory. Fix: point {field} at a directory "
            "(a missing one is created), or move that file away."
        )
    if not os.access(nearest, os.W_OK | os.X_OK):
        os.stat(nearest)  # FileNotFoundError: it vanished, and access said no for that
        what = "is not writable" if nearest == target else f"cannot be created in {nearest}"
        return (
            f"{field}: {target} {what} by this user. Fix: give the agent's user write "
            f"access there, or point {field} at a directory it can write."
        )
    try:
        try_writing(target, nearest)
    except (FileNotFoundError, FileExistsError):
        raise
    except OSError as error:
        return unwritable(field, target, error)
    return None


def unwritable(field: str, target: Path, error: OSError) -> str:
    return (
        f"{field}: {target} cannot be written ({error.strerror or error}). Fix: point "
        f"{field} at a directory on a writable filesystem this user owns."
    )


def try_writing(target: Path, nearest: Path) -> None:
    """Creates ``target`` (from ``nearest``, its deepest existing ancestor), writes and
    removes a file in it, then removes the directories it created."""
    made = [p for p in (target, *target.parents) if p not in (nearest, *nearest.parents)]
    try:
        target.mkdir(parents=True, exist_ok=True)
        probe = target / f".shardvault-check-{os.getpid()}"
        probe.write_bytes(b"check")
        probe.unlink()
    finally:
        for directory in made:  # deepest first
            with contextlib.suppress(OSError):
                directory.rmdir()
