"""A distributed "bank": the two-phase-commit workload a cluster-wide cut is for, as the cut
guide (docs/guide/cluster-cut.md) prescribes it, for the tests and the benchmark.

Each node's ``bank`` database holds one account (``accounts``, a balance) and the legs of
the transfers it took part in (``transfers``: the transfer's id, ``debit`` or ``credit``, the
amount). A *transfer* moves an amount from one node's account to another's: each leg is
prepared on its node (``PREPARE TRANSACTION``), then the commit lock is taken shared on both
(``pg_try_advisory_lock_shared``: refused while a cut waits for it exclusively, when the
transfer lets go of both and tries again), both legs are committed (``COMMIT PREPARED``) and
the lock is let go. A restored cluster is *consistent* when the balances add up to what the
accounts started with and every committed transfer has both legs (``check``); a transfer
prepared and not committed at the cut is *in doubt* (``pg_prepared_xacts``), on every node it
was prepared on, and moves nothing.

Run as a module, it transfers between the nodes until a file appears or a time passes, and
prints what it did (transfers, lock retries, latencies) as JSON:
``python -m tests.integration.bank --key 4242 --seconds 30 CONNINFO CONNINFO ...``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

DATABASE = "bank"
OPENING_BALANCE = 1_000_000
SCHEMA = """
CREATE TABLE IF NOT EXISTS accounts (id int PRIMARY KEY, balance bigint NOT NULL);
CREATE TABLE IF NOT EXISTS transfers (
    id bigint NOT NULL, leg text NOT NULL, amount bigint NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp(), PRIMARY KEY (id, leg)
);
"""
OPEN_ACCOUNT = "INSERT INTO accounts VALUES (1, %s) ON CONFLICT DO NOTHING"
LEG = (  # one statement each: a statement with parameters is prepared, one command only
    "UPDATE accounts SET balance = balance + %(change)s WHERE id = 1",
    "INSERT INTO transfers (id, leg, amount) VALUES (%(id)s, %(leg)s, %(amount)s)",
)


def open_sessions(conninfos: list[str]) -> list[psycopg.Connection]:
    return [
        psycopg.connect(c, autocommit=True, application_name="bank", dbname=DATABASE)
        for c in conninfos
    ]


def set_up(conninfos: list[str]) -> None:
    """The ``bank`` database, its tables and an account on every node (the role must be able
    to create a database)."""
    for conninfo in conninfos:
        with psycopg.connect(conninfo, autocommit=True) as admin:
            exists = admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DATABASE,))
            if exists.fetchone() is None:
                admin.execute(f"CREATE DATABASE {DATABASE}")
    for session in open_sessions(conninfos):
        with session:
            session.execute(SCHEMA)
            session.execute(OPEN_ACCOUNT, (OPENING_BALANCE,))


class Bank:
    """Transfers between the nodes of ``sessions``, each paused by the commit lock ``key``."""

    def __init__(self, sessions: list[psycopg.Connection], key: int, first_id: int = 1) -> None:
        self.sessions, self.key, self.next_id = sessions, key, first_id
        self.retries = 0

    def transfer(self, debit: int, credit: int, amount: int, gap: float = 0.0) -> list[float]:
        """One transfer from node ``debit`` to node ``credit``; the times each leg committed
        (epoch seconds, this host's clock). ``gap``: seconds between the two commits (a slow
        transfer, whose halves a time target can split)."""
        transfer_id, self.next_id = self.next_id, self.next_id + 1
        legs = [(debit, "debit", -amount), (credit, "credit", amount)]
        for node, leg, change in legs:
            session = self.sessions[node]
            session.execute("BEGIN")
            values = {"change": change, "id": transfer_id, "leg": leg, "amount": amount}
            for statement in LEG:
                session.execute(statement, values)
            session.execute(f"PREPARE TRANSACTION '{gid(transfer_id, leg)}'")
        self._lock([debit, credit])
        committed = []
        try:
            for node, leg, _ in legs:
                self.sessions[node].execute(f"COMMIT PREPARED '{gid(transfer_id, leg)}'")
                committed.append(time.time())
                time.sleep(gap if len(committed) == 1 else 0)
        finally:
            for node in (debit, credit):
                self.sessions[node].execute("SELECT pg_advisory_unlock_shared(%s)", (self.key,))
        return committed

    def _lock(self, nodes: list[int]) -> None:
        """The commit lock, shared, on every node of the transfer; all or none (a cut waiting
        for it refuses a shared one: let go of all, and try again)."""
        while True:
            held = []
            for node in nodes:
                row = (
                    self.sessions[node]
                    .execute("SELECT pg_try_advisory_lock_shared(%s)", (self.key,))
                    .fetchone()
                )
                if row is None or not row[0]:
                    break
                held.append(node)
            if len(held) == len(nodes):
                return
            for node in held:
                self.sessions[node].execute("SELECT pg_advisory_unlock_shared(%s)", (self.key,))
            self.retries += 1
            time.sleep(0.001)


def gid(transfer_id: int, leg: str) -> str:
    return f"bank-{transfer_id}-{leg}"


def check(conninfos: list[str]) -> dict[str, Any]:
    """What a (restored) cluster's bank holds: the total balance against the opening one,
    the transfers with one committed leg only (*half*), and the legs in doubt."""
    legs: dict[int, set[str]] = {}
    total, in_doubt = 0, 0
    for session in open_sessions(conninfos):
        with session:
            total += session.execute("SELECT coalesce(sum(balance), 0) FROM accounts").fetchone()[0]
            for transfer_id, leg in session.execute("SELECT id, leg FROM transfers"):
                legs.setdefault(transfer_id, set()).add(leg)
            in_doubt += session.execute(
                "SELECT count(*) FROM pg_prepared_xacts WHERE gid LIKE 'bank-%%'"
            ).fetchone()[0]
    half = sorted(t for t, seen in legs.items() if seen != {"debit", "credit"})
    return {
        "total": int(total),
        "opening": OPENING_BALANCE * len(conninfos),
        "committed": len(legs) - len(half),
        "half": half,
        "in_doubt": int(in_doubt),
    }


def run(conninfos: list[str], key: int, seconds: float, stop: Path | None, first_id: int) -> dict:
    """Transfers between random pairs of nodes until ``stop`` exists or ``seconds`` passed."""
    bank = Bank(open_sessions(conninfos), key, first_id)
    latencies, end = [], time.monotonic() + seconds
    while time.monotonic() < end and not (stop and stop.exists()):
        debit, credit = random.sample(range(len(conninfos)), 2)
        started = time.monotonic()
        bank.transfer(debit, credit, random.randint(1, 100))
        latencies.append(time.monotonic() - started)
    ordered = sorted(latencies) or [0.0]
    return {
        "transfers": len(latencies),
        "lock_retries": bank.retries,
        "p50_ms": round(statistics.median(ordered) * 1000, 2),
        "p99_ms": round(ordered[int(0.99 * (len(ordered) - 1))] * 1000, 2),
        "max_ms": round(ordered[-1] * 1000, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.integration.bank")
    parser.add_argument("conninfo", nargs="+")
    parser.add_argument("--key", type=int, required=True, help="the commit lock")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--stop-file", type=Path, help="stop once this file exists")
    parser.add_argument("--first-id", type=int, default=1)
    args = parser.parse_args(argv)
    found = run(args.conninfo, args.key, args.seconds, args.stop_file, args.first_id)
    json.dump(found, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
