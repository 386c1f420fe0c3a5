"""``shardvault copy-setup``: what account B's owner applies for an aws vault copy, from the
policy file alone; the documents are the ones the local stack's gate enforces
(``shardvault.aws.vault_account``), so what the guide tells B's owner is what the tests prove."""

from __future__ import annotations

import json
from pathlib import Path

from shardvault.aws.vault_account import (
    COPY_READERS,
    COPY_WRITERS,
    bucket_policy,
    merged,
    recovery_key_policy,
    role_policy,
    trust_policy,
)
from shardvault.client.cli import REFUSED, main
from shardvault.config.policy import load_policy

EXAMPLE_POLICY = Path(__file__).resolve().parents[2] / "examples" / "shardvault.yaml"

SETUP = ["copy-setup", "orders"]
# The stack's CopyRoleArns output: its copy writers' and readers' roles, in that order.
MODULES = (*COPY_WRITERS, *COPY_READERS)
ROLES = ",".join(f"arn:aws:iam::111122223333:role/ShardVault-{m}" for m in MODULES)


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
    # The recovery key: promotion wraps under it, a restore's plan unwraps from it; neither
    # decrypts, and only account B administers it.
    roles = dict(zip(MODULES, ROLES.split(","), strict=True))
    assert found["recovery_key"] == {"arn": target.recovery_key}
    assert found["recovery_key_policy"] == recovery_key_policy(target, roles)
    uses = {s["Sid"]: s for s in found["recovery_key_policy"]["Statement"]}
    # check's probe (probe_store) wraps a throwaway key there and back, as the two do.
    wrappers = [roles["promote_backup"], roles["probe_store"]]
    assert uses["PromotionWrapsDataKeys"]["Principal"] == {"AWS": wrappers}
    assert uses["PromotionWrapsDataKeys"]["Action"] == "kms:ReEncryptTo"
    unwrappers = [roles["plan_restore"], roles["probe_store"]]
    assert uses["RestoresUnwrapDataKeys"]["Principal"] == {"AWS": unwrappers}
    assert uses["RestoresUnwrapDataKeys"]["Action"] == "kms:ReEncryptFrom"
    administers = uses["AccountBAdministersTheKey"]["Principal"]
    assert administers == {"AWS": "arn:aws:iam::222233334444:root"}
    assert "kms:Decrypt" not in json.dumps(found["recovery_key_policy"])


def test_copy_setup_wants_the_whole_role_list_for_a_recovery_key(capsys):
    one_role = ROLES.split(",")[0]
    done = main([*SETUP, "air-gapped", "--policy", str(EXAMPLE_POLICY), "--stack-roles", one_role])
    assert done == REFUSED
    assert "CopyRoleArns output whole (6 roles" in capsys.readouterr().err


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
