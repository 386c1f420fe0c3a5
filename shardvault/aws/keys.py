"""Data keys of client-side encryption, made by the control plane without ever seeing one.

A *data key* (AES-256) seals the frames of one chain of backups (``shardvault.data.pipeline``). KMS
makes it with ``GenerateDataKeyWithoutPlaintext``: the control plane receives only the key
wrapped under the deployment's KMS key, bound to an *encryption context* that names the
cluster and the chain. Agents unwrap it themselves (``kms:Decrypt``, which their role allows
only for their own cluster's context), so no plaintext key is in a task input or output, the
execution history, a log, a trace or the catalog.
"""

from __future__ import annotations

import base64

from botocore.exceptions import BotoCoreError, ClientError

from shardvault.aws.services import Services
from shardvault.contracts.models import Encryption
from shardvault.errors import InvalidRequest, KeyUnavailable

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


class Rewrapper:
    """Data keys wrapped again for a restore's *target* cluster, each once.

    An agent may unwrap only data keys whose context names its own cluster (its role's cluster
    tag), so a restore into another cluster cannot open the source's keys as they are. The
    restore's plan asks KMS to re-encrypt each wrapped key from the source's context to the
    same context naming the target cluster (``ReEncrypt``: the plaintext never leaves KMS), and
    hands the target's agents those. Into the source cluster itself, nothing changes."""

    def __init__(self, svc: Services, target_cluster: str) -> None:
        self.svc, self.target = svc, target_cluster
        self._done: dict[str, Encryption] = {}

    def __call__(self, encryption: Encryption | None) -> Encryption | None:
        if encryption is None or encryption.context.get(CLUSTER_CONTEXT) == self.target:
            return encryption
        if encryption.wrapped_key not in self._done:
            self._done[encryption.wrapped_key] = self._rewrap(encryption)
        return self._done[encryption.wrapped_key]

    def _rewrap(self, encryption: Encryption) -> Encryption:
        context = {**encryption.context, CLUSTER_CONTEXT: self.target}
        try:
            response = self.svc.kms.re_encrypt(
                CiphertextBlob=base64.b64decode(encryption.wrapped_key),
                SourceEncryptionContext=encryption.context,
                SourceKeyId=encryption.key_id,
                DestinationKeyId=encryption.key_id,
                DestinationEncryptionContext=context,
            )
        except (ClientError, BotoCoreError) as error:
            raise KeyUnavailable(
                f"KMS did not wrap the data key of cluster "
                f"{encryption.context.get(CLUSTER_CONTEXT)!r} for cluster {self.target!r}: "
                f"{error}.",
                fix="check that the KMS key exists and is enabled, and that the restore "
                "workflow's role may call kms:ReEncryptFrom and kms:ReEncryptTo on it.",
            ) from error
        wrapped = base64.b64encode(response["CiphertextBlob"]).decode("ascii")
        return encryption.model_copy(update={"wrapped_key": wrapped, "context": context})
