"""Unwrapping data keys on the node (see ``shardvault.aws.keys``).

The agent asks KMS to unwrap a backup's data key with the encryption context recorded beside
it; its role allows that only for its own cluster's context. Unwrapped keys are kept in
memory (one ``Sealer`` per wrapped key), never written to disk or logged.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Callable
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from shardvault.contracts.models import Encryption
from shardvault.data.pipeline import Sealer
from shardvault.errors import KeyUnavailable, WrongKey


class DataKeys:
    def __init__(self, kms: Callable[[], Any]) -> None:
        self._kms, self._client = kms, None
        self._sealers: dict[str, Sealer] = {}
        self._guard = threading.Lock()

    def sealer(self, encryption: Encryption | None, key_check: str | None = None) -> Sealer | None:
        """The sealer of a backup's frames; None when it is not encrypted. ``key_check``
        (recorded at backup time) tells a wrong key apart before any frame is opened."""
        if encryption is None:
            return None
        with self._guard:
            sealer = self._sealers.get(encryption.wrapped_key)
            if sealer is None:
                sealer = Sealer(self._unwrap(encryption))
                self._sealers[encryption.wrapped_key] = sealer
        expected = key_check or encryption.key_check
        if expected and sealer.check != expected:
            raise WrongKey(
                f"the data key KMS unwrapped (check {sealer.check}) is not the one the backup "
                f"was sealed with (check {expected}).",
                fix="the manifest's wrapped key was replaced: restore another backup, and "
                "check who can write to the bucket.",
            )
        return sealer

    def _unwrap(self, encryption: Encryption) -> bytes:
        if self._client is None:
            self._client = self._kms()
        cluster = encryption.context.get("shardvault:cluster", "?")
        try:
            response = self._client.decrypt(
                CiphertextBlob=base64.b64decode(encryption.wrapped_key),
                EncryptionContext=encryption.context,
                KeyId=encryption.key_id,
            )
        except (ClientError, BotoCoreError) as error:
            raise KeyUnavailable(
                f"KMS did not unwrap the data key of cluster {cluster!r}: {error}.",
                fix="give this node's agent role kms:Decrypt on the data key for its cluster "
                "(its shardvault:cluster tag must name the backup's cluster), and check that "
                "the key is enabled.",
            ) from error
        return response["Plaintext"]
