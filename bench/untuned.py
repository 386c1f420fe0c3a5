"""A dataset nobody tuned for: what a backup tool meets on a real server, not pgbench alone.

Usage::

    .venv/bin/python bench/untuned.py --dsn "host=/tmp/s port=5432 user=postgres" [--scale-gb 2.7]
    .venv/bin/python bench/untuned.py --scratch /tmp --scale-gb 0.2 --change --values

From a bench (``backup_vs_peers.py``'s setup)::

    import untuned
    untuned.build(bench, say=bvp.say)          # or bench.pg, or a connection string
    untuned.change(bench, nth=0)                # between two backups
    source = untuned.values(bench)              # compare with values(restored_instance)

Terms:

* *target*: where the dataset goes. A libpq connection string (its database is the *main
  database*), a running ``PostgresInstance`` (main database ``postgres``), or anything holding
  one as ``.pg`` (``backup_vs_peers.Bench``). PostgreSQL 15; the connection needs superuser
  rights (``CREATE DATABASE``, ``CREATE EXTENSION``, ``CHECKPOINT``).
* *second database*: ``pgbench`` (``PGBENCH_DB``), beside the main one, filled by
  ``pgbench -i -s S``: S is 30 at the default scale and proportional to it otherwise
  (``pgbench_scale_for``).
* *scale* (``scale_gb``): the size aimed at, in GB (10^9 bytes), of the dataset's tables with
  their TOAST and indexes in both databases (catalogs and WAL not counted). Each table of the
  main database gets its *share* of it (``SHARES``); rows are inserted in batches until the
  table reaches its share, so the row counts follow from the sizes, not the other way round.
  At the default 2.7: ``notes`` 1.13 GB (over 1 GiB), ``documents`` 0.68 GB, ``events`` 0.32 GB,
  ``scratch`` 0.11 GB and pgbench at scale 30 about 0.45 GB.
* *random text*: *random hex* is hex of random bytes (``gen_random_bytes`` from pgcrypto,
  created in the main database when the server has it, else chained ``md5(random())``); it
  compresses about 1.9x with zstd. *Soup* is random hex mapped onto a skewed alphabet of
  letters and spaces (``SOUP``): word-like runs of 12 symbols, about 3.5 bits a character
  (about 2x with zstd). With the boilerplate sentences a document's body repeats
  (``PHRASES``), documents compress about 2.4x: like real documents, neither like pgbench's
  blank-padded rows (``pgbench_accounts``: 30x) nor like noise (1x). (zstd -3 of the
  relation files of a build at scale 0.2.)

The tables (none tuned: default fillfactor, TOAST compression, statistics targets; indexes
built after the load, as a load script would; then ``VACUUM (FREEZE, ANALYZE)``):

* ``documents``: ``jsonb`` documents of 5-11 KB, 7.6 KB on average (keys that differ by
  kind, nested arrays of objects, soup and boilerplate), stored out of line in its TOAST table
  (pglz gains too little on them to keep them compressed).
* ``notes``: ``id``, author, time, title and 200-1900 characters of random hex (rows of 0.1 to
  2 KB, all stored in the heap): more than 1 GiB at the default scale.
* ``events``: list-partitioned by ``region`` (``eu``, ``us``, ``apac``, ``latam``, ``africa``
  and a default partition that gets ``mena``, skewed 35/30/20/10/4/1 %), a primary key
  ``(region, id)`` and two secondary indexes.
* ``scratch``: an UNLOGGED table; a restore (of any tool) brings it back empty.
* in ``pgbench``: ``pgbench_accounts``, ``_branches``, ``_tellers``, ``_history``.

The *standard change* (``change``), made between two backups: 1 % of ``notes`` rewritten as one
contiguous id range (new random hex; where the range starts turns with ``nth``: 10 %, 45 %,
80 % of the ids), 500 documents inserted or replaced (half new ids, half existing ones, in
one ``INSERT ... ON CONFLICT DO UPDATE``), then ``pgbench -n -c 4 -j 2 -T 30`` on the second
database; then a ``CHECKPOINT``.

*Values* (``values``): per table, ``<rows>:<hash>``, the hash an order-independent sum of the
first 64 bits of ``md5(partition name || row text)`` (session in UTC and ISO dates), so two
servers have equal values when their tables hold the same rows in the same partitions.
``scratch`` is an UNLOGGED table: by default its value is only its persistence (``unlogged``),
since a restored copy has it empty; ``values(..., unlogged=True)`` counts and hashes it too.
Reading rows written since the last ``VACUUM`` (after ``change``) sets their hint bits and so
dirties their pages (logged as full pages, with checksums on): take the values after the
backups that should not see that, as ``incremental_vs_peers.py`` does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psycopg
from psycopg.conninfo import make_conninfo

from shardvault.local.postgres import PostgresInstance, PostgresNotFound, find_pg_bin_dir

GB = 10**9
MAIN_TABLES = ("documents", "notes", "events", "scratch")
UNLOGGED_TABLES = ("scratch",)
PGBENCH_DB = "pgbench"
PGBENCH_TABLES = ("pgbench_accounts", "pgbench_branches", "pgbench_tellers", "pgbench_history")
DEFAULT_SCALE_GB = 2.7
PGBENCH_SCALE_AT_DEFAULT = 30  # pgbench -i -s at DEFAULT_SCALE_GB (about 0.45 GB)
# A table's share of scale_gb (pgbench's is the rest: 30 / 2.7 GB is about 0.167).
SHARES = {"notes": 0.42, "documents": 0.25, "events": 0.12, "scratch": 0.04}
# What of a table's share its heap and TOAST get while the rows go in; the indexes built after
# the load take the rest (events: a three-column key and two secondary indexes).
HEAP_FRACTION = {"notes": 0.98, "documents": 0.99, "events": 0.75, "scratch": 1.0}
ROW_BYTES = {"notes": 1200, "documents": 8500, "events": 260, "scratch": 560}  # first guesses
BATCH_BYTES = 128 * 10**6  # at most this much per INSERT
SOUP = ("0123456789abcdef", "eettaoinshrdl   ")  # hex digit -> letter or space (translate)
REGIONS = ["eu"] * 7 + ["us"] * 6 + ["apac"] * 4 + ["latam"] * 2  # 19 of 20 slots
PARTITIONS = ("eu", "us", "apac", "latam", "africa")  # and events_default
# Boilerplate of a document's body: three blocks of five of these (picked by its id) between
# its three runs of soup, as templates and quoted mails repeat in real documents.
PHRASES = (
    "Thank you for your order. The items below were shipped from our warehouse today.",
    "Please review the attached terms and conditions before you confirm the request.",
    "If you have any questions about this document, contact the support team at any time.",
    "This message was generated automatically; replies to it are not monitored.",
    "The customer reported that the problem started after the latest update was installed.",
    "Payment is due within thirty days of the invoice date unless agreed otherwise in writing.",
    "All prices include value added tax where applicable and exclude shipping costs.",
    "The meeting notes were approved by all participants and filed under the project folder.",
    "We could not reproduce the issue on a clean installation with the default settings.",
    "Your subscription renews automatically at the end of each billing period.",
    "The following changes were made to the account profile since the last review.",
    "Delivery may take longer during public holidays and periods of severe weather.",
    "The report summarizes the results of the quarterly review of open tickets.",
    "Please keep this confirmation for your records; it is required for any return.",
    "The author requested that this article be reviewed again before it is published.",
    "Access to this resource is restricted to members of the listed organisation units.",
)
PHRASES_PER_BLOCK = 5
CHANGE_AT = (0.10, 0.45, 0.80)  # where the nth change's notes range starts (of the ids)
CHANGE_FRACTION = 0.01
CHANGE_DOCUMENTS = 500
PGBENCH_SECONDS = 30
PGBENCH_CLIENTS = ("-c", "4", "-j", "2")  # as incremental_vs_peers.PGBENCH_ARGS


# --- targets ------------------------------------------------------------------------------------
class HasInstance(Protocol):
    pg: PostgresInstance


TargetLike = str | PostgresInstance | HasInstance


@dataclass(frozen=True)
class Target:
    """The two databases' connection strings and the pgbench to run against them."""

    main: str
    second: str
    pgbench: str


def target_of(target: TargetLike) -> Target:
    """A ``Target`` for a connection string, an instance, or a setup holding one as ``.pg``."""
    if isinstance(target, str):
        try:
            pgbench = str(find_pg_bin_dir() / "pgbench")
        except PostgresNotFound:
            pgbench = shutil.which("pgbench") or "pgbench"
        return Target(target, make_conninfo(target, dbname=PGBENCH_DB), pgbench)
    instance = target if isinstance(target, PostgresInstance) else target.pg
    return Target(
        instance.conninfo_for("postgres"),
        instance.conninfo_for(PGBENCH_DB),
        str(instance.bin_dir / "pgbench"),
    )


@contextlib.contextmanager
def connect(conninfo: str) -> Iterator[psycopg.Connection]:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        yield conn


def scalar(conn: psycopg.Connection, sql: str, params: tuple[Any, ...] | None = None) -> Any:
    """The first column of the first row. With ``params``, a ``%`` in ``sql`` must be ``%%``."""
    row = conn.execute(sql, params).fetchone()
    return row[0] if row else None


def run_pgbench(target: Target, *args: str) -> str:
    """``pgbench ARGS <second database>``; returns what it printed, raises if it failed."""
    cmd = [target.pgbench, *args, target.second]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd="/", check=False)
    if done.returncode != 0:
        raise RuntimeError(f"pgbench {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
    return done.stdout + done.stderr


def pgbench_scale_for(scale_gb: float) -> int:
    return max(1, round(PGBENCH_SCALE_AT_DEFAULT * scale_gb / DEFAULT_SCALE_GB))


# --- random text in SQL -------------------------------------------------------------------------
@dataclass(frozen=True)
class Random:
    """SQL expressions for random text. ``nbytes`` is an SQL expression of 1 to 1024 that must
    not itself be random (it may be evaluated twice); ``seed`` refers to the row (``g``) so that
    a subquery is evaluated per row, not once."""

    pgcrypto: bool

    def hex(self, nbytes: str, seed: str = "g") -> str:
        """``2 * nbytes`` characters of random hex."""
        if self.pgcrypto:
            return f"encode(gen_random_bytes(({nbytes})::int), 'hex')"
        chain = (
            f"(SELECT string_agg(md5(random()::text || ({seed})::text || i::text), '') "
            f"FROM generate_series(1, ({nbytes}) / 16 + 1) AS i)"
        )
        return f"left({chain}, 2 * ({nbytes})::int)"

    def soup(self, nbytes: str, seed: str = "g") -> str:
        """``2 * nbytes`` characters of soup."""
        return f"translate({self.hex(nbytes, seed)}, '{SOUP[0]}', '{SOUP[1]}')"


def has_pgcrypto(conn: psycopg.Connection) -> bool:
    """Creates pgcrypto in the main database when the server has it."""
    if not scalar(conn, "SELECT count(*) FROM pg_available_extensions WHERE name = 'pgcrypto'"):
        return False
    try:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pgcrypto")
    except psycopg.Error:
        return False
    return True


# --- the tables ---------------------------------------------------------------------------------
def notes_insert(r: Random) -> Callable[[int, int], str]:
    def insert(first: int, last: int) -> str:
        return (
            "INSERT INTO notes (id, author_id, created_at, title, body) "
            "SELECT g, 1 + (g * 48271) % 20000, "
            "timestamptz '2019-01-01 00:00+00' + g * interval '37 seconds', "
            f"initcap({r.soup('6 + g % 14')}), {r.hex('100 + (g * 7919) % 851')} "
            f"FROM generate_series({first}::bigint, {last}) AS g"
        )

    return insert


def document_sql(r: Random) -> str:
    """One document of 5-10 KB for the row ``g`` (its id)."""
    body = " || ' ' || ".join(
        [
            r.soup("1024"),
            phrases_sql(7),
            r.soup("512"),
            phrases_sql(11),
            r.soup("1 + (g * 7919) % 1024"),
            phrases_sql(13),
        ]
    )
    lines = (
        "(SELECT jsonb_agg(jsonb_build_object("
        "'sku', upper(left(md5(g::text || '-' || i::text), 8)), 'qty', 1 + (g + i) % 24, "
        "'price', round((random() * 900)::numeric, 2), "
        f"'note', {r.soup('8 + (g * i) % 60', 'g + i')})) "
        "FROM generate_series(1, 2 + g % 19) AS i)"
    )
    meta = (
        "(SELECT jsonb_object_agg('m' || ((g * 31 + j * 7) % 61)::text, CASE j % 4 "
        "WHEN 0 THEN to_jsonb(round(random()::numeric, 6)) "
        f"WHEN 1 THEN to_jsonb({r.soup('6', 'g + j')}) "
        "WHEN 2 THEN to_jsonb((g + j) % 3 = 0) "
        "ELSE jsonb_build_array(j, g % 97, left(md5(j::text || g::text), 12)) END) "
        "FROM generate_series(1, 3 + g % 9) AS j)"
    )
    replies = (
        "(SELECT jsonb_agg(jsonb_build_object('by', 1 + (g * 13 + k) % 5000, "
        f"'at', {time_sql('g * 60 + k * 3600')}, 'text', {r.soup('20 + (k * g) % 200', 'g + k')})) "
        "FROM generate_series(1, 1 + g % 6) AS k)"
    )
    tags = (
        f"(SELECT jsonb_agg({r.soup('3 + (g + t) % 4', 'g + t')}) "
        "FROM generate_series(1, 1 + g % 7) AS t)"
    )
    extra = (
        "CASE g % 5 "
        "WHEN 0 THEN jsonb_build_object('invoice', jsonb_build_object("
        "'total', round((random() * 10000)::numeric, 2), "
        "'currency', (ARRAY['EUR', 'USD', 'JPY'])[1 + g % 3], "
        f"'due', {time_sql('g * 60 + 2592000')}, 'paid', g % 4 = 0)) "
        f"WHEN 1 THEN jsonb_build_object('replies', {replies}, 'status', "
        "(ARRAY['open', 'pending', 'closed'])[1 + g % 3]) "
        "WHEN 2 THEN jsonb_build_object('profile', jsonb_build_object("
        f"'bio', {r.soup('40 + g % 200')}, 'languages', jsonb_build_array('en', 'de'), "
        "'settings', jsonb_build_object('theme', 'dark', 'digest', g % 2 = 0))) "
        "WHEN 3 THEN jsonb_build_object('shipping', jsonb_build_object("
        f"'street', initcap({r.soup('8')}), 'zip', lpad((g % 99999)::text, 5, '0'), "
        "'weights', jsonb_build_array(g % 17, g % 23, (g % 29) * 1.5))) "
        f"ELSE jsonb_build_object('summary', {r.soup('30 + g % 90')}, 'revision', g % 12) END"
    )
    kinds = "(ARRAY['invoice', 'ticket', 'profile', 'order', 'article'])[1 + g % 5]"
    return (
        "jsonb_build_object("
        f"'id', g, 'kind', {kinds}, 'created', {time_sql('g * 60')}, "
        f"'title', initcap({r.soup('10 + g % 20')}), "
        "'author', jsonb_build_object('id', md5('author-' || (g % 5000)::text), "
        f"'name', initcap({r.soup('5')}), 'handle', 'user' || (g % 5000)::text), "
        f"'tags', {tags}, 'body', {body}, 'lines', {lines}, 'meta', {meta}) || {extra}"
    )


def phrases_sql(step: int) -> str:
    """``PHRASES_PER_BLOCK`` of ``PHRASES`` for the row ``g``, which ones set by ``step``."""
    phrases = ", ".join("'" + phrase.replace("'", "''") + "'" for phrase in PHRASES)
    pick = f"(ARRAY[{phrases}])[1 + (g * {step} + k * 5) % {len(PHRASES)}]"
    return (
        f"array_to_string(ARRAY(SELECT {pick} "
        f"FROM generate_series(1, {PHRASES_PER_BLOCK}) AS k), ' ')"
    )


def time_sql(seconds_sql: str) -> str:
    """An ISO timestamp string, ``seconds_sql`` after 2021-01-01 UTC."""
    return (
        f"to_char(timestamp '2021-01-01' + ({seconds_sql}) * interval '1 second', "
        '\'YYYY-MM-DD"T"HH24:MI:SS"Z"\')'
    )


def documents_insert(r: Random) -> Callable[[int, int], str]:
    def insert(first: int, last: int) -> str:
        return (
            "INSERT INTO documents (id, doc) "
            f"SELECT g, {document_sql(r)} FROM generate_series({first}::bigint, {last}) AS g"
        )

    return insert


def events_insert(r: Random) -> Callable[[int, int], str]:
    regions = ", ".join(f"'{region}'" for region in REGIONS)
    region = (
        f"CASE WHEN g % 100 = 0 THEN 'mena' WHEN g % 25 = 1 THEN 'africa' "
        f"ELSE (ARRAY[{regions}])[1 + floor(random() * {len(REGIONS)})::int] END"
    )

    def insert(first: int, last: int) -> str:
        return (
            "INSERT INTO events (id, region, occurred_at, user_id, kind, amount, payload) "
            f"SELECT g, {region}, "
            "timestamptz '2024-01-01 00:00+00' + g * interval '2 seconds' "
            "+ random() * interval '1 hour', "
            "1 + floor(random() * 200000)::int, (1 + g % 12)::smallint, "
            f"round((random() * 2000 - 500)::numeric, 2), {r.soup('20 + (g * 7919) % 105')} "
            f"FROM generate_series({first}::bigint, {last}) AS g"
        )

    return insert


def scratch_insert(r: Random) -> Callable[[int, int], str]:
    def insert(first: int, last: int) -> str:
        return (
            "INSERT INTO scratch (id, data) "
            f"SELECT g, {r.hex('100 + g % 300')} FROM generate_series({first}::bigint, {last}) AS g"
        )

    return insert


CREATE = {
    "notes": (
        "CREATE TABLE notes (id bigint NOT NULL, author_id int NOT NULL, "
        "created_at timestamptz NOT NULL, updated_at timestamptz, title text, body text)"
    ),
    "documents": (
        "CREATE TABLE documents (id bigint NOT NULL, doc jsonb NOT NULL, updated_at timestamptz)"
    ),
    "events": (
        "CREATE TABLE events (id bigint NOT NULL, region text NOT NULL, "
        "occurred_at timestamptz NOT NULL, user_id int NOT NULL, kind smallint NOT NULL, "
        "amount numeric(12, 2), payload text) PARTITION BY LIST (region)"
    ),
    "scratch": (
        "CREATE UNLOGGED TABLE scratch (id bigint NOT NULL, "
        "filled_at timestamptz NOT NULL DEFAULT now(), data text)"
    ),
}
INDEXES = {
    "notes": ["ALTER TABLE notes ADD PRIMARY KEY (id)"],
    "documents": ["ALTER TABLE documents ADD PRIMARY KEY (id)"],
    "events": [
        "ALTER TABLE events ADD PRIMARY KEY (region, id)",
        "CREATE INDEX events_occurred_at ON events (occurred_at)",
        "CREATE INDEX events_user ON events (user_id, occurred_at)",
    ],
    "scratch": [],
}


def create_events_partitions(conn: psycopg.Connection) -> None:
    for region in PARTITIONS:
        conn.execute(f"CREATE TABLE events_{region} PARTITION OF events FOR VALUES IN ('{region}')")
    conn.execute("CREATE TABLE events_default PARTITION OF events DEFAULT")


def table_bytes(conn: psycopg.Connection, table: str) -> int:
    """Heap, TOAST and indexes of ``table`` (of all its partitions)."""
    return int(
        scalar(
            conn,
            # pg_partition_tree has no rows for a table that is not partitioned
            "SELECT sum(pg_total_relation_size(relid)) FROM "
            "(SELECT relid FROM pg_partition_tree(%s::regclass) UNION SELECT %s::regclass) AS r",
            (table, table),
        )
    )


def fill(
    conn: psycopg.Connection,
    table: str,
    insert: Callable[[int, int], str],
    target_bytes: int,
    say: Callable[[str], None],
) -> int:
    """Inserts rows ``1, 2, ...`` in batches until ``table`` holds ``target_bytes``; returns
    the number of rows. The first batch's size is guessed (``ROW_BYTES``), the next ones
    follow from the bytes a row took so far. Fails when a batch of over 1 MiB leaves the
    table's size as it was or a row comes out under a tenth of its guess: the size is not
    measured right, and the loop would not end."""
    rows, guess, size = 0, ROW_BYTES[table], 0
    while size < target_bytes * 0.995:
        per_row = size / rows if rows else guess
        wanted = math.ceil((target_bytes - size) / per_row)
        batch = max(1, min(wanted, BATCH_BYTES // guess))
        conn.execute(insert(rows + 1, rows + batch))
        rows += batch
        before, size = size, table_bytes(conn, table)
        if size < rows * guess / 10 or (size <= before and batch * per_row > 1 << 20):
            raise RuntimeError(f"{table}: {size:,} bytes after {rows:,} rows: size not measured")
        say(f"  {table}: {rows:,} rows, {size / GB:.3f} GB")
    return rows


def drop_dataset(conn: psycopg.Connection) -> None:
    for table in MAIN_TABLES:
        conn.execute(f"DROP TABLE IF EXISTS {table} CASCADE")
    conn.execute(f"DROP DATABASE IF EXISTS {PGBENCH_DB} WITH (FORCE)")


def exists(conn: psycopg.Connection) -> list[str]:
    """The dataset's tables and second database that already exist."""
    found = [t for t in MAIN_TABLES if scalar(conn, "SELECT to_regclass(%s)", (t,))]
    if scalar(conn, "SELECT count(*) FROM pg_database WHERE datname = %s", (PGBENCH_DB,)):
        found.append(f"database {PGBENCH_DB}")
    return found


def build(
    target: TargetLike,
    *,
    scale_gb: float = DEFAULT_SCALE_GB,
    pgbench_scale: int | None = None,
    replace: bool = False,
    vacuum: bool = True,
    say: Callable[[str], None] = lambda _message: None,
) -> dict[str, Any]:
    """Builds the dataset into ``target`` (see the module docstring); returns the seconds of
    each step, the rows and bytes of each table (``sizes``) and the databases' sizes.

    ``pgbench_scale``: ``pgbench -i -s`` (default ``pgbench_scale_for(scale_gb)``).
    ``replace``: drop the dataset's tables and second database first; without it, finding
    any of them is an error. ``vacuum``: end with ``VACUUM (FREEZE, ANALYZE)`` of both
    databases, so that reading the tables later (``values``, a backup) changes no page.
    Ends with a ``CHECKPOINT``.
    """
    where = target_of(target)
    scale = pgbench_scale or pgbench_scale_for(scale_gb)
    seconds: dict[str, float] = {}
    rows: dict[str, int] = {}
    started = time.monotonic()
    with connect(where.main) as conn:
        if replace:
            drop_dataset(conn)
        elif found := exists(conn):
            raise RuntimeError(f"the dataset is there already ({', '.join(found)}): replace=True")
        r = Random(has_pgcrypto(conn))
        say(f"untuned dataset, {scale_gb} GB ({'pgcrypto' if r.pgcrypto else 'md5'} random)")
        inserts = {
            "notes": notes_insert(r),
            "documents": documents_insert(r),
            "events": events_insert(r),
            "scratch": scratch_insert(r),
        }
        for table, insert in inserts.items():
            step = time.monotonic()
            conn.execute(CREATE[table])
            if table == "events":
                create_events_partitions(conn)
            share = int(scale_gb * GB * SHARES[table] * HEAP_FRACTION[table])
            rows[table] = fill(conn, table, insert, share, say)
            for statement in INDEXES[table]:
                conn.execute(statement)
            seconds[table] = round(time.monotonic() - step, 1)
        step = time.monotonic()
        conn.execute(f"CREATE DATABASE {PGBENCH_DB}")
        say(f"pgbench -i -s {scale}")
        run_pgbench(where, "-i", "-s", str(scale), "-q")
        seconds["pgbench_init"] = round(time.monotonic() - step, 1)
        if vacuum:
            step = time.monotonic()
            say("VACUUM (FREEZE, ANALYZE)")
            conn.execute("VACUUM (FREEZE, ANALYZE)")
            with connect(where.second) as second:
                second.execute("VACUUM (FREEZE, ANALYZE)")
            seconds["vacuum"] = round(time.monotonic() - step, 1)
        conn.execute("CHECKPOINT")
    seconds["total"] = round(time.monotonic() - started, 1)
    return {
        "scale_gb": scale_gb,
        "pgbench_scale": scale,
        "random": "pgcrypto" if r.pgcrypto else "md5",
        "seconds": seconds,
        "rows": rows,
        **sizes(where),
    }


def sizes(target: TargetLike | Target) -> dict[str, Any]:
    """Bytes of each table (heap, TOAST and indexes, all partitions), their sum
    (``dataset_bytes``) and each database's size (``database_bytes``)."""
    where = target if isinstance(target, Target) else target_of(target)
    tables: dict[str, int] = {}
    databases: dict[str, int] = {}
    for conninfo, names in ((where.main, MAIN_TABLES), (where.second, PGBENCH_TABLES)):
        with connect(conninfo) as conn:
            tables |= {name: table_bytes(conn, name) for name in names}
            databases[scalar(conn, "SELECT current_database()")] = int(
                scalar(conn, "SELECT pg_database_size(current_database())")
            )
    return {
        "table_bytes": tables,
        "dataset_bytes": sum(tables.values()),
        "database_bytes": databases,
    }


# --- the standard change ------------------------------------------------------------------------
def change(
    target: TargetLike,
    *,
    nth: int = 0,
    fraction: float = CHANGE_FRACTION,
    documents: int = CHANGE_DOCUMENTS,
    pgbench_seconds: int = PGBENCH_SECONDS,
    checkpoint: bool = True,
) -> dict[str, Any]:
    """The standard change (module docstring): ``fraction`` of ``notes`` rewritten as one id
    range starting at ``CHANGE_AT[nth % 3]`` of the ids, ``documents`` documents inserted or
    replaced (half each), ``pgbench -n -c 4 -j 2 -T pgbench_seconds`` on the second database
    (none when 0), then a ``CHECKPOINT`` unless ``checkpoint`` is false. Returns what it did,
    its seconds and the WAL it wrote."""
    where = target_of(target)
    started = time.monotonic()
    with connect(where.main) as conn:
        lsn = scalar(conn, "SELECT pg_current_wal_lsn()")
        r = Random(
            bool(scalar(conn, "SELECT count(*) FROM pg_extension WHERE extname = 'pgcrypto'"))
        )
        last = int(scalar(conn, "SELECT max(id) FROM notes"))
        width = max(1, int(last * fraction))
        first = 1 + int(last * CHANGE_AT[nth % len(CHANGE_AT)])
        # No parameters in these statements: with parameters psycopg reads '%' as a placeholder.
        body = r.hex(f"100 + (notes.id * 7919 + {nth + 1}) % 851", "notes.id")
        updated = conn.execute(
            f"UPDATE notes SET body = {body}, updated_at = now() "
            f"WHERE id BETWEEN {first} AND {first + width - 1}"
        ).rowcount
        top = int(scalar(conn, "SELECT max(id) FROM documents"))
        replaced = [
            int(row[0])
            for row in conn.execute(
                f"SELECT id FROM documents ORDER BY random() LIMIT {documents // 2}"
            ).fetchall()
        ]
        ids = [*replaced, *range(top + 1, top + 1 + documents - len(replaced))]
        conn.execute(
            f"INSERT INTO documents (id, doc) SELECT g, {document_sql(r)} "
            f"FROM unnest('{{{','.join(map(str, ids))}}}'::bigint[]) AS g "
            "ON CONFLICT (id) DO UPDATE SET doc = EXCLUDED.doc, updated_at = now()"
        )
        done: dict[str, Any] = {
            "nth": nth,
            "notes_first_id": first,
            "notes_rows": updated,
            "documents_replaced": len(replaced),
            "documents_inserted": len(ids) - len(replaced),
        }
        if pgbench_seconds > 0:
            out = run_pgbench(where, "-n", *PGBENCH_CLIENTS, "-T", str(pgbench_seconds))
            processed = re.search(r"number of transactions actually processed: (\d+)", out)
            tps = re.search(r"tps = ([\d.]+)", out)
            done["pgbench_transactions"] = int(processed[1]) if processed else None
            done["pgbench_tps"] = float(tps[1]) if tps else None
        if checkpoint:
            conn.execute("CHECKPOINT")
        done["wal_bytes"] = int(
            scalar(conn, "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", (lsn,))
        )
    return done | {"seconds": round(time.monotonic() - started, 1)}


# --- values -------------------------------------------------------------------------------------
def table_value(conn: psycopg.Connection, table: str) -> str:
    """``<rows>:<hash>`` of ``table`` (module docstring, *values*)."""
    count, total = conn.execute(
        "SELECT count(*), coalesce(sum(('x' || left(md5(t.tableoid::regclass::text || "
        f"t::text), 16))::bit(64)::bigint::numeric), 0) FROM {table} AS t"
    ).fetchone()
    return f"{count}:{total}"


def values(target: TargetLike, *, unlogged: bool = False) -> dict[str, str]:
    """Per table ``<rows>:<hash>``, equal on two servers that hold the same data (a source
    and its restored copy); UNLOGGED tables give ``unlogged`` unless ``unlogged`` is true.
    Takes an instance, so it is a ``backup_vs_peers.RestoredCheck``."""
    where = target_of(target)
    found: dict[str, str] = {}
    for conninfo, names in ((where.main, MAIN_TABLES), (where.second, PGBENCH_TABLES)):
        with connect(conninfo) as conn:
            conn.execute("SET TimeZone = 'UTC'")
            conn.execute("SET DateStyle = 'ISO, YMD'")
            for name in names:
                if name in UNLOGGED_TABLES and not unlogged:
                    persistence = scalar(
                        conn,
                        "SELECT relpersistence FROM pg_class WHERE oid = %s::regclass",
                        (name,),
                    )
                    found[name] = "unlogged" if persistence == "u" else f"persistence {persistence}"
                else:
                    found[name] = table_value(conn, name)
    return found


# --- command line -------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Build the 'untuned' dataset (see the module docstring) into a PostgreSQL "
        "15 server, or into a throwaway one.",
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--dsn", help="libpq connection string of the main database")
    where.add_argument(
        "--scratch",
        type=Path,
        metavar="DIR",
        help="start a throwaway server (backup_vs_peers' settings, no archiving) in a new "
        "directory under DIR, build into it, stop it and remove the directory",
    )
    parser.add_argument("--scale-gb", type=float, default=DEFAULT_SCALE_GB)
    parser.add_argument("--pgbench-scale", type=int, help="default: 30 per 2.7 GB of scale")
    parser.add_argument("--replace", action="store_true", help="drop the dataset first")
    parser.add_argument("--no-vacuum", action="store_true", help="skip VACUUM (FREEZE, ANALYZE)")
    parser.add_argument("--change", action="store_true", help="then make the standard change")
    parser.add_argument("--pgbench-seconds", type=int, default=PGBENCH_SECONDS)
    parser.add_argument("--values", action="store_true", help="then print the values")
    parser.add_argument("--keep", action="store_true", help="--scratch: keep the directory")
    return parser.parse_args(argv)


def run(args: argparse.Namespace, target: TargetLike, say: Callable[[str], None]) -> None:
    result: dict[str, Any] = {
        "build": build(
            target,
            scale_gb=args.scale_gb,
            pgbench_scale=args.pgbench_scale,
            replace=args.replace,
            vacuum=not args.no_vacuum,
            say=say,
        )
    }
    if args.change:
        say("the standard change")
        result["change"] = change(target, pgbench_seconds=args.pgbench_seconds)
        result["sizes_after_change"] = sizes(target)
    if args.values:
        started = time.monotonic()
        result["values"] = values(target, unlogged=True)
        result["values_seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(result, indent=2))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import backup_vs_peers as bvp  # its servers' settings and helpers; slow to import

    if args.dsn:
        run(args, args.dsn, bvp.say)
        return 0
    with contextlib.ExitStack() as cleanup:
        root = Path(tempfile.mkdtemp(prefix="untuned-", dir=args.scratch)).absolute()
        root.chmod(0o711)
        if not args.keep:
            cleanup.callback(shutil.rmtree, root, ignore_errors=True)
        data_dir = root / "pg" / "data"
        cleanup.callback(bvp.stop_postgres_at, data_dir)
        pg = bvp.init_instance(data_dir, settings=bvp.pg_settings("/bin/true"))
        bvp.say(f"throwaway server in {root}: {pg.conninfo}")
        run(args, pg, bvp.say)
    return 0


if __name__ == "__main__":
    sys.exit(main())
