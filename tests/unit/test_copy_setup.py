"""``shardvault copy-setup``: what account B's owner applies for an aws vault copy, from the
policy file alone; the documents are the ones the local stack's gate enforces
(``shardvault.aws.vault_account``), so what the guide tells B's owner is what the tests prove."""

from __future__ import annotations

import json
from pathlib import Path

from shardvault.aws.vault_account import bucket_policy, merged, role_policy, trust_policy
from shardvault.client.cli import REFUSED, main
from shardvault.config.policy import load_policy

EXAMPLE_POLICY = Path(__file__).resolve().parents[2] / "examples" / "shardvault.yaml"

SETUP = ["copy-setup", "orders"]
ROLES = "arn:aws:iam::111122223333:role/ShardVault-Promote,arn:aws:iam::111122223333:role/Thaw"


def test_copy_setup_prints_account_bs_documents_for_the_policys_target(capsys):
    done = main(
        [*SETUP, "air-gapped", "--policy", str(EXAMPLE_POLICY), "--stack-roles", ROLES, "--json"]
    )

    assert done == 0
    found = json.loads(capsys.readouterr().out)
    (target,) = load_policy(EXAMPLE_POLICY).cluster("orders").vault.copies
    assert found["bucket_policy"] == bucket_policy(target)
    assert found["role_policy"] == role_policy(target)
    assert found["trust_policy"] == trust_policy(target, ROLES.split(","))
    trusted = found["trust_policy"]["Statement"][0]
    assert trusted["Condition"] == {"StringEquals": {"sts:ExternalId": target.external_id}}
    caps = {s["Sid"]: s for s in found["bucket_policy"]["Statement"]}
    days = caps["LocksUpToTheCap"]["Condition"]["NumericGreaterThan"]
    assert days == {"s3:object-lock-remaining-retention-days": str(target.object_lock.days + 1)}
    assert "s3:DeleteObjectVersion" in caps["NoDeletesFromTheSourceAccount"]["Action"]
    assert "Delete" not in json.dumps(found["role_policy"])  # the role itself never deletes


def test_copy_setup_refuses_an_unknown_target_or_no_role_by_name(capsys):
    unknown = main([*SETUP, "nope", "--policy", str(EXAMPLE_POLICY), "--stack-roles", ROLES])
    no_role = main(
        [*SETUP, "air-gapped", "--policy", str(EXAMPLE_POLICY), "--stack-roles", "Promote"]
    )

    assert (unknown, no_role) == (REFUSED, REFUSED)
    said = capsys.readouterr().err
    assert "no aws vault copy named 'nope'" in said
    assert "name one of air-gapped" in said
    assert "'Promote' is not a role ARN" in said


def test_a_role_several_targets_name_gets_one_policy_with_unique_sids():
    policy = load_policy(EXAMPLE_POLICY)
    (target,) = policy.cluster("orders").vault.copies
    other = target.model_copy(update={"bucket": "acme-vault-c"})

    both = merged([role_policy(target), role_policy(other)])

    sids = [s["Sid"] for s in both["Statement"]]
    assert len(sids) == len(set(sids)) == 2 * len(role_policy(target)["Statement"])
