"""The calls made against the grants, both ways, from the records of test sessions.

``python -m shardvault.local.iam.report DIR`` merges the summaries each local stack wrote into
``DIR`` (``SHARDVAULT_IAM_RECORD``) and prints:

- every call refused that no test asked to be refused: a grant missing from the template
  (exit status 1: the deployed stack would refuse it too, silently where the code swallows
  the error, as a notification's publish does);
- how many (statement, action) pairs of the functions, the agents and the operators no call
  used (listed in ``DIR/unused.txt``): a grant broader than the code needs, unless the suite
  never reaches the call.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from shardvault.local.iam.evaluate import as_list, matches
from shardvault.local.iam.template import GRANTS_FILE, RUNTIME_ACTIONS


def merged(directory: Path) -> dict[str, Any]:
    used: dict[str, set[tuple[int, str]]] = {}
    denied: set[tuple[str, ...]] = set()
    for path in sorted(directory.glob("*.json")):
        summary = json.loads(path.read_text())
        for holder, pairs in summary["used"].items():
            used.setdefault(holder, set()).update((index, action) for index, action in pairs)
        denied.update(tuple(entry) for entry in summary["denied"])
    return {"used": used, "denied": sorted(denied)}


def unused_grants(
    grants: dict[str, list[dict[str, Any]]], used: dict[str, set[tuple[int, str]]]
) -> list[tuple[str, int, str]]:
    """(holder, statement index, action pattern) that allowed no recorded call."""
    unused = []
    for holder, statements in sorted(grants.items()):
        for index, statement in enumerate(statements):
            for pattern in as_list(statement.get("Action", [])):
                if pattern.startswith(RUNTIME_ACTIONS):
                    continue
                calls = used.get(holder, set())
                if not any(i == index and matches(pattern, a, case=False) for i, a in calls):
                    unused.append((holder, index, pattern))
    return unused


def main(argv: list[str]) -> int:
    directory = Path(argv[0]) if argv else Path(".cache/iam-calls")
    records = merged(directory)
    grants = json.loads(GRANTS_FILE.read_text())["principals"]
    for holder, action, resource in records["denied"]:
        print(f"REFUSED  {holder}: {action} on {resource}")
    unused = unused_grants(grants, records["used"])
    listing = directory / "unused.txt"
    listing.write_text("".join(f"{h}: statement {i}: {a}\n" for h, i, a in unused))
    print(
        f"IAM: {len(records['denied'])} call(s) refused that no test asked for; "
        f"{len(unused)} granted action(s) no call used (listed in {listing})."
    )
    return 1 if records["denied"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
