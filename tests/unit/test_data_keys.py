"""Data keys: made wrapped by KMS for a cluster, unwrapped by an agent only with that cluster's
encryption context, and checked against the key the backup was sealed with."""

from __future__ import annotations

import base64

import boto3
import pytest
from moto import mock_aws
from shardvault_agent.keys import DataKeys

from shardvault.aws.keys import (
    CLUSTER_CONTEXT,
    Rewrapper,
    for_recovery,
    new_data_key,
    same_key,
)
from shardvault.contracts.models import Encryption
from shardvault.data.pipeline import key_check
from shardvault.errors import InvalidRequest, KeyUnavailable, WrongKey


class Svc:
    def __init__(self, key_id: str | None) -> None:
        self.kms = boto3.client("kms", region_name="us-east-1")
        self.settings = type("S", (), {"data_key_id": key_id})()


@pytest.fixture
def kms_key():
    with mock_aws():
        kms = boto3.client("kms", region_name="us-east-1")
        yield kms.create_key()["KeyMetadata"]["KeyId"]


def keys() -> DataKeys:
    return DataKeys(lambda: boto3.client("kms", region_name="us-east-1"))


def test_the_control_plane_gets_only_a_wrapped_key_that_the_cluster_unwraps(kms_key):
    wrapped = new_data_key(Svc(kms_key), "orders", "b1")
    assert wrapped.context == {CLUSTER_CONTEXT: "orders", "shardvault:chain": "b1"}
    assert set(Encryption.model_fields) == {"key_id", "wrapped_key", "context", "key_check"}
    assert keys().sealer(wrapped) is not None


def test_another_clusters_context_does_not_unwrap_the_key(kms_key):
    wrapped = new_data_key(Svc(kms_key), "orders", "b1")
    stolen = wrapped.model_copy(update={"context": {**wrapped.context, CLUSTER_CONTEXT: "other"}})
    with pytest.raises(KeyUnavailable, match="did not unwrap"):
        keys().sealer(stolen)


def test_a_replaced_wrapped_key_is_named_before_any_frame_is_opened(kms_key):
    sealed_with = new_data_key(Svc(kms_key), "orders", "b1")
    check = keys().sealer(sealed_with).check
    replaced = new_data_key(Svc(kms_key), "orders", "b1")  # valid, but another key
    with pytest.raises(WrongKey):
        keys().sealer(replaced, key_check=check)
    assert check == key_check(
        boto3.client("kms", region_name="us-east-1").decrypt(
            CiphertextBlob=base64.b64decode(sealed_with.wrapped_key),
            EncryptionContext=sealed_with.context,
        )["Plaintext"]
    )


def test_a_deployment_without_a_data_key_refuses_by_name():
    with mock_aws(), pytest.raises(InvalidRequest, match="no KMS key for data keys"):
        new_data_key(Svc(None), "orders", "b1")


def test_no_encryption_means_no_sealer():
    assert keys().sealer(None) is None


def test_a_key_wrapped_again_for_a_restores_target_opens_there_to_the_same_key(kms_key):
    """A restore into another cluster: the target's agents may unwrap only their cluster's
    context, so the plan wraps the key again for it (KMS ReEncrypt), once per key."""
    kms = boto3.client("kms", region_name="us-east-1")
    wrapped = new_data_key(Svc(kms_key), "orders", "b1")
    rewrap = Rewrapper(Svc(kms_key), "orders-copy")
    moved = rewrap(wrapped)
    assert moved.context == {CLUSTER_CONTEXT: "orders-copy", "shardvault:chain": "b1"}
    assert rewrap(wrapped) is moved  # once per key

    def plaintext(encryption: Encryption) -> bytes:
        blob = base64.b64decode(encryption.wrapped_key)
        return kms.decrypt(CiphertextBlob=blob, EncryptionContext=encryption.context)["Plaintext"]

    assert plaintext(moved) == plaintext(wrapped)
    assert Rewrapper(Svc(kms_key), "orders")(wrapped) is wrapped  # into its own cluster


def test_a_copys_recovery_key_wraps_the_same_data_key_and_a_restore_opens_it_with_ours(kms_key):
    """A vault copy's manifest holds the data key under account B's recovery key; a restore
    from it, into the very cluster, wraps it again under the deployment's key, in the target's
    context, for its agents."""
    kms = boto3.client("kms", region_name="us-east-1")
    recovery = kms.create_key(Description="account B's recovery key")["KeyMetadata"]["Arn"]
    wrapped = new_data_key(Svc(kms_key), "orders", "b1")
    held = for_recovery(Svc(kms_key), wrapped, recovery)
    assert (held.key_id, held.context) == (recovery, wrapped.context)
    assert held.wrapped_key != wrapped.wrapped_key

    def plaintext(encryption: Encryption) -> bytes:
        blob = base64.b64decode(encryption.wrapped_key)
        return kms.decrypt(CiphertextBlob=blob, EncryptionContext=encryption.context)["Plaintext"]

    opened = Rewrapper(Svc(kms_key), "orders")(held)
    assert opened is not held  # the recovery key is not the agents' to use
    assert same_key(opened.key_id, kms_key)
    assert plaintext(opened) == plaintext(wrapped)
    elsewhere = recovery.replace("us-east-1", "eu-west-1")
    with pytest.raises(KeyUnavailable, match="in region eu-west-1") as refused:
        for_recovery(Svc(kms_key), wrapped, elsewhere)
    assert "in us-east-1" in refused.value.fix
    with pytest.raises(KeyUnavailable, match="no KMS key to wrap"):
        Rewrapper(Svc(None), "orders-copy")(held)
