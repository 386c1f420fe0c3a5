"""Where moto answers differently from AWS in a way the local stack would notice, mended.

- *Item writes are atomic.* DynamoDB applies each write to an item whole (an ``ADD`` of a
  counter, a conditional put that takes a lock), whoever else writes the item meanwhile.
  moto's backend reads, changes and stores the item in Python with no lock, so two threads
  writing one item at once can lose one write: a restore's progress counter (every download's
  ``ADD`` lands on the restore's one catalog item, eight at a time) came out at half its total
  on a loaded machine. A read sees no item half written either; moto's ``Query`` walked an
  item's attributes while another thread's write changed them and failed ("dictionary
  changed size during iteration"). :func:`install` serializes moto's DynamoDB requests, each
  whole from parsing to its answer (a transaction's writes with it), in this process, where
  the local stack's Lambdas and its moto server (the agents' requests) both run.
- *Nested executions speak AWS's field names.* A ``states:startExecution.sync:2`` task (the
  drill starts a restore) passes ``StateMachineArn``, ``Name`` and ``Input`` and reads back
  ``ExecutionArn``, ``Output``, ``StartDate`` (milliseconds since the epoch)... as AWS names
  them. moto's interpreter hands the ASL's names to boto3 as they are (which wants
  ``stateMachineArn``: the task failed with ``KeyError``) and returns boto3's names and
  ``datetime`` objects. :func:`install` renames both ways.
- *A Distributed Map run fails as a whole.* On AWS a run whose failed children exceed its
  tolerated failures (none unless the ASL says so) fails with
  ``States.ExceedToleratedFailureThreshold``, a cause that names no child, and the state's
  Catch sees only that. moto's run succeeds with the failed children's outputs left out, so a
  workflow that worked here could lose its failure's name on AWS. :func:`install` fails the
  run as AWS does, once its children are done.
- *A lock holds.* S3 refuses to shorten a locked version's retention (or to weaken its mode):
  COMPLIANCE never, GOVERNANCE only with ``x-amz-bypass-governance-retention``. moto set any
  retention asked, after which the version could be deleted: the vault's promise could be
  undone locally by anyone with the store's credentials. :func:`install` refuses as S3 does.
- *A key of another account is used by its ARN.* KMS re-encrypts from a key of one account
  to a key of another (a vault copy's recovery key, ``shardvault.aws.keys``), each key's
  policy permitting (the gate judges that). moto looks both keys up in the caller's account
  only, and answers that the other account's does not exist. :func:`install` decrypts with
  the account that holds the ciphertext's key and encrypts with the one the destination's ARN
  names, as the one call does on AWS.
"""

from __future__ import annotations

import base64
import datetime
import functools
import threading
from typing import Any


@functools.cache  # once per process: a second call would wrap the wrappers
def install() -> None:
    from moto.dynamodb.responses import DynamoHandler

    # Every DynamoDB request reaches moto's backend through its handler's call_action (over
    # HTTP, in-process or under mock_aws): one lock there covers reads and writes.
    DynamoHandler.call_action = _serialized(DynamoHandler.call_action, threading.Lock())
    _name_nested_executions_as_aws()
    _fail_map_runs_as_aws()
    _hold_locks_as_s3()
    _reencrypt_across_accounts()


def _hold_locks_as_s3() -> None:
    from moto.s3.exceptions import AccessDeniedByLock
    from moto.s3.responses import S3Response

    put = S3Response.put_object_retention

    def put_object_retention(self: Any) -> Any:
        key = self.backend.get_object(
            self.bucket_name, self.parse_key_name(), version_id=self._get_param("versionId")
        )
        mode, until = self._mode_until_from_body()
        bypass = self.headers.get("x-amz-bypass-governance-retention", "").lower() == "true"
        if key is not None and weakens(key, mode, until, bypass):
            raise AccessDeniedByLock
        return put(self)

    S3Response.put_object_retention = put_object_retention


def weakens(key: Any, mode: str | None, until: str | None, bypass: bool) -> bool:
    """Whether setting (``mode``, ``until``) on a version under retention shortens or weakens
    it in a way S3 refuses (GOVERNANCE may be, with the bypass header; COMPLIANCE never)."""
    if key.lock_mode not in ("GOVERNANCE", "COMPLIANCE") or not key.lock_until:
        return False
    now = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
    if lock_time(key.lock_until) <= now:
        return False  # its retention is over: anything goes
    shorter = until is None or lock_time(until) < lock_time(key.lock_until)
    weaker_mode = key.lock_mode == "COMPLIANCE" and mode != "COMPLIANCE"
    if not (shorter or weaker_mode):
        return False
    return key.lock_mode == "COMPLIANCE" or not bypass


def lock_time(value: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).replace(tzinfo=None)


MAP_RUN_FAILED = "The specified tolerated failure threshold was exceeded."


def _fail_map_runs_as_aws() -> None:
    from moto.stepfunctions.parser.api import ExecutionFailedEventDetails, HistoryEventType
    from moto.stepfunctions.parser.asl.component.common.error_name.failure_event import (
        FailureEvent,
        FailureEventException,
    )
    from moto.stepfunctions.parser.asl.component.common.error_name.states_error_name import (
        StatesErrorName,
    )
    from moto.stepfunctions.parser.asl.component.common.error_name.states_error_name_type import (
        StatesErrorNameType,
    )
    from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration import (
        distributed_iteration_component as distributed,
    )
    from moto.stepfunctions.parser.asl.eval.event.event_detail import EventDetails

    component = distributed.DistributedIterationComponent
    run = component._map_run
    name = StatesErrorNameType.StatesExceedToleratedFailureThreshold

    def map_run(self: Any, env: Any, eval_input: Any) -> None:
        run(self, env, eval_input)
        if not env.is_running():  # stopped (StopExecution): the run ends with the execution
            return
        items = eval_input.map_run_record.item_counter
        failed, total = items.failed.get() + items.timed_out.get(), items.total.get()
        if not exceeds(failed, total, eval_input):
            return
        env.stack.pop()  # the outputs of the children that succeeded
        details = ExecutionFailedEventDetails(error=name.to_name(), cause=MAP_RUN_FAILED)
        raise FailureEventException(
            failure_event=FailureEvent(
                env=env,
                error_name=StatesErrorName(typ=name),
                event_type=HistoryEventType.ExecutionFailed,
                event_details=EventDetails(executionFailedEventDetails=details),
            )
        )

    component._map_run = map_run


def exceeds(failed: int, total: int, eval_input: Any) -> bool:
    """Whether ``failed`` of ``total`` children exceed the Map's tolerated failures: each
    threshold the ASL sets (count, percentage) when it sets one, else any failure."""
    count, percentage = eval_input.tolerated_failure_count, eval_input.tolerated_failure_percentage
    over = []
    if count > 0:
        over.append(failed > count)
    if percentage > 0:
        over.append(bool(total) and 100 * failed / total > percentage)
    return any(over) if over else failed > 0


def _name_nested_executions_as_aws() -> None:
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import (
        state_task_service_sfn as sfn,
    )

    service = sfn.StateTaskServiceSfn
    to_boto = service._normalise_parameters

    def normalise_parameters(self: Any, parameters: dict, *args: Any, **kwargs: Any) -> None:
        to_boto(self, parameters, *args, **kwargs)  # serializes Input, as AWS does
        for key in list(parameters):
            parameters[key[:1].lower() + key[1:]] = parameters.pop(key)

    def normalise_response(self: Any, response: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(response, dict):
            for key in list(response):
                value = response.pop(key)
                if isinstance(value, datetime.datetime):
                    value = int(value.timestamp() * 1000)
                response[key[:1].upper() + key[1:]] = value

    service._normalise_parameters = normalise_parameters
    service._normalise_response = normalise_response


def _serialized(call: Any, lock: threading.Lock) -> Any:
    @functools.wraps(call)
    def serialized(*args: Any, **kwargs: Any) -> Any:
        with lock:
            return call(*args, **kwargs)

    return serialized


def _reencrypt_across_accounts() -> None:
    import json

    from moto.kms.exceptions import NotFoundException
    from moto.kms.models import KmsBackend, kms_backends
    from moto.kms.responses import KmsResponse
    from moto.kms.utils import _deserialize_ciphertext_blob

    original = KmsResponse.re_encrypt

    def holder(key_id: str, region: str) -> KmsBackend | None:
        """The backend of the account holding key ``key_id`` in ``region``."""
        for account in list(kms_backends.keys()):
            backend = kms_backends[account][region]
            if key_id in backend.keys:
                return backend
        return None

    def re_encrypt(self: KmsResponse) -> str:
        destination = self._get_param("DestinationKeyId")
        blob = self._get_param("CiphertextBlob")
        source_key = _deserialize_ciphertext_blob(blob).key_id
        parts = destination.split(":")
        other = destination.startswith("arn:") and parts[4] != self.current_account
        if not other and source_key in self.kms_backend.keys:
            return original(self)  # one account: moto's own
        source = holder(source_key, self.region)
        target = kms_backends[parts[4]][self.region] if other else self.kms_backend
        target_key = target.get_key_id(destination)
        if source is None or target_key not in target.keys:
            raise NotFoundException(f"Key '{destination}' does not exist")
        plaintext, decrypting_arn = source.decrypt(
            ciphertext_blob=blob,
            encryption_context=self._get_param("SourceEncryptionContext", {}),
        )
        new_blob, encrypting_arn = target.encrypt(
            key_id=target_key,
            plaintext=plaintext,
            encryption_context=self._get_param("DestinationEncryptionContext", {}),
        )
        return json.dumps(
            {
                "CiphertextBlob": base64.b64encode(new_blob).decode("utf-8"),
                "KeyId": encrypting_arn,
                "SourceKeyId": decrypting_arn,
            }
        )

    KmsResponse.re_encrypt = re_encrypt  # type: ignore[method-assign]
