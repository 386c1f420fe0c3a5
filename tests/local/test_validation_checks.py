"""The engine layer of validation queries, on real servers: even a query the gate would refuse
cannot write, read files, run programs or outlast its timeout, and the checks leave the
restored databases as they found them (no role, no extension, pg_hba.conf unchanged).

The gate (``shardvault.contracts.sqlcheck``) is bypassed here on purpose: these calls are what a
query that slipped through it would meet.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from shardvault_agent import checks
from shardvault_agent.checks import REFUSED, raise_if_refused
from shardvault_agent.engines.mariadb import checks as mariadb_checks
from shardvault_agent.engines.postgres import checks as postgres_checks
from shardvault_agent.engines.sqlite import checks as sqlite_checks

from shardvault.errors import InvalidRequest
from shardvault.local.mariadb import init_server
from shardvault.local.mariadb import stop_server as stop_mariadb
from shardvault.local.postgres import init_instance


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    instance = init_instance(tmp_path_factory.mktemp("checks") / "data")
    instance.psql("CREATE TABLE orders (id int primary key, total int)")
    instance.psql("INSERT INTO orders SELECT g, g FROM generate_series(1, 100) g")
    instance.psql("CREATE SEQUENCE s")
    with instance:
        yield instance


def bypass_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checks, "check_validation_queries", lambda queries: queries)


def test_a_read_only_query_passes_and_leaves_nothing_behind(server) -> None:
    hba = (server.data_dir / "pg_hba.conf").read_bytes()
    result = postgres_checks.postgres_checks(server, ["SELECT count(*) = 100 FROM orders"], jobs=1)
    assert result == {"pg_amcheck --all": "ok", "SELECT count(*) = 100 FROM orders": "ok"}
    assert server.psql("SELECT count(*) FROM pg_roles WHERE rolname LIKE 'shardvault%'") == "0"
    assert server.psql("SELECT count(*) FROM pg_extension WHERE extname = 'amcheck'") == "0"
    assert server.psql("SELECT count(*) FROM pg_namespace WHERE nspname = 'pg_amcheck'") == "0"
    assert (server.data_dir / "pg_hba.conf").read_bytes() == hba


def test_hostile_queries_are_refused_by_the_engine(server, tmp_path, monkeypatch) -> None:
    bypass_gate(monkeypatch)
    witness = tmp_path / "ran"
    hostile = {
        "DELETE FROM orders": "write",
        "SELECT nextval('s') > 0": "privilege",
        "SELECT pg_read_file('/etc/hostname') IS NOT NULL": "privilege",
        f"COPY (SELECT 1) TO PROGRAM 'touch {witness}'": "privilege",
        "SELECT set_config('role', 'postgres', false) IS NOT NULL": "privilege",
    }
    result = postgres_checks.postgres_checks(server, list(hostile), jobs=1)
    for query, kind in hostile.items():
        assert result[query].startswith(REFUSED), (query, result[query])
        assert kind in result[query]
    assert not witness.exists()
    assert server.psql("SELECT count(*) FROM orders") == "100"
    assert server.psql("SELECT count(*) FROM pg_roles WHERE rolname LIKE 'shardvault%'") == "0"
    with pytest.raises(InvalidRequest, match="was refused on shard s1"):
        raise_if_refused("s1", result)


def test_two_statements_in_one_query_are_refused(server, monkeypatch) -> None:
    """Ending the read-only transaction and starting a writable one takes a second statement:
    the server refuses it outright (the extended protocol runs one statement)."""
    bypass_gate(monkeypatch)
    server.psql("CREATE TABLE open_to_all (id int)")
    server.psql("INSERT INTO open_to_all SELECT generate_series(1, 100)")
    server.psql("GRANT ALL ON open_to_all TO PUBLIC")  # as an application's ACLs may be
    query = (
        "SELECT true; COMMIT; START TRANSACTION READ WRITE; DELETE FROM open_to_all; COMMIT; "
        "SELECT true"
    )
    result = postgres_checks.postgres_checks(server, [query], jobs=1)
    assert result[query] != "ok"
    assert server.psql("SELECT count(*) FROM open_to_all") == "100"


def test_a_query_that_runs_too_long_is_cancelled(server, monkeypatch) -> None:
    monkeypatch.setattr(postgres_checks, "QUERY_TIMEOUT_SECONDS", 1)
    result = postgres_checks.postgres_checks(server, ["SELECT pg_sleep(30) IS NOT NULL"], jobs=1)
    assert "longer than 1 s" in result["SELECT pg_sleep(30) IS NOT NULL"]


def test_sqlite_refuses_everything_but_reads(tmp_path: Path, monkeypatch) -> None:
    bypass_gate(monkeypatch)
    db = tmp_path / "shard.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE items (id INTEGER PRIMARY KEY)")
        conn.execute("INSERT INTO items VALUES (1)")
    conn.close()
    before = db.read_bytes()
    queries = [
        "SELECT count(*) = 1 FROM items",
        "DELETE FROM items",
        "PRAGMA writable_schema = 1",
        f"ATTACH DATABASE '{tmp_path / 'other.db'}' AS other",
        "SELECT 1; DELETE FROM items",
    ]
    result = sqlite_checks.sqlite_checks(db, queries)
    assert result[f"integrity_check {db.name}"] == "ok"
    assert result[f"{db.name}: SELECT count(*) = 1 FROM items"] == "ok"
    for query in queries[1:]:
        assert result[f"{db.name}: {query}"].startswith(REFUSED), query
    assert db.read_bytes() == before
    assert not (tmp_path / "other.db").exists()


@pytest.fixture(scope="module")
def maria(tmp_path_factory: pytest.TempPathFactory):
    server = init_server(tmp_path_factory.mktemp("maria") / "data")
    try:
        server.sql("CREATE DATABASE shop")
        server.sql(
            "CREATE TABLE orders (id INT PRIMARY KEY, total INT); "
            "INSERT INTO orders SELECT seq, seq FROM seq_1_to_100",
            database="shop",
        )
        yield server
    finally:
        stop_mariadb(server.data_dir)


def test_mariadb_runs_reads_as_a_select_only_account_and_refuses_the_rest(
    maria, tmp_path, monkeypatch
) -> None:
    bypass_gate(monkeypatch)
    outfile = tmp_path / "out.txt"
    read = "SELECT COUNT(*) = 100 FROM shop.orders"
    semicolon = "SELECT 'a;b' = 'a;b'"  # one statement: its ';' is in a literal
    hostile = [
        "DELETE FROM shop.orders",
        "SELECT 1; DELETE FROM shop.orders",
        f"SELECT * FROM shop.orders INTO OUTFILE '{outfile}'",
        "CREATE USER intruder",
        "SELECT LOAD_FILE('/etc/hostname') IS NOT NULL",
    ]
    result = mariadb_checks.mariadb_checks(maria, [read, semicolon, *hostile])
    assert result["mariadb-check --all-databases"] == "ok"
    assert result[read] == "ok"
    assert result[semicolon] == "ok"
    for query in hostile:
        assert result[query] != "ok", query
    assert result["DELETE FROM shop.orders"].startswith(REFUSED)
    assert result["CREATE USER intruder"].startswith(REFUSED)
    assert not outfile.exists()
    assert maria.sql("SELECT COUNT(*) FROM shop.orders") == "100"
    assert maria.sql("SELECT COUNT(*) FROM mysql.user WHERE user LIKE 'shardvault%'") == "0"
    assert maria.sql("SELECT COUNT(*) FROM mysql.user WHERE user = 'intruder'") == "0"


def test_mariadb_ends_a_query_that_runs_too_long(maria, monkeypatch) -> None:
    monkeypatch.setattr(mariadb_checks, "QUERY_TIMEOUT_SECONDS", 1)
    query = "SELECT SLEEP(30) = 0 FROM shop.orders LIMIT 1"
    result = mariadb_checks.mariadb_checks(maria, [query])
    assert "longer than 1 s" in result[query], result[query]


def test_a_query_runs_in_the_database_it_names(server) -> None:
    server.psql("CREATE DATABASE shop")
    server.psql("CREATE DATABASE sealed")
    server.psql("REVOKE CONNECT ON DATABASE sealed FROM PUBLIC")
    server.psql("CREATE TABLE orders AS SELECT g AS id FROM generate_series(1, 3) g", "shop")
    queries = [
        "shop: SELECT count(*) = 3 FROM orders",  # its own orders, not postgres's hundred
        "SELECT count(*) = 100 FROM orders",
        "absent: SELECT true",
        "sealed: SELECT true",
    ]
    result = postgres_checks.postgres_checks(server, queries, jobs=1)
    assert result[queries[0]] == "ok"
    assert result[queries[1]] == "ok"
    assert (
        result[queries[2]]
        == "error: the restored server has no database 'absent' that takes connections"
    )
    assert result[queries[3]].startswith("error: the check role cannot connect to 'sealed'")
    assert server.psql("SELECT count(*) FROM pg_roles WHERE rolname LIKE 'shardvault%'") == "0"


def test_mariadb_takes_the_database_a_query_names_as_its_default(maria) -> None:
    queries = ["shop: SELECT COUNT(*) = 100 FROM orders", "absent: SELECT 1"]
    result = mariadb_checks.mariadb_checks(maria, queries)
    assert result[queries[0]] == "ok"
    assert "Unknown database 'absent'" in result[queries[1]], result[queries[1]]
    assert not result[queries[1]].startswith(REFUSED)  # a failed check, not a refused query
