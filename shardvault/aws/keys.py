"""Data keys of client-side encryption, made by the control plane without ever seeing one.

A *data key* (AES-256) seals the frames of one chain of backups (``shardvault.data.pipeline``). KMS
makes it with ``GenerateDataKeyWithoutPlaintext``: the control plane receives only the key
wrapped under the deployment's KMS key, bound to an *encryption context* that names the
cluster and the chain. Agents unwrap it themselves (``kms:Decrypt``, which their role allows
only for their own cluster's context), so no plaintext key is in a task input or output, the
execution history, a log, a trace or the catalog.

A *recovery key* is a vault copy's KMS key in its own account (``recovery_key``, account B):
the copy's manifest holds each data key wrapped under it instead of the stack's
(``for_recovery``), so a restore from the copy unwraps nothing with the stack account's key,
which a takeover of that account could schedule for deletion. Every wrapping and unwrapping is
a ``ReEncrypt``: the plaintext never leaves KMS. What the recovery key does not change: the
stack's own backups hold the same data keys under the stack's key, so whoever may restore those
could read the copy's data anyway; the key keeps the copy *restorable* without the stack's.
"""

from __future__ import annotations

import base64
import re

from botocore.exceptions import BotoCoreError, ClientError

from shardvault.aws.services import Services
from shardvault.contracts.models import Encryption
from shardvault.errors import InvalidRequest, KeyUnavailable

KEY_REGION = re.compile(r"^arn:aws[a-z-]*:kms:([a-z0-9-]+):")
CLUSTER_CONTEXT = "shardvault:cluster"
CHAIN_CONTEXT = "shardvault:chain"


def new_data_key(svc: Services, cluster: str, chain_id: str) -> Encryption:
    """A fresh data key for the chain that starts with backup ``chain_id``, wrapped by KMS."""
    key_id = svc.settings.data_key_id
    if not key_id:
        raise InvalidRequest(
            f"the policy asks to encrypt cluster {cluster!r} (encryption: kms), but this "
            "deployment has no KMS key for data keys.",
            fix="deploy the stack with its data key (DATA_KEY_ID), or set encryption: none "
            "for the cluster in the policy file.",
        )
    context = {CLUSTER_CONTEXT: cluster, CHAIN_CONTEXT: chain_id}
    try:
        response = svc.kms.generate_data_key_without_plaintext(
            KeyId=key_id, KeySpec="AES_256", EncryptionContext=context
        )
    except (ClientError, BotoCoreError) as error:
        raise KeyUnavailable(
            f"KMS did not make a data key for cluster {cluster!r} with key {key_id}: {error}.",
            fix="check that the KMS key exists, is enabled, and that the backup workflow's "
            "role may call kms:GenerateDataKeyWithoutPlaintext on it.",
        ) from error
    return Encryption(
        key_id=response["KeyId"],
        wrapped_key=base64.b64encode(response["CiphertextBlob"]).decode("ascii"),
        context=context,
    )


def for_recovery(svc: Services, encryption: Encryption, recovery_key: str) -> Encryption:
    """The data key wrapped under a copy's recovery key instead of the stack's, in the same
    context (the module's *recovery key*)."""
    region = KEY_REGION.match(recovery_key)
    here = svc.kms.meta.region_name
    if region and region.group(1) != here:
        raise KeyUnavailable(
            f"recovery key {recovery_key} is in region {region.group(1)}, and the stack's data "
            f"keys in {here}: KMS wraps a key again within one region only.",
            fix=f"name account B's key in {here} (a multi-Region key's replica there will do).",
        )
    try:
        return re_encrypted(svc, encryption, recovery_key, encryption.context)
    except (ClientError, BotoCoreError) as error:
        raise KeyUnavailable(
            f"KMS did not wrap the data key of cluster "
            f"{encryption.context.get(CLUSTER_CONTEXT)!r} under recovery key {recovery_key}: "
            f"{error}.",
            fix="check that the key exists and is enabled, and that its key policy lets the "
            "promote function's role call kms:ReEncryptTo (shardvault copy-setup prints it).",
        ) from error


def re_encrypted(
    svc: Services, encryption: Encryption, destination: str, context: dict[str, str]
) -> Encryption:
    """The data key wrapped again under ``destination`` in ``context`` (KMS ReEncrypt: the
    plaintext stays in KMS); KMS's errors are the caller's to name."""
    response = svc.kms.re_encrypt(
        CiphertextBlob=base64.b64decode(encryption.wrapped_key),
        SourceEncryptionContext=encryption.context,
        SourceKeyId=encryption.key_id,
        DestinationKeyId=destination,
        DestinationEncryptionContext=context,
    )
    wrapped = base64.b64encode(response["CiphertextBlob"]).decode("ascii")
    return encryption.model_copy(
        update={"key_id": response["KeyId"], "wrapped_key": wrapped, "context": context}
    )


def same_key(a: str, b: str) -> bool:
    """Whether two of KMS's names of a key (an id, or an ARN) name the same key."""
    return a.rsplit("key/", 1)[-1] == b.rsplit("key/", 1)[-1]


class Rewrapper:
    """Data keys wrapped again for a restore's *target* cluster under the deployment's own
    key, each once.

    An agent may unwrap only data keys of the deployment's key whose context names its own
    cluster (its role's cluster tag), so a restore into another cluster cannot open the
    source's keys as they are, nor the agents a copy's keys wrapped under its recovery key.
    The restore's plan asks KMS to re-encrypt each such key to the deployment's key, in the
    same context naming the target cluster (``ReEncrypt``: the plaintext never leaves KMS), and
    hands the target's agents those. The deployment's keys of the target cluster itself are
    handed on as they are."""

    def __init__(self, svc: Services, target_cluster: str) -> None:
        self.svc, self.target = svc, target_cluster
        self._done: dict[str, Encryption] = {}

    def __call__(self, encryption: Encryption | None) -> Encryption | None:
        if encryption is None or self._opens_as_it_is(encryption):
            return encryption
        if encryption.wrapped_key not in self._done:
            self._done[encryption.wrapped_key] = self._rewrap(encryption)
        return self._done[encryption.wrapped_key]

    def _opens_as_it_is(self, encryption: Encryption) -> bool:
        """In the target's context, under the deployment's key (or a deployment that names
        none, which can wrap nothing: its agents then say whether they unwrap it)."""
        ours = self.svc.settings.data_key_id
        in_target = encryption.context.get(CLUSTER_CONTEXT) == self.target
        return in_target and (ours is None or same_key(encryption.key_id, ours))

    def _rewrap(self, encryption: Encryption) -> Encryption:
        destination = self.svc.settings.data_key_id
        if not destination:
            raise KeyUnavailable(
                f"the backup's frames are sealed, and this deployment has no KMS key to wrap "
                f"their data key under for cluster {self.target!r}.",
                fix="deploy the stack with its data key (DATA_KEY_ID).",
            )
        context = {**encryption.context, CLUSTER_CONTEXT: self.target}
        try:
            return re_encrypted(self.svc, encryption, destination, context)
        except (ClientError, BotoCoreError) as error:
            foreign = not same_key(encryption.key_id, destination)
            raise KeyUnavailable(
                f"KMS did not wrap the data key of cluster "
                f"{encryption.context.get(CLUSTER_CONTEXT)!r} (under {encryption.key_id}) for "
                f"cluster {self.target!r}: {error}.",
                fix=(
                    f"check that {encryption.key_id} exists and is enabled; that the policy "
                    "names it as a copy's recovery_key (the template grants the restore's "
                    "plan kms:ReEncryptFrom on those only); and that its key policy allows "
                    "that role (shardvault copy-setup prints it)."
                    if foreign
                    else "check that the KMS key exists and is enabled, and that the restore "
                    "workflow's role may call kms:ReEncryptFrom and kms:ReEncryptTo on it."
                ),
            ) from error
