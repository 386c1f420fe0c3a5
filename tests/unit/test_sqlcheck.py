"""The validation-query gate: one read-only statement, everything else refused by name."""

from __future__ import annotations

import pytest

from shardvault.contracts.models import RestoreRequest
from shardvault.contracts.sqlcheck import (
    DIALECTS,
    MAX_QUERIES,
    check_validation_queries,
    check_validation_query,
    split_database,
)
from shardvault.errors import InvalidRequest

ACCEPTED = [
    "SELECT count(*) > 0 FROM orders",
    "select true;",
    "WITH t AS (SELECT 1 AS n) SELECT n = 1 FROM t",
    "SELECT 'a;b; DROP TABLE x' <> ''",  # a semicolon inside a literal is not a statement
    'SELECT count(*) > 0 FROM "update"',  # a quoted identifier may be named like a command
    "SELECT $$; DELETE FROM x$$ IS NOT NULL",
    "SELECT 1 -- ; DROP TABLE x\n = 1",
    "SELECT /* ; DELETE /* nested */ still comment */ true",
    "VALUES (true)",
    "SELECT replace(name, 'a', 'b') = 'b' FROM items LIMIT 1",
    "SELECT count(*) > 0 FROM café",
]

REFUSED = {
    "DROP TABLE x; SELECT true": "2 statements",
    "SELECT true; DROP TABLE x": "2 statements",
    "COPY (SELECT 1) TO PROGRAM 'id'": "starts with COPY",
    "WITH d AS (DELETE FROM orders RETURNING 1) SELECT true": "DELETE",
    "SELECT * INTO copy_of_orders FROM orders": "INTO",
    "SELECT true FROM orders FOR UPDATE": "UPDATE",
    "SELECT 'a\\'; DROP TABLE t; --'": "backslash",
    "PRAGMA writable_schema = 1": "starts with PRAGMA",
    "ATTACH DATABASE '/tmp/x' AS x": "starts with ATTACH",
    "": "empty",
    "   ": "empty",
    "SELECT 1 /* never closed": "unclosed",
    "SELECT $x$ never closed": "unclosed",
    "EXPLAIN ANALYZE DELETE FROM x": "starts with EXPLAIN",
    # PostgreSQL reads é$$ as one identifier, not as the start of a $$ string.
    "SELECT true AS é$$; COMMIT; START TRANSACTION READ WRITE; DELETE FROM t; -- $$": "statements",
    "SELECT true AS x$é$; DELETE FROM t; -- $é$": "statements",
}


@pytest.mark.parametrize("query", ACCEPTED)
def test_single_read_only_statements_pass(query: str) -> None:
    assert check_validation_query(query) == query


@pytest.mark.parametrize(("query", "named"), REFUSED.items())
def test_anything_else_is_refused_by_name_with_the_fix(query: str, named: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_validation_query(query)
    assert named in refused.value.message
    assert "read-only statement" in refused.value.fix


def test_too_many_queries_are_refused() -> None:
    with pytest.raises(InvalidRequest, match="at most"):
        check_validation_queries(["SELECT true"] * (MAX_QUERIES + 1))


def test_the_restore_request_refuses_a_query_before_anything_runs() -> None:
    with pytest.raises(InvalidRequest, match="2 statements"):
        RestoreRequest(
            cluster="a", target_cluster="b", validation_queries=["DROP TABLE x; SELECT true"]
        )
    assert RestoreRequest(
        cluster="a", target_cluster="b", validation_queries=["SELECT true"]
    ).validation_queries == ["SELECT true"]


SQLITE, MARIADB = DIALECTS["sqlite"], DIALECTS["mariadb"]
# Issue 44 (3): one PostgreSQL statement each, several as SQLite (or MariaDB) reads them.
SPLIT_ELSEWHERE = [
    "SELECT 1 /* /* */ ; DELETE FROM items; -- */",
    "SELECT $$;DELETE FROM items;$$ = ''",
    "SELECT 1 /* /* */ ; ATTACH DATABASE '/tmp/x' AS x; -- */",
]


@pytest.mark.parametrize("query", SPLIT_ELSEWHERE)
@pytest.mark.parametrize("dialect", [SQLITE, MARIADB], ids=["sqlite", "mariadb"])
def test_a_query_is_lexed_as_its_engine_lexes_it(query: str, dialect) -> None:
    check_validation_query(query)  # PostgreSQL: one statement in its comment or quote
    with pytest.raises(InvalidRequest, match=r"statements|DELETE|ATTACH"):
        check_validation_query(query, dialect)


def test_mariadb_hash_comments_and_executable_comments() -> None:
    assert check_validation_query("SELECT 1 # ; DROP TABLE x\n = 1", MARIADB)
    with pytest.raises(InvalidRequest, match="statements"):
        check_validation_query("SELECT 1 # \n; DELETE FROM x", MARIADB)
    with pytest.raises(InvalidRequest, match="runs as SQL"):
        check_validation_query("SELECT 1 /*!50000 , (DELETE FROM x) */", MARIADB)


def test_plain_queries_pass_in_every_dialect() -> None:
    plain = ["SELECT count(*) > 0 FROM orders", "SELECT 'a;b' <> '' -- c"]
    assert check_validation_queries(plain, DIALECTS.values()) == plain


@pytest.mark.parametrize(
    ("text", "database", "query"),
    [
        ("shop: SELECT count(*) > 0 FROM orders", "shop", " SELECT count(*) > 0 FROM orders"),
        ("  my-db_2 :SELECT true", "my-db_2", "SELECT true"),
        ("SELECT true", None, "SELECT true"),
        ("SELECT 'a:b' = x::text FROM t", None, "SELECT 'a:b' = x::text FROM t"),
        ("x::int", None, "x::int"),  # a cast is not a database
        ("-- shop: a comment\nSELECT true", None, "-- shop: a comment\nSELECT true"),
    ],
)
def test_a_query_may_name_its_database_before_a_colon(text, database, query) -> None:
    assert split_database(text) == (database, query)


def test_a_named_database_is_gated_like_the_rest_of_the_query() -> None:
    named = ["shop: SELECT count(*) > 0 FROM orders"]
    assert check_validation_queries(named, [DIALECTS["postgres"], MARIADB]) == named
    with pytest.raises(InvalidRequest, match="one database") as refused:
        check_validation_query(named[0], SQLITE)
    assert "drop 'shop:'" in refused.value.fix
    with pytest.raises(InvalidRequest, match="no query"):
        check_validation_query("shop:  ")
    with pytest.raises(InvalidRequest, match="starts with DELETE"):
        check_validation_query("shop: DELETE FROM orders")
    with pytest.raises(InvalidRequest, match="2 statements"):
        check_validation_query("shop: SELECT true; DROP TABLE orders")
    with pytest.raises(InvalidRequest, match="starts with SHOP"):  # no room for SQL in a name
        check_validation_query("shop x: SELECT true")
