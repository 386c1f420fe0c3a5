"""Entry point of the CDK app (``cdk.json``: ``python infra/app.py``, run from the repo root).

``build_app`` is what the CLI and the tests share: the ShardVault stack, environment-agnostic
(no account or region is needed to synthesize it), checked by cdk-nag's AwsSolutions rules.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# Run as a script, this file's directory is on sys.path, not the repository root (the
# construct modules live in ``infra/components`` so that none can shadow the ``constructs``
# library from that directory).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aws_cdk import App, Aspects
from cdk_nag import AwsSolutionsChecks

from infra.constants import STACK_NAME
from infra.stack import ShardVaultStack


def build_app(**app_options: Any) -> tuple[App, ShardVaultStack]:
    app = App(**app_options)
    # A second deployment in the same account (another environment, another region): its
    # names are its own (state machines, log groups), IAM's are CloudFormation's.
    name = app.node.try_get_context("stackName") or STACK_NAME
    stack = ShardVaultStack(
        app, name, description="ShardVault: serverless backups of database clusters."
    )
    Aspects.of(app).add(AwsSolutionsChecks(verbose=True))
    return app, stack


def main() -> None:
    app, _ = build_app()
    app.synth()


if __name__ == "__main__":
    main()
