"""The local stack enforces the grants ``cdk synth`` writes, no older ones."""

from __future__ import annotations

import json

from shardvault.local.iam.template import (
    GRANTS_FILE,
    grants_document,
    render,
    synthesized_template,
)


def test_the_local_stacks_grants_are_the_synthesized_templates():
    fresh = render(grants_document(synthesized_template()))
    assert GRANTS_FILE.read_text() == fresh, (
        "shardvault/local/iam/grants.json differs from the template: run `make grants`"
    )


def test_every_function_and_the_agents_hold_grants():
    principals = json.loads(GRANTS_FILE.read_text())["principals"]
    assert "agent" in principals
    assert "function:promote_backup" in principals
    assert len([p for p in principals if p.startswith("function:")]) >= 30
