"""The calls made against the grants, both ways, from the records of test sessions.

``python -m shardvault.local.iam.report DIR`` merges the summaries each local stack wrote into
``DIR`` (``SHARDVAULT_IAM_RECORD``) and fails (exit status 1) on:

- every call refused that no test asked to be refused: a grant missing from the template
  (the deployed stack would refuse it too, silently where the code swallows the error, as a
  notification's publish does);
- every granted action no call used (a *grant* here: holder, action and the resource its
  statement names) that ``UNEXERCISED`` does not justify: a grant broader than the code needs
  is removed from the template; one the code needs on a path the suite does not reach (a
  failure path, a second attempt, an archive class that takes hours to thaw) is listed there
  with the reason.

It lists every unused grant in ``DIR/unused.txt`` and warns of a justification whose grant a
call did use or the template no longer holds (the list is kept true by hand: a path reached
on one run and not another must stay listed, so a used one only warns).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from shardvault.local.iam.evaluate import as_list, matches
from shardvault.local.iam.template import GRANTS_FILE, RUNTIME_ACTIONS

UNEXERCISED = Path(__file__).with_name("unexercised.yaml")
# CDK's logical ids end in a hash of the construct path: the label leaves it out.
LOGICAL_ID_HASH = re.compile(r"[0-9A-F]{8}$")


def merged(directory: Path) -> dict[str, Any]:
    used: dict[str, set[tuple[int, str]]] = {}
    denied: set[tuple[str, ...]] = set()
    for path in sorted(directory.glob("*.json")):
        summary = json.loads(path.read_text())
        for holder, pairs in summary["used"].items():
            used.setdefault(holder, set()).update((index, action) for index, action in pairs)
        denied.update(tuple(entry) for entry in summary["denied"])
    return {"used": used, "denied": sorted(denied)}


def label(value: Any) -> str:
    """A statement's resource as a person reads it: ``Staging/backups/*``, ``Catalog``."""
    if isinstance(value, list):
        return ", ".join(label(v) for v in value)
    if isinstance(value, str):
        return value
    if "Ref" in value:
        return LOGICAL_ID_HASH.sub("", value["Ref"])
    if "Fn::GetAtt" in value:
        return LOGICAL_ID_HASH.sub("", as_list(value["Fn::GetAtt"])[0])
    if "Fn::Join" in value:
        return "".join(label(part) for part in value["Fn::Join"][1])
    return json.dumps(value, sort_keys=True)


def unused_grants(
    grants: dict[str, list[dict[str, Any]]], used: dict[str, set[tuple[int, str]]]
) -> list[tuple[str, str]]:
    """(holder, "<action> on <resource>") of each granted action that allowed no recorded
    call."""
    unused = []
    for holder, statements in sorted(grants.items()):
        calls = used.get(holder, set())
        for index, statement in enumerate(statements):
            for pattern in as_list(statement.get("Action", [])):
                if pattern.startswith(RUNTIME_ACTIONS):
                    continue
                if not any(i == index and matches(pattern, a, case=False) for i, a in calls):
                    unused.append((holder, f"{pattern} on {label(statement.get('Resource'))}"))
    return unused


def justified(path: Path = UNEXERCISED) -> dict[tuple[str, str], str]:
    """(holder, grant) to the reason the deployed stack keeps it, unused by the suite."""
    listed = yaml.safe_load(path.read_text()) or {}
    return {
        (holder, grant): why for holder, grants in listed.items() for grant, why in grants.items()
    }


def main(argv: list[str], unexercised: Path = UNEXERCISED) -> int:
    directory = Path(argv[0]) if argv else Path(".cache/iam-calls")
    records = merged(directory)
    grants = json.loads(GRANTS_FILE.read_text())["principals"]
    for holder, action, resource in records["denied"]:
        print(f"REFUSED  {holder}: {action} on {resource}")
    unused = unused_grants(grants, records["used"])
    listing = directory / "unused.txt"
    listing.write_text("".join(f"{holder}: {grant}\n" for holder, grant in unused))
    reasons = justified(unexercised)
    unjustified = [pair for pair in unused if pair not in reasons]
    for holder, grant in unjustified:
        print(f"UNUSED   {holder}: {grant} (remove the grant, or say why in {unexercised.name})")
    for holder, grant in sorted(set(reasons) - set(unused)):
        print(f"note: {unexercised.name} lists {holder}: {grant}, which a call used or the "
              "template no longer grants")  # fmt: skip
    print(
        f"IAM: {len(records['denied'])} call(s) refused that no test asked for; "
        f"{len(unused)} granted action(s) no call used ({len(unjustified)} unjustified; "
        f"listed in {listing})."
    )
    return 1 if records["denied"] or unjustified else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
