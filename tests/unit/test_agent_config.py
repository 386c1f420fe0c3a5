"""``shardvault-agent check`` and ``run`` refuse a configuration the daemon would misbehave on:
each problem on its own line, by field path, with its fix, on stderr with exit status 2 and no
traceback; and ``run`` refuses it before the daemon is built."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import yaml
from shardvault_agent import daemon
from shardvault_agent.cli import main

GOOD = {"node_id": "n1", "cluster": "c", "engine": "sqlite"}


def sqlite_db(path: Path) -> Path:
    with closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS t(x)")
    return path


def write_config(tmp_path: Path, **fields: Any) -> Path:
    """A valid one-shard SQLite agent config with ``fields`` replacing or adding its own."""
    config = {
        **GOOD,
        "state_dir": str(tmp_path / "state"),
        "shards": [{"shard_id": "s1", "path": str(sqlite_db(tmp_path / "s1.db"))}],
        **fields,
    }
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def refused(capsys: pytest.CaptureFixture[str], command: str, config: Path) -> str:
    """Runs the CLI, asserts it refused cleanly, and returns its stderr."""
    status = main([command, "--config", str(config)])
    out, err = capsys.readouterr()
    assert status == 2, out + err
    assert "Traceback" not in err
    assert "config ok" not in out
    return err


@pytest.fixture
def daemons(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Agents that ``run`` built (none may be, for a refused config)."""
    built: list[Any] = []

    class Recorded:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            built.append(self)

        def install_signal_handlers(self) -> None: ...

        def run(self) -> None: ...

    monkeypatch.setattr(daemon, "Agent", Recorded)
    return built


def test_a_good_config_is_accepted_and_check_creates_nothing(tmp_path, capsys):
    config = write_config(tmp_path, restore_dir=str(tmp_path / "restored"))
    assert main(["check", "--config", str(config)]) == 0
    assert "config ok: node n1 of cluster c, 1 shard(s)" in capsys.readouterr().out
    assert not (tmp_path / "state").exists()
    assert not (tmp_path / "restored").exists()


@pytest.mark.parametrize(
    "field",
    [
        "poll_interval_seconds",
        "busy_poll_interval_seconds",
        "busy_ring_poll_seconds",
        "busy_window_seconds",
        "heartbeat_interval_seconds",
        "task_heartbeat_seconds",
    ],
)
@pytest.mark.parametrize("value", [0, -1])
def test_an_interval_that_is_not_above_zero_is_refused(tmp_path, capsys, field, value):
    err = refused(capsys, "check", write_config(tmp_path, **{field: value}))
    assert f"- {field}: " in err
    assert f"got {value}. Fix: use a value more than 0 " in err


def test_run_refuses_before_the_daemon_is_built(tmp_path, capsys, daemons):
    err = refused(capsys, "run", write_config(tmp_path, poll_interval_seconds=-0.5))
    assert "- poll_interval_seconds: " in err
    assert daemons == []


def test_run_starts_the_daemon_with_a_good_config(tmp_path, daemons):
    assert main(["run", "--config", str(write_config(tmp_path))]) == 0
    assert len(daemons) == 1


def test_a_shard_given_twice_is_refused_at_the_repeat(tmp_path, capsys):
    db = str(sqlite_db(tmp_path / "s1.db"))
    other = str(sqlite_db(tmp_path / "other.db"))
    shards = [
        {"shard_id": "s1", "path": db},
        {"shard_id": "s2", "path": other},
        {"shard_id": "s1", "path": db, "role": "follower"},
    ]
    err = refused(capsys, "check", write_config(tmp_path, shards=shards))
    assert "- shards.2.shard_id: 's1' is also shards.0.shard_id. Fix: give each" in err
    assert f"- shards.2.path: '{db}' is also shards.0.path." in err
    assert "shards.1" not in err


@pytest.mark.parametrize(
    ("ports", "expected"),
    [
        ([0, 100], "- restore_ports.0: Input should be greater than or equal to 1, got 0."),
        ([5433, 70000], "- restore_ports.1: Input should be less than or equal to 65535"),
        ([6000, 5000], "- restore_ports: the range 6000-5000 ends below its start. Fix: write "),
        ([5433], "- restore_ports.1: Field required"),
    ],
)
def test_restore_ports_must_be_an_ordered_range_of_ports(tmp_path, capsys, ports, expected):
    err = refused(capsys, "check", write_config(tmp_path, restore_ports=ports))
    assert expected in err


def test_every_problem_is_listed_one_a_line(tmp_path, capsys):
    config = write_config(
        tmp_path, heartbeat_interval_seconds=-5, restore_ports=[9, 1], poll_intervall=1
    )
    err = refused(capsys, "check", config)
    problems = [line for line in err.splitlines() if line.startswith("- ")]
    assert len(problems) == 3, err
    assert all(" Fix: " in line for line in problems)
    assert "- poll_intervall: unknown field. Fix: remove poll_intervall or correct its " in err
    assert "did you mean poll_interval_seconds?" in err


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path, capsys):
    config = tmp_path / "agent.yaml"
    config.write_text("node_id: n1\ncluster: c\n  engine: sqlite\n")
    err = refused(capsys, "check", config)
    assert f"agent config {config} is not valid YAML, line 3, column 9" in err
    assert "Fix: correct the YAML there" in err


def test_a_file_without_fields_is_refused(tmp_path, capsys):
    config = tmp_path / "agent.yaml"
    config.write_text("")
    assert "holds no mapping of fields" in refused(capsys, "run", config)


@pytest.mark.parametrize("field", ["state_dir", "restore_dir"])
def test_a_directory_that_is_a_file_is_refused(tmp_path, capsys, field):
    (tmp_path / "a-file").write_text("x")
    err = refused(capsys, "check", write_config(tmp_path, **{field: str(tmp_path / "a-file")}))
    assert f"- {field}: {tmp_path / 'a-file'} is not a directory. Fix: point {field} at " in err


def test_a_directory_under_a_file_cannot_be_created(tmp_path, capsys, daemons):
    (tmp_path / "a-file").write_text("x")
    state = tmp_path / "a-file" / "state"
    err = refused(capsys, "run", write_config(tmp_path, state_dir=str(state)))
    assert f"- state_dir: {state} cannot be created: {tmp_path / 'a-file'} is not a dir" in err
    assert daemons == []


def test_a_missing_sqlite_file_is_refused_and_not_created(tmp_path, capsys, daemons):
    misspelled = tmp_path / "s1.dbb"
    config = write_config(tmp_path, shards=[{"shard_id": "s1", "path": str(misspelled)}])
    for command in ("check", "run"):
        err = refused(capsys, command, config)
        assert f"- shards.0: SQLite shard s1: path {misspelled} does not exist." in err
        assert "Fix: correct 'path' in the agent config" in err
    assert not misspelled.exists()
    assert daemons == []


@pytest.mark.parametrize(
    ("content", "expected"),
    [(b"", "is an empty file, not a database"), (b"id,name\n1,a\n", "is not a SQLite database")],
)
def test_a_file_that_is_no_sqlite_database_is_refused(tmp_path, capsys, content, expected):
    not_a_db = tmp_path / "s1.csv"
    not_a_db.write_bytes(content)
    config = write_config(tmp_path, shards=[{"shard_id": "s1", "path": str(not_a_db)}])
    assert f"path {not_a_db} {expected}" in refused(capsys, "check", config)


def test_a_postgres_data_dir_without_pg_version_is_refused(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    shards = [
        {"shard_id": "p1", "data_dir": str(tmp_path / "empty"), "conninfo": "host=/nowhere"},
        {"shard_id": "p2", "data_dir": str(tmp_path / "absent"), "conninfo": "host=/nowhere"},
    ]
    config = write_config(tmp_path, engine="postgres", shards=shards)
    err = refused(capsys, "check", config)
    assert f"- shards.0: PostgreSQL shard p1: data_dir {tmp_path / 'empty'} holds no " in err
    assert f"- shards.1: PostgreSQL shard p2: data_dir {tmp_path / 'absent'} does not " in err


def test_an_engine_field_missing_from_a_shard_is_named(tmp_path, capsys):
    config = write_config(tmp_path, engine="postgres")  # the shard has a path, not data_dir
    err = refused(capsys, "check", config)
    assert "- shards.0.data_dir: postgres shards need data_dir. Fix: add data_dir" in err
    assert "- shards.0.conninfo: postgres shards need conninfo." in err


def test_check_tries_what_run_does_and_refuses_a_state_dir_it_cannot_write(tmp_path, capsys):
    """Issue 44 (7): as root, os.access says /proc is writable; run then died creating its
    state directory. check now creates it and writes a file there, as run would."""
    err = refused(capsys, "check", write_config(tmp_path, state_dir="/proc/shardvault"))
    assert "state_dir: /proc/shardvault cannot be written" in err
    assert not Path("/proc/shardvault").exists()


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"restore_dir": "STATE"}, "restore_dir: {tmp}/state overlaps state_dir"),
        ({"restore_dir": "STATE/restored"}, "overlaps state_dir"),
        ({"restore_dir": "DATA"}, "overlaps shards.0's data"),
        ({"state_dir": "relative/state"}, "state_dir: relative/state is relative"),
    ],
)
def test_directories_that_overlap_or_are_relative_are_refused(tmp_path, capsys, fields, expected):
    values = {
        k: v.replace("STATE", str(tmp_path / "state")).replace("DATA", str(tmp_path))
        for k, v in fields.items()
    }
    err = refused(capsys, "check", write_config(tmp_path, **values))
    assert expected.replace("{tmp}", str(tmp_path)) in " ".join(err.split())


def test_an_upload_parallelism_past_reason_is_refused(tmp_path, capsys):
    err = refused(capsys, "check", write_config(tmp_path, upload_parallelism=100000))
    assert "upload_parallelism" in err


def check_sibling_repeatedly(args: tuple[str, int]) -> list[str]:
    """Checks one node's state directory again and again (run in its own process)."""
    from shardvault_agent.config import directory_problem

    path, times = args
    found = (directory_problem("state_dir", Path(path)) for _ in range(times))
    return [problem for problem in found if problem is not None]


def test_agents_checked_at_once_under_one_missing_parent_all_pass(tmp_path):
    """CI saw it: three agents started together under a missing ``agent-state``; one's check
    removed the parent it had made while another's was between finding and reading it, and
    the other refused to run ("agent-state is not a directory")."""
    import multiprocessing

    parent = tmp_path / "agent-state"
    siblings = [(str(parent / f"node-{i}"), 300) for i in range(4)]
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        problems = [p for found in pool.map(check_sibling_repeatedly, siblings) for p in found]
    assert problems == []
