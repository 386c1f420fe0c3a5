"""The gate for a restore's *validation queries*: single read-only statements, refused by name.

A validation query (``--check`` on the CLI, ``validation_queries`` in the console input) is
SQL that must return true on every restored shard, e.g. ``SELECT count(*) > 0 FROM orders``.
Whoever may start a restore must not get more than that: no write, no second statement, no
command that reaches the host. The defence has two layers:

1. This gate, at validation (before any side effect): the text must be one statement that
   begins with ``SELECT``, ``WITH``, ``VALUES`` or ``TABLE`` and names no command or clause
   that writes or locks (``INSERT``, ``COPY``, ``SELECT ... INTO``, ``FOR UPDATE``, ...),
   outside string literals, quoted identifiers and comments.
2. The engine, on the target node: PostgreSQL runs each query in a read-only transaction with
   a statement timeout, logged in as a temporary role that is not a superuser and holds only
   ``pg_read_all_data`` (no file or program privileges); SQLite opens the file read-only and an
   authorizer allows reads and function calls only, under a time limit.

*Database*: a query may name the database it runs in, ``DATABASE:QUERY`` (``inventory:
SELECT count(*) > 0 FROM items``): PostgreSQL connects to that database (else ``postgres``),
MariaDB makes it the session's default (else none: name tables ``db.table``); a SQLite shard
is one database and refuses a name. No query the gate lets through begins with a word and a
colon, so the prefix is never part of a query; the name goes to the engine as a connection
parameter, never into SQL.

The gate is lexical, not a parser. Where the engines could read the text differently than the
gate does (a backslash in a string literal, whose meaning depends on server settings) it
refuses; it may refuse an odd but harmless query (a column named ``update`` must then be
quoted), and the engine layer holds whatever it lets through.

*Dialects*: each engine lexes by its own rules, and a text one reads as one statement another
may read as three (``SELECT 1 /* /* */ ; DELETE ...`` is one PostgreSQL statement, whose
comments nest, and two SQLite ones). A request is first checked by PostgreSQL's rules (its
engine is not known yet); the restore's validation checks it again by the rules of every
engine the backup holds (``DIALECTS``), before any side effect: SQLite's and MariaDB's
comments do not nest and know no dollar quotes; MariaDB also ends a line at ``#`` and runs a
``/*! ... */`` comment, which is refused.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from shardvault.errors import InvalidRequest

MAX_QUERIES = 20
MAX_QUERY_CHARS = 4096
QUERY_TIMEOUT_SECONDS = 60  # per query, enforced by the engine on the target node
READ_STARTS = frozenset({"SELECT", "WITH", "VALUES", "TABLE"})
# ``DATABASE:`` before a query (the module's *database*): a plain name, as PostgreSQL and
# MariaDB allow one unquoted (and ``-``, which they allow quoted), at most 63 characters.
_IN_DATABASE = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_$-]{0,62})\s*:(?!:)(.*)", re.DOTALL)
# Words that write, lock, reach files or change the session, wherever they appear outside
# literals: a data-modifying CTE (WITH x AS (DELETE ...)), SELECT ... INTO (creates a table),
# SELECT ... FOR UPDATE/SHARE (takes row locks).
REFUSED_WORDS = frozenset(
    {
        "INSERT", "UPDATE", "DELETE", "MERGE", "UPSERT", "INTO", "COPY", "CREATE",
        "DROP", "ALTER", "TRUNCATE", "GRANT", "REVOKE", "CALL", "DO", "EXECUTE", "PREPARE",
        "SET", "RESET", "LOCK", "VACUUM", "ANALYZE", "CLUSTER", "REINDEX", "REFRESH", "LISTEN",
        "NOTIFY", "LOAD", "ATTACH", "DETACH", "PRAGMA", "BEGIN", "COMMIT", "ROLLBACK",
        "SAVEPOINT", "RELEASE", "SHARE", "CHECKPOINT", "DISCARD", "IMPORT",
    }
)  # fmt: skip
FIX = (
    "write one read-only statement that returns true when the shard is good, e.g. "
    "'SELECT count(*) > 0 FROM orders'; validation queries cannot write, lock or run commands."
)

# One token of the scan: comments and quoted text are skipped, words and semicolons kept. As in
# PostgreSQL's lexer, any non-ASCII character may be part of an identifier (or a dollar-quote
# tag): ``é$$`` is one word, not the start of a quoted string.
_TOKEN = re.compile(
    r"""
      (?P<line_comment>--[^\n]*)
    | (?P<block_comment>/\*)
    | (?P<string>[EeBbXxNnUu]?&?'(?:[^']|'')*')
    | (?P<ident>"(?:[^"]|"")*")
    | (?P<dollar>\$(?P<tag>[A-Za-z_\u0080-\U0010FFFF][A-Za-z_0-9\u0080-\U0010FFFF]*)?\$)
    | (?P<word>[A-Za-z_\u0080-\U0010FFFF][A-Za-z_0-9$\u0080-\U0010FFFF]*)
    | (?P<semicolon>;)
    | (?P<other>.)
    """,
    re.VERBOSE | re.DOTALL,
)


@dataclass(frozen=True)
class Dialect:
    """How one engine lexes what the gate looks at."""

    name: str
    nested_comments: bool = False
    dollar_quotes: bool = False
    hash_comments: bool = False
    databases: bool = True  # a query may name its database (the module's *database*)


POSTGRES = Dialect("PostgreSQL", nested_comments=True, dollar_quotes=True)
DIALECTS = {
    "postgres": POSTGRES,
    "sqlite": Dialect("SQLite", databases=False),
    "mariadb": Dialect("MariaDB", hash_comments=True),
}


def check_validation_queries(
    queries: list[str], dialects: Iterable[Dialect] = (POSTGRES,)
) -> list[str]:
    """Every query passes :func:`check_validation_query` in each of ``dialects``; at most
    ``MAX_QUERIES`` of them."""
    if len(queries) > MAX_QUERIES:
        raise InvalidRequest(
            f"{len(queries)} validation queries given; at most {MAX_QUERIES} are allowed.",
            fix="combine checks into fewer queries (e.g. with AND).",
        )
    for dialect in dialects:
        for query in queries:
            check_validation_query(query, dialect)
    return list(queries)


def check_validation_query(query: str, dialect: Dialect = POSTGRES) -> str:
    """Returns ``query`` if it is one read-only statement as ``dialect`` reads it, else raises
    ``InvalidRequest`` naming what is wrong."""
    if not isinstance(query, str) or not query.strip():
        raise InvalidRequest("a validation query is empty.", fix=FIX)
    if len(query) > MAX_QUERY_CHARS:
        raise InvalidRequest(
            f"a validation query has {len(query)} characters; at most {MAX_QUERY_CHARS}.",
            fix=FIX,
        )
    if "\x00" in query:
        raise InvalidRequest("a validation query contains a NUL character.", fix=FIX)
    shown = _shorten(query)
    database, statement = split_database(query)
    if database is not None and not dialect.databases:
        raise InvalidRequest(
            f"validation query {shown} names database {database!r}; a {dialect.name} shard is "
            "one database.",
            fix=f"drop '{database}:' from the query.",
        )
    if database is not None and not statement.strip():
        raise InvalidRequest(f"validation query {shown} names a database but no query.", fix=FIX)
    words, statements = _scan(statement, dialect)
    if statements > 1:
        read_as = "" if dialect is POSTGRES else f" (as {dialect.name} reads it)"
        raise InvalidRequest(
            f"validation query {shown} holds {statements} statements{read_as}; one is allowed.",
            fix=FIX,
        )
    if not words or words[0] not in READ_STARTS:
        first = words[0] if words else "nothing"
        raise InvalidRequest(
            f"validation query {shown} starts with {first}; it must start with SELECT, WITH, "
            "VALUES or TABLE.",
            fix=FIX,
        )
    if refused := sorted(set(words) & REFUSED_WORDS):
        raise InvalidRequest(
            f"validation query {shown} uses {', '.join(refused)}, which may write, lock or "
            "leave the database (quote an identifier of that name).",
            fix=FIX,
        )
    return query


def split_database(query: str) -> tuple[str | None, str]:
    """A validation query's database (None: the engine's default) and the query itself
    (the module's *database*)."""
    found = _IN_DATABASE.fullmatch(query)
    return (found.group(1), found.group(2)) if found else (None, query)


def _scan(query: str, dialect: Dialect = POSTGRES) -> tuple[list[str], int]:
    """The upper-cased words outside literals and comments, and the number of statements."""
    words: list[str] = []
    statements, pending, position = 0, False, 0
    while position < len(query):
        match = _TOKEN.match(query, position)
        assert match is not None  # the last alternative matches any character
        kind, position = match.lastgroup, match.end()
        if kind == "block_comment":
            if dialect.hash_comments and query.startswith("!", position):
                raise InvalidRequest(
                    f"validation query {_shorten(query)} has a /*! comment, which "
                    f"{dialect.name} runs as SQL.",
                    fix=FIX,
                )
            position = _end_of_block_comment(query, position, dialect.nested_comments)
        elif kind == "dollar" and dialect.dollar_quotes:
            position = _end_of_dollar_quote(query, position, match.group("dollar"))
        elif kind == "dollar":  # SQLite, MariaDB: no quote; a $ is an operator or a name's
            pending = True
            position = match.start() + 1
        elif kind == "other" and match.group() == "#" and dialect.hash_comments:
            end = query.find("\n", position)
            position = len(query) if end < 0 else end
        elif kind == "word":
            words.append(match.group().upper())
            pending = True
        elif kind == "semicolon":
            statements += pending
            pending = False
        elif kind == "other" and not match.group().isspace():
            pending = True
        elif kind == "string" and "\\" in match.group():
            # Whether a backslash escapes the quote depends on the server's settings
            # (standard_conforming_strings, E'' strings): refuse rather than guess.
            raise InvalidRequest(
                f"validation query {_shorten(query)} has a backslash in a string literal.",
                fix=FIX,
            )
        elif kind in {"string", "ident"}:
            pending = True
    return words, statements + pending


def _end_of_block_comment(query: str, position: int, nested: bool = True) -> int:
    """PostgreSQL nests block comments: ``/* a /* b */ c */`` is one comment; SQLite and
    MariaDB end it at the first ``*/``."""
    depth = 1
    while depth and position < len(query):
        if nested and query.startswith("/*", position):
            depth, position = depth + 1, position + 2
        elif query.startswith("*/", position):
            depth, position = depth - 1, position + 2
        else:
            position += 1
    if depth:
        raise InvalidRequest("a validation query has an unclosed /* comment.", fix=FIX)
    return position


def _end_of_dollar_quote(query: str, position: int, delimiter: str) -> int:
    end = query.find(delimiter, position)
    if end < 0:
        raise InvalidRequest(
            f"a validation query has an unclosed {delimiter} quoted string.", fix=FIX
        )
    return end + len(delimiter)


def _shorten(query: str, limit: int = 80) -> str:
    flat = " ".join(query.split())
    return repr(flat if len(flat) <= limit else flat[: limit - 1] + "…")
