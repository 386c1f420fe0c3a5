"""The gate: every call of a function or an agent on the local stack, authorized as AWS would.

*Functions* run in the local stack's process; the gate binds each of their clients
(:meth:`Gate.bind`) to the function's principal with two botocore hooks:

- ``before-parameter-build``, after boto3's own (DynamoDB values typed as on the wire): the
  call's requests are evaluated and a refused one raises ``AccessDenied`` before anything is
  sent. ``generate_presigned_url`` emits the same event, so a URL is refused at signing when
  its signer may not make the call: S3 authorizes a presigned request as its signer.
- ``after-call`` for S3: a read of a key that is not there (or a copy of a source that is not)
  answers 404 only to a caller that may list the bucket (``s3:ListBucket``, its ``s3:prefix``
  the key), else **403 AccessDenied**, as S3 does (MinIO and moto always answer 404); and
  HeadObject and GetObject show an object's lock only to a caller that may read it
  (``s3:GetObjectRetention``).

*Agents* and the *CLI* run in their own processes and reach moto's server over HTTP;
:meth:`Gate.wsgi` wraps that server and evaluates each request signed with an agent's access
key (one per node, :meth:`Gate.agent_key`, tagged with the node's id and cluster as its role
would be) or the operator's (:meth:`Gate.operator_key`, the key ``stack.env`` gives the CLI).
Requests signed with another key (the harness's, a presigned URL's) pass as before.

*Other accounts* (an aws vault copy's account B, :meth:`Gate.add_account`) bring their own
roles (a trust policy and permissions each), buckets (a bucket policy each) and KMS keys (a
key policy each: a copy's recovery key). A function's
``sts:AssumeRole`` of such a role is allowed only when its own grants and the role's trust
policy both allow it (the external ID included); the client made with the session's keys is
bound to the role (:meth:`Gate.assumed`), whose calls B's bucket policy judges too. A request
of one account on another's resource needs the resource policy's Allow as well (IAM's
cross-account rule).

Every verdict is *recorded* (principal, action, resource, which statements allowed it), so a
test can hold the calls made against the grants both ways (``used_statements``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import itertools
import json
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote

from botocore.exceptions import ClientError

from shardvault.local.iam.evaluate import Verdict, as_list, evaluate
from shardvault.local.iam.requests import (
    Request,
    UnmappedCall,
    Where,
    copy_source,
    requests_of,
)
from shardvault.local.iam.resolve import LocalNames, Resolver
from shardvault.local.iam.template import AGENT, FUNCTION, OPERATOR

ROLE = "role:"  # a principal of another account's role: role:<ARN>
TAG_VARIABLE = re.compile(r"\$\{aws:PrincipalTag/([^}]+)\}")
NODE_ID_TAG = "shardvault:node_id"
CLUSTER_TAG = "shardvault:cluster"
# What the local stack's loopback cannot be but AWS always is (the buckets refuse plain HTTP).
TRANSPORT = {"aws:SecureTransport": ["true"], "s3:TlsVersion": ["1.3"]}
READS_OF_A_KEY = {"GetObject", "HeadObject", "GetObjectAttributes", "GetObjectRetention"}
MISSING = ("404", "NoSuchKey", "NotFound")
COPIES = {"CopyObject", "UploadPartCopy"}  # a missing source: 404 or 403 as for a read
# What HeadObject and GetObject answer of a lock only to a caller with the action.
LOCK_FIELDS = {
    "s3:GetObjectRetention": {"ObjectLockMode", "ObjectLockRetainUntilDate"},
    "s3:GetObjectLegalHold": {"ObjectLockLegalHoldStatus"},
}


@dataclass(frozen=True)
class Principal:
    name: str  # function:<module>, agent:<node id>, role:<ARN> (a role of another account)
    arn: str
    statements: tuple[dict[str, Any], ...]
    tags: tuple[tuple[str, str], ...] = ()

    @property
    def account(self) -> str:
        return account_of(self.arn)

    def context(self) -> dict[str, list[str]]:
        return {
            "aws:PrincipalArn": [self.arn],
            **{f"aws:PrincipalTag/{k}": [v] for k, v in self.tags},
            **TRANSPORT,
        }


@dataclass(frozen=True)
class Record:
    principal: str
    action: str
    resource: str
    allowed: bool
    statements: tuple[int, ...] = ()
    expected: bool = False  # a refusal a test asked for (Gate.expecting_refusals)


@dataclass
class Recorder:
    """What the verdicts add up to, kept as they come (a long-running stack keeps a set per
    grants holder, not every call)."""

    used: dict[str, set[tuple[int, str]]] = field(default_factory=dict)
    refused: set[tuple[str, str, str]] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, record: Record) -> None:
        holder = holder_of(record.principal)
        with self.lock:
            if not record.allowed and not record.expected:
                self.refused.add((holder, record.action, record.resource))
            pairs = self.used.setdefault(holder, set())
            pairs.update((index, record.action) for index in record.statements)

    def summary(self) -> dict[str, Any]:
        """Per grants holder (``function:<module>``, ``agent``, ``operator``): the (statement,
        action) pairs that allowed a call, and the calls refused that no test asked for."""
        with self.lock:
            return {
                "used": {holder: sorted(pairs) for holder, pairs in self.used.items()},
                "denied": sorted(self.refused),
            }

    def dump(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.summary(), indent=1))


def with_tags(value: Any, tags: dict[str, str]) -> Any:
    """``value`` with ``${aws:PrincipalTag/…}`` replaced by the principal's tags (a missing
    tag stays, and then matches nothing, as on AWS)."""
    if isinstance(value, str):
        return TAG_VARIABLE.sub(lambda m: tags.get(m.group(1), m.group(0)), value)
    if isinstance(value, list):
        return [with_tags(v, tags) for v in value]
    if isinstance(value, dict):
        return {k: with_tags(v, tags) for k, v in value.items()}
    return value


def access_denied(principal: Principal, request: Request, operation: str, why: str) -> ClientError:
    code = "AccessDenied" if request.action.startswith("s3:") else "AccessDeniedException"
    message = (
        f"User: {principal.arn} is not authorized to perform: {request.action} on resource: "
        f"{request.resource} because {why}"
    )
    return ClientError(
        {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": 403}},
        operation,
    )


class Gate:
    def __init__(self, document: dict[str, Any], names: LocalNames, where: Where) -> None:
        resolver = Resolver(names, document["resources"])
        self.names, self.where = names, where
        self.grants = {
            name: [resolver.statement(s) for s in statements]
            for name, statements in document["principals"].items()
        }
        self.bucket_policies: dict[str, list[dict[str, Any]]] = {}
        for logical_id, statements in document["bucket_policies"].items():
            for arn in resolver.arns(logical_id):
                resolved = [resolver.statement(s) for s in statements]
                self.bucket_policies[arn.removeprefix("arn:aws:s3:::")] = resolved
        self.bucket_accounts: dict[str, str] = {}  # another account's buckets -> the account
        self.trust_policies: dict[str, list[dict[str, Any]]] = {}  # role ARN -> who may assume
        self.key_policies: dict[str, list[dict[str, Any]]] = {}  # another account's KMS keys
        self.recorder = Recorder()
        self.principals: dict[str, Principal] = {}  # by name, as bound clients look them up
        self.keys: dict[str, str] = {}  # access key -> the principal it signs for
        self._keys = itertools.count(1)
        self._expecting = 0

    # --- principals ----------------------------------------------------------------------------
    def principal(self, name: str, tags: dict[str, str] | None = None) -> Principal:
        holder = holder_of(name)
        if holder not in self.grants:
            raise KeyError(f"the template grants nothing to {name!r}")
        tags = tags or {}
        statements = tuple(with_tags(self.grants[holder], tags))
        principal = Principal(
            name, self.names.role_arn(name), statements, tuple(sorted(tags.items()))
        )
        self.principals[name] = principal
        return principal

    def add_account(
        self,
        roles: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]],
        buckets: dict[str, list[dict[str, Any]]],
        keys: dict[str, list[dict[str, Any]]] | None = None,
    ) -> None:
        """Another account's ``roles`` (ARN -> its trust policy's and its permissions'
        statements), ``buckets`` (name -> its bucket policy's statements; versioned, as
        Object Lock keeps them) and KMS ``keys`` (ARN -> its key policy's statements)."""
        self.key_policies.update(keys or {})
        for arn, (trust, permissions) in roles.items():
            self.trust_policies[arn] = trust
            self.grants[f"{ROLE}{arn}"] = permissions
            self.assumed(arn)  # clients bound to the role already judge by these now
        for bucket, statements in buckets.items():
            self.bucket_policies[bucket] = statements
            self.bucket_accounts[bucket] = account_of_buckets(roles)
        versioned = self.where.versioned_buckets | frozenset(buckets)
        self.where = dataclasses.replace(self.where, versioned_buckets=versioned)

    def assumed(self, role_arn: str) -> Principal:
        """The principal of a session of another account's role (a client made with the keys
        its ``AssumeRole`` returned)."""
        name = f"{ROLE}{role_arn}"
        if name not in self.grants:
            raise KeyError(f"the local stack knows no role {role_arn!r} of another account")
        principal = Principal(name, role_arn, tuple(self.grants[name]))
        self.principals[name] = principal
        return principal

    def function(self, module: str) -> Principal:
        return self.principal(f"{FUNCTION}{module}")

    def agent_key(self, node_id: str, cluster: str) -> str:
        """A new access key for a node's agent, tagged as the node's role is."""
        key = f"AKIASHARDVAULTAGENT{next(self._keys):04d}"
        tags = {NODE_ID_TAG: node_id, CLUSTER_TAG: cluster}
        self.keys[key] = self.principal(f"{AGENT}:{node_id}", tags).name
        return key

    def operator_key(self, grants: str = OPERATOR) -> str:
        """The access key of an operator with ``grants`` (the CLI's managed policy)."""
        key = f"AKIASHARDVAULT{grants.upper().replace('-', '')}"
        self.keys[key] = self.principal(grants).name
        return key

    @contextlib.contextmanager
    def expecting_refusals(self) -> Iterator[None]:
        """Refusals while the block runs are a test's, not the product's: the record keeps
        them apart (``SHARDVAULT_IAM_RECORD``'s report fails on any other)."""
        self._expecting += 1
        try:
            yield
        finally:
            self._expecting -= 1

    @contextlib.contextmanager
    def withdrawn(self, holder: str, action: str) -> Iterator[None]:
        """``action`` taken out of every statement of ``holder`` (``function:<module>`` or
        ``agent``) while the block runs, as a template without that grant would deploy."""
        kept = self.grants[holder]
        self.grants[holder] = [without_action(s, action) for s in kept]
        self._rebuild(holder)
        try:
            with self.expecting_refusals():
                yield
        finally:
            self.grants[holder] = kept
            self._rebuild(holder)

    def _rebuild(self, holder: str) -> None:
        for name, principal in list(self.principals.items()):
            if holder_of(name) == holder:
                self.principal(name, dict(principal.tags))

    # --- evaluation ----------------------------------------------------------------------------
    def verdict(self, principal: Principal, request: Request, *, probe: bool = False) -> Verdict:
        """``probe``: S3 asking itself whether the caller may list (403 or 404), not a call:
        recorded when it allows (the grant is used), never as a refusal."""
        request = Request(request.action, request.resource, principal.context() | request.context)
        resource_policy, owner = self.resource_policy(request.resource)
        verdict = evaluate(
            list(principal.statements),
            resource_policy,
            request,
            principal.arn,
            # A role's trust policy decides every AssumeRole, within one account too.
            cross_account=owner != principal.account or request.action == "sts:AssumeRole",
        )
        if probe and not verdict.allowed:
            return verdict
        self.recorder.add(
            Record(
                principal.name,
                request.action,
                request.resource,
                verdict.allowed,
                verdict.allowed_by,
                expected=self._expecting > 0,
            )
        )
        return verdict

    def resource_policy(self, resource: str) -> tuple[list[dict[str, Any]], str]:
        """The resource's own policy (a bucket's, a role's trust policy) and its account."""
        bucket = bucket_of(resource)
        if bucket is not None:
            owner = self.bucket_accounts.get(bucket, self.names.account)
            return self.bucket_policies.get(bucket, []), owner
        if resource in self.trust_policies:
            return self.trust_policies[resource], account_of(resource)
        if resource in self.key_policies:
            return self.key_policies[resource], account_of(resource)
        return [], account_of(resource) or self.names.account

    def authorize(self, principal: Principal, service: str, operation: str, params: dict) -> None:
        """Raises ``AccessDenied`` (a botocore ``ClientError``) for a call AWS would refuse."""
        for request in requests_of(service, operation, params, self.where):
            verdict = self.verdict(principal, request)
            if not verdict.allowed:
                if verdict.denied_by:
                    why = f"an explicit deny in a {verdict.denied_by}-based policy"
                elif verdict.no_resource_allow:
                    why = (
                        f"no resource-based policy allows the {request.action} action to "
                        "a principal of another account"
                    )
                else:
                    why = f"no identity-based policy allows the {request.action} action"
                raise access_denied(principal, request, operation, why)

    # --- clients of a function ------------------------------------------------------------------
    def bind(self, client: Any, principal: Principal, role_arn: str | None = None) -> Any:
        """Has ``client`` (a boto3 client) make its calls as ``principal`` (looked up by name
        at each call: ``withdrawn`` reaches clients already made), or as another account's
        role ``role_arn`` when it was made with that role's session (``Services.assumed_s3``:
        the session came from an ``AssumeRole`` the gate allowed ``principal``)."""
        if role_arn is not None:
            principal = self.assumed(role_arn)
        model = client.meta.service_model
        service_id, service = model.service_id.hyphenize(), model.service_name
        events = client.meta.events
        events.register_last(
            f"before-parameter-build.{service_id}",
            functools.partial(self._before, principal.name, service),
        )
        if service == "s3":
            events.register_last(
                f"after-call.{service_id}", functools.partial(self._after_s3, principal.name)
            )
        return client

    def _before(
        self, name: str, service: str, params: dict, model: Any, context: dict, **_: Any
    ) -> None:
        self.authorize(self.principals[name], service, model.name, params)
        context["shardvault_iam_params"] = params

    def _after_s3(
        self, name: str, http_response: Any, parsed: dict, model: Any, context: dict, **_: Any
    ) -> None:
        principal = self.principals[name]
        code = parsed.get("Error", {}).get("Code")
        params = context.get("shardvault_iam_params", {})
        if model.name in ("HeadObject", "GetObject") and code is None:
            self._hide_lock(principal, params, parsed)
            return
        if code not in MISSING or model.name not in {*READS_OF_A_KEY, *COPIES}:
            return
        bucket, key = params.get("Bucket", ""), params.get("Key", "")
        if model.name in COPIES:  # the missing key is the copy's source
            bucket, key, _ = copy_source(params.get("CopySource", ""))
        listing = Request("s3:ListBucket", f"arn:aws:s3:::{bucket}", {"s3:prefix": [key]})
        if self.verdict(principal, listing, probe=True).allowed:
            return
        parsed["Error"] = {
            "Code": "403" if model.name == "HeadObject" else "AccessDenied",
            "Message": "Access Denied",
        }
        parsed.setdefault("ResponseMetadata", {})["HTTPStatusCode"] = 403
        http_response.status_code = 403

    def _hide_lock(self, principal: Principal, params: dict, parsed: dict) -> None:
        """S3 shows an object's lock in HeadObject and GetObject only to a caller that may read
        it (``s3:GetObjectRetention``, ``s3:GetObjectLegalHold``)."""
        target = f"arn:aws:s3:::{params.get('Bucket', '')}/{params.get('Key', '')}"
        for action, fields in LOCK_FIELDS.items():
            if (
                fields & set(parsed)
                and not self.verdict(principal, Request(action, target), probe=True).allowed
            ):
                for field in fields:
                    parsed.pop(field, None)

    # --- agents over HTTP -----------------------------------------------------------------------
    def wsgi(self, app: Callable) -> Callable:
        """``app`` (moto's server) with agents' requests authorized first."""

        def gated(environ: dict, start_response: Callable) -> Iterable[bytes]:
            name = self.keys.get(access_key(environ))
            if name is None:
                return app(environ, start_response)
            principal = self.principals[name]
            body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
            environ["wsgi.input"] = io.BytesIO(body)
            service, operation, params = decode_call(environ, body)
            try:
                self.authorize(principal, service, operation, params)
            except ClientError as error:
                return refuse(start_response, service, error)
            except UnmappedCall as unmapped:  # refused, never let through unexamined
                refused = access_denied(
                    principal,
                    Request(str(unmapped), "*"),
                    operation,
                    "the local stack's IAM model does not know this call (requests.py)",
                )
                return refuse(start_response, service, refused)
            return app(environ, start_response)

        return gated


def account_of(arn: str) -> str:
    """The account an ARN names (S3's name none: ``""``)."""
    parts = arn.split(":")
    return parts[4] if len(parts) > 5 else ""


def account_of_buckets(roles: dict[str, Any]) -> str:
    """The account whose roles come with the buckets (one account per ``add_account``)."""
    accounts = {account_of(arn) for arn in roles}
    if len(accounts) != 1:
        raise ValueError(f"add_account takes one account's roles, not {sorted(accounts)}")
    return accounts.pop()


def holder_of(name: str) -> str:
    """Whose grants a principal has: every agent has the agents' policy."""
    return AGENT if name.startswith(f"{AGENT}:") else name


def without_action(statement: dict[str, Any], action: str) -> dict[str, Any]:
    actions = [a for a in as_list(statement.get("Action", [])) if a != action]
    if "Action" not in statement or actions:
        return {**statement, "Action": actions} if "Action" in statement else statement
    return {**statement, "Action": ["shardvault:withdrawn"]}


def bucket_of(resource: str) -> str | None:
    if not resource.startswith("arn:aws:s3:::"):
        return None
    return resource.removeprefix("arn:aws:s3:::").split("/", 1)[0]


def access_key(environ: dict) -> str:
    authorization = environ.get("HTTP_AUTHORIZATION", "")
    match = re.search(r"Credential=([^/,\s]+)/", authorization)
    return match.group(1) if match else ""


def credential_service(environ: dict) -> str:
    match = re.search(
        r"Credential=[^/]+/[^/]+/[^/]+/([^/]+)/", environ.get("HTTP_AUTHORIZATION", "")
    )
    return match.group(1) if match else ""


def decode_call(environ: dict, body: bytes) -> tuple[str, str, dict[str, Any]]:
    """(service, operation, parameters) of a request as botocore sends it: a JSON protocol
    (``X-Amz-Target``), Lambda's REST path, or the query protocol's form."""
    service = credential_service(environ)
    target = environ.get("HTTP_X_AMZ_TARGET")
    if target:
        return service, target.rsplit(".", 1)[-1], json.loads(body or b"{}")
    path = unquote(environ.get("PATH_INFO", ""))
    if service == "lambda" and "/functions/" in path:
        name = path.split("/functions/", 1)[1].split("/", 1)[0]
        return service, "Invoke", {"FunctionName": name}
    form = {k: v[0] for k, v in parse_qs(body.decode(errors="replace")).items()}
    return service, form.pop("Action", f"{environ.get('REQUEST_METHOD')} {path}"), form


def refuse(start_response: Callable, service: str, error: ClientError) -> list[bytes]:
    message = error.response["Error"]["Message"]
    status = "403 Forbidden" if service in ("lambda", "cloudformation") else "400 Bad Request"
    body = json.dumps({"__type": "AccessDeniedException", "message": message}).encode()
    if service == "cloudformation":
        body = (
            "<ErrorResponse><Error><Type>Sender</Type><Code>AccessDenied</Code>"
            f"<Message>{message}</Message></Error></ErrorResponse>"
        ).encode()
    start_response(
        status, [("Content-Type", "application/x-amz-json-1.0"), ("Content-Length", str(len(body)))]
    )
    return [body]


def load_gate(
    names: LocalNames, *, key_aliases: dict[str, str], document: dict | None = None
) -> Gate:
    """The gate of the local stack named ``names``, enforcing ``grants.json`` (or
    ``document``, a grants document: a test's template with a grant removed)."""
    from shardvault.local.iam.template import GRANTS_FILE

    document = document or json.loads(GRANTS_FILE.read_text())
    resolver = Resolver(names, document["resources"])
    partition_keys = {
        arn.rsplit("/", 1)[-1]: entry["partition_key"]
        for logical_id, entry in document["resources"].items()
        if "partition_key" in entry
        for arn in resolver.arns(logical_id)
    }
    where = Where(
        region=names.region,
        account=names.account,
        versioned_buckets=frozenset({names.vault_bucket}),
        partition_keys=partition_keys,
        key_aliases=key_aliases,
        topic_keys={names.topic_arn: names.topic_key_arn},
    )
    return Gate(document, names, where)
