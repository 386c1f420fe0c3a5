"""``shardvault copy-setup CLUSTER NAME --policy FILE --stack-roles ARNS``: what account B's
owner applies for an aws vault copy (``shardvault.aws.vault_account``): the bucket's Object
Lock settings, its policy, the role's trust policy and permissions, and the recovery key's
policy when the copy names one. It reads nothing of a deployment, so B's owner runs it with
the policy file and the stack's ``CopyRoleArns`` output alone (its roles in the order of
``COPY_WRITERS`` then ``COPY_READERS``, as the stack writes it)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from shardvault.client.output import console, emit_json
from shardvault.errors import InvalidRequest


def add_parser(sub: Any) -> tuple[argparse.ArgumentParser, ...]:
    setup = sub.add_parser(
        "copy-setup", help="print what account B applies for an aws vault copy (IAM, bucket)"
    )
    setup.add_argument("cluster")
    setup.add_argument("name", help="the copy target's name (vault.copies[].name)")
    setup.add_argument("--policy", type=Path, required=True, help="the deployment's policy file")
    setup.add_argument(
        "--stack-roles",
        required=True,
        help="the stack's CopyRoleArns output: the functions' role ARNs, comma-separated",
    )
    setup.add_argument("--json", action="store_true", help="the documents as one JSON object")
    setup.set_defaults(run=run_copy_setup)
    return (setup,)


def documents(policy_file: Path, cluster: str, name: str, roles: list[str]) -> dict[str, Any]:
    """Every document of B's side of copy ``name``, by what it is applied to."""
    from shardvault.aws.vault_account import (
        COPY_READERS,
        COPY_WRITERS,
        bucket_policy,
        recovery_key_policy,
        role_policy,
        trust_policy,
    )
    from shardvault.config.policy import load_policy
    from shardvault.config.targets import AwsTarget

    policy = load_policy(policy_file)
    copies = policy.cluster(cluster).vault.copies if cluster in policy.clusters else []
    target = next((c for c in copies if c.name == name), None)
    if not isinstance(target, AwsTarget):
        names = [c.name for c in copies if isinstance(c, AwsTarget)]
        raise InvalidRequest(
            f"cluster {cluster!r} has no aws vault copy named {name!r} in {policy_file}.",
            fix=f"name one of {', '.join(names) or '(none: add one to vault.copies)'}.",
        )
    bad = [r for r in roles if not r.startswith("arn:aws") or ":role/" not in r]
    if bad or not roles:
        raise InvalidRequest(
            f"--stack-roles {bad[0] if bad else '(empty)'!r} is not a role ARN.",
            fix="pass the stack's CopyRoleArns output as it is (aws cloudformation "
            'describe-stacks --query "Stacks[0].Outputs").',
        )
    found = {
        "bucket": {
            "name": target.bucket,
            "region": target.region,
            "object_lock": {"Mode": "COMPLIANCE", "Days": 1},
            "default_encryption_key": target.kms_key,
        },
        "bucket_policy": bucket_policy(target),
        "role": {"arn": target.role_arn, "external_id": target.external_id},
        "trust_policy": trust_policy(target, roles),
        "role_policy": role_policy(target),
    }
    if target.recovery_key:
        modules = (*COPY_WRITERS, *COPY_READERS)
        if len(roles) != len(modules):
            raise InvalidRequest(
                f"--stack-roles names {len(roles)} role(s); the recovery key's policy needs "
                f"the stack's CopyRoleArns output whole ({len(modules)} roles, in its order).",
                fix="pass the CopyRoleArns output as it is.",
            )
        found["recovery_key"] = {"arn": target.recovery_key}
        found["recovery_key_policy"] = recovery_key_policy(
            target, dict(zip(modules, roles, strict=True))
        )
    return found


def run_copy_setup(args: argparse.Namespace) -> int:
    roles = [r.strip() for r in args.stack_roles.split(",") if r.strip()]
    found = documents(args.policy, args.cluster, args.name, roles)
    if args.json:
        return emit_json(found)
    bucket, role = found["bucket"], found["role"]
    console.print(
        f"# In account {role['arn'].split(':')[4]}: bucket {bucket['name']} in {bucket['region']}, "
        "created with Object Lock, a COMPLIANCE default retention of 1 day (the backstop for a "
        f"write without a lock), default encryption under {bucket['default_encryption_key']}.",
        highlight=False,
        soft_wrap=True,
    )
    shown = [
        (f"Bucket policy of {bucket['name']}", "bucket_policy"),
        (f"Trust policy of {role['arn']}", "trust_policy"),
        (f"Permissions of {role['arn']} (an inline policy)", "role_policy"),
    ]
    if "recovery_key" in found:
        arn = found["recovery_key"]["arn"]
        shown.append(
            (f"Key policy of the recovery key {arn} (in the stack's region)", "recovery_key_policy")
        )
    for title, key in shown:
        console.print(f"\n# {title}", highlight=False, soft_wrap=True)
        console.print(json.dumps(found[key], indent=2), highlight=False, soft_wrap=True)
    return 0
