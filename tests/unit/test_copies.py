"""What a copy target's failure leaves on record (``shardvault.lifecycle.copies``): no session
URI, and a transient error tried again before the target is settled FAILED."""

from __future__ import annotations

from types import SimpleNamespace

from google.api_core import exceptions as gcs_errors

from shardvault.lifecycle import copies


def test_an_errors_urls_lose_their_query_before_any_record_or_log():
    text = (
        "503 PUT https://storage.example/upload/storage/v1/b/v/o?uploadType=resumable&"
        "upload_id=ABCsecret: Service Unavailable"
    )
    scrubbed = copies.scrubbed(text)
    assert "ABCsecret" not in scrubbed
    assert "upload_id" not in scrubbed
    assert scrubbed.startswith("503 PUT https://storage.example/upload/storage/v1/b/v/o?...")


CONTEXT = SimpleNamespace(backup_id="b1", cluster="c")
TARGET = SimpleNamespace(name="offsite", kind="gcs", bucket="acme-b")


def test_a_transient_error_is_tried_again_then_settled_failed(monkeypatch):
    kept: dict = {}
    monkeypatch.setattr(copies, "load_progress", lambda svc, b, n: dict(kept))
    monkeypatch.setattr(copies, "save_progress", lambda svc, b, n, p: kept.update(p))
    monkeypatch.setattr(copies, "failed", lambda context, target, error, reason, svc: "FAILED")
    busy = gcs_errors.ServiceUnavailable("busy")

    tries = [
        copies.retried_or_failed(CONTEXT, TARGET, busy, "busy", None)  # type: ignore[arg-type]
        for _ in range(copies.COPY_ATTEMPTS)
    ]

    assert tries == [1] * (copies.COPY_ATTEMPTS - 1) + ["FAILED"]


def test_a_refusal_fails_the_target_at_once(monkeypatch):
    monkeypatch.setattr(copies, "failed", lambda context, target, error, reason, svc: "FAILED")
    missing = gcs_errors.NotFound("no such bucket")
    outcome = copies.retried_or_failed(CONTEXT, TARGET, missing, "gone", None)  # type: ignore[arg-type]
    assert outcome == "FAILED"


def test_only_a_busy_or_unreachable_provider_is_worth_another_call():
    from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

    def aws(code: str) -> ClientError:
        return ClientError({"Error": {"Code": code, "Message": code}}, "PutObject")

    for error in (
        EndpointConnectionError(endpoint_url="https://s3"),
        ReadTimeoutError(endpoint_url="https://s3"),
        aws("SlowDown"),
        aws("503"),
        gcs_errors.TooManyRequests("busy"),
    ):
        assert copies.transient(error), error
    for error in (aws("AccessDenied"), aws("AccessDeniedException"), gcs_errors.Forbidden("no")):
        assert not copies.transient(error), error


def test_progress_kept_by_an_earlier_release_keeps_its_generations():
    """A promotion resumed across an upgrade: its progress names GCS generations and no
    class; the copy's manifest must still name each object's generation."""
    earlier = {"generation": 1733, "crc32c": "x", "md5": "y", "retain_until": None}
    assert copies.version_of(earlier) == "1733"
    assert copies.version_of({"version": "v-2", "generation": 1}) == "v-2"
    assert copies.version_of({"crc32c": "x"}) is None


def test_a_throttled_kms_call_behind_a_named_error_is_worth_another_call():
    from botocore.exceptions import ClientError

    from shardvault.errors import KeyUnavailable

    def wrapped(code: str) -> KeyUnavailable:
        try:
            raise KeyUnavailable("KMS did not wrap", fix="wait") from ClientError(
                {"Error": {"Code": code, "Message": code}}, "ReEncrypt"
            )
        except KeyUnavailable as error:
            return error

    assert copies.transient(wrapped("ThrottlingException"))
    assert not copies.transient(wrapped("AccessDeniedException"))


RECOVERY = "arn:aws:kms:us-east-1:222233334444:key/0d4e7b52-8c1f-4e3a-9b6d-5f2a1c8e7d34"


def test_an_incremental_goes_under_a_recovery_key_only_where_its_parent_is_too():
    """A chain whose full was copied before the recovery key was set would still need the
    stack's key: its incrementals wait for the next full there."""
    from shardvault.config.targets import AwsTarget, Selection
    from shardvault.contracts.catalog import CopyRecord

    def parent_copied(data_key: str | None) -> SimpleNamespace:
        copy = CopyRecord(state="COPIED", kind="aws", data_key=data_key)
        parent = SimpleNamespace(vault_copies={"b": copy})
        return SimpleNamespace(catalog=SimpleNamespace(get=lambda cluster, backup_id: parent))

    target = AwsTarget.model_validate(
        {
            "name": "b", "kind": "aws", "account": "222233334444", "bucket": "vault-b",
            "region": "us-east-1", "role_arn": "arn:aws:iam::222233334444:role/writer",
            "external_id": "x-1", "kms_key": RECOVERY.replace("0d4e", "6a1f"),
            "storage_class": "GLACIER_IR", "object_lock": {"days": 2}, "select": Selection.ALL,
            "recovery_key": RECOVERY,
        }
    )  # fmt: skip
    record = SimpleNamespace(is_incremental=True, cluster="c", parent_id="f1")
    under_it = copies.skipped_because(target, record, parent_copied(RECOVERY))  # type: ignore[arg-type]
    stacks = "arn:aws:kms:us-east-1:111122223333:key/9f1e"
    for held in (stacks, None):
        reason = copies.skipped_because(target, record, parent_copied(held))  # type: ignore[arg-type]
        assert reason is not None
        assert "not under the recovery key" in reason
        assert "next full" in reason
    assert under_it is None


def test_a_copys_manifest_holds_every_data_key_wrapped_as_the_target_keeps_it():
    """The backup's key and an archived tail's batch keys (each object's own) alike: a
    restore from the copy finds no key under the stack's."""
    from shardvault.contracts.models import (
        Encryption,
        Engine,
        FileEntry,
        Manifest,
        ManifestShard,
        ManifestStream,
        ObjectResult,
        Phase,
    )
    from shardvault.lifecycle.targets import moved_manifest

    def key(name: str) -> Encryption:
        return Encryption(key_id="stack", wrapped_key=name, context={"shardvault:cluster": "c"})

    def obj(index: int, encryption: Encryption | None) -> ObjectResult:
        return ObjectResult(
            key=f"backups/c/b1/s1/{index}", node_id="n1", shard_id="s1", phase=Phase.TAIL,
            index=index, stream_offset=0, length=1, part_size=1, part_count=1, crc64nvme="x",
            verified_by="attributes", encryption=encryption,
        )  # fmt: skip

    stream = ManifestStream(
        phase=Phase.TAIL,
        files=[FileEntry(path="pg_wal/", size=0)],
        objects=[obj(0, None), obj(1, key("batch-1"))],
    )
    manifest = Manifest(
        backup_id="b1", cluster="c", engine=Engine.POSTGRES, started_at=0, completed_at=1,
        checkpoint_skew_seconds=0, part_size=1, bytes=2, objects=2, parts=2, verification="ok",
        shards=[ManifestShard(shard_id="s1", node_id="n1", marker={}, checkpoint_at=0,
                              streams=[stream])],
        encryption=key("chain"),
    )  # fmt: skip

    def wrap(encryption: Encryption) -> Encryption:
        return encryption.model_copy(update={"key_id": RECOVERY})

    moved = moved_manifest(manifest, lambda k: f"copy/{k}", {}, wrap)
    assert moved.encryption is not None
    assert (moved.encryption.key_id, moved.encryption.wrapped_key) == (RECOVERY, "chain")
    objects = moved.shards[0].streams[0].objects
    assert objects[0].encryption is None  # sealed with the backup's own key
    assert objects[1].encryption is not None
    assert objects[1].encryption.key_id == RECOVERY
    assert [o.key for o in objects] == ["copy/backups/c/b1/s1/0", "copy/backups/c/b1/s1/1"]
    assert moved_manifest(manifest, lambda k: k, {}).encryption == manifest.encryption


def test_show_names_the_key_a_copys_data_keys_are_under():
    from shardvault.client.records import copy_cell
    from shardvault.contracts.catalog import CopyRecord

    fields = {
        "state": "COPIED", "kind": "aws", "bucket": "b", "manifest_key": "m.json",
        "storage_class": "DEEP_ARCHIVE", "retention_mode": "COMPLIANCE", "retain_until": "t",
    }  # fmt: skip
    assert copy_cell(CopyRecord(**fields, data_key=RECOVERY)).endswith(
        f"until t, data keys under {RECOVERY}"
    )
    assert copy_cell(CopyRecord(**fields)).endswith("COMPLIANCE until t")  # unsealed, or older
