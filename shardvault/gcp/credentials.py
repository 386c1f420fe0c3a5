"""How the control plane reaches Google Cloud Storage without a long-lived key.

Terms:

- *workload identity federation*: Google's exchange of an AWS role session for a short-lived
  Google token. The function signs an STS ``GetCallerIdentity`` request with its own role's
  session (the *subject token*). Google's STS checks that signature with AWS and returns a
  token for the pool's principal: the role, by its ARN. google-auth does the exchange
  (``google.auth.aws.Credentials``). Nothing secret is configured on either side: the pool's
  *audience* names the pool and its AWS provider.
- *impersonation*: optionally, the federated principal is then exchanged for a service
  account's token (``service_account``), for a bucket granted to that account.
- *emulator*: in the local stack and the tests, the client reaches fake-gcs-server at an
  endpoint with anonymous credentials. Nothing is exchanged.

The grants on the bucket are the federated principal's: a custom role with
``storage.objects.create``, ``get``, ``list``, ``update`` and ``setRetention`` (an upload
that carries a retention needs it) and ``storage.buckets.get``; no ``objects.delete``, so
nothing it wrote can be removed or replaced through it (docs/design/vault-targets.md).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import boto3
from google.auth import aws
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

SUBJECT_TOKEN_TYPE = "urn:ietf:params:aws:token-type:aws4_request"
TOKEN_URL = "https://sts.googleapis.com/v1/token"
VERIFICATION_URL = "https://sts.{region}.amazonaws.com?Action=GetCallerIdentity&Version=2011-06-15"
IMPERSONATION_URL = (
    "https://iamcredentials.googleapis.com/v1/projects/-/serviceAccounts/"
    "{account}:generateAccessToken"
)
SCOPES = ["https://www.googleapis.com/auth/devstorage.read_write"]
CACHE_SECONDS = 300.0  # a Lambda role session lasts hours; botocore refreshes it before expiry


class RoleSessionSupplier(aws.AwsSecurityCredentialsSupplier):  # type: ignore[misc]
    """The function's own role session, as boto3 holds it, for google-auth to sign with. Read
    through botocore (which refreshes it) at most every ``CACHE_SECONDS``: google-auth asks at
    each token exchange."""

    def __init__(self, session: boto3.Session) -> None:
        self.session = session
        self._cached: tuple[float, aws.AwsSecurityCredentials] | None = None
        self._guard = threading.Lock()

    def get_aws_security_credentials(self, context: Any, request: Any) -> Any:
        with self._guard:
            if self._cached is None or time.monotonic() - self._cached[0] > CACHE_SECONDS:
                found = self.session.get_credentials()
                if found is None:
                    raise RuntimeError("no AWS credentials to exchange for a Google token")
                frozen = found.get_frozen_credentials()
                creds = aws.AwsSecurityCredentials(
                    frozen.access_key, frozen.secret_key, frozen.token
                )
                self._cached = (time.monotonic(), creds)
            return self._cached[1]

    def get_aws_region(self, context: Any, request: Any) -> str:
        return str(self.session.region_name)


def federated(
    audience: str, service_account: str | None = None, session: boto3.Session | None = None
) -> aws.Credentials:
    """Credentials that exchange the role session for a Google token: the pool's principal's,
    or ``service_account``'s when given."""
    impersonation = IMPERSONATION_URL.format(account=service_account) if service_account else None
    return aws.Credentials(
        audience=audience,
        subject_token_type=SUBJECT_TOKEN_TYPE,
        token_url=TOKEN_URL,
        aws_security_credentials_supplier=RoleSessionSupplier(session or boto3.Session()),
        service_account_impersonation_url=impersonation,
        scopes=SCOPES,
    )


def client(
    project: str,
    *,
    audience: str | None = None,
    service_account: str | None = None,
    endpoint: str | None = None,
) -> storage.Client:
    """A storage client: through ``endpoint`` with anonymous credentials (the emulator), else
    through workload identity federation for ``audience``."""
    if endpoint is not None:
        return storage.Client(
            project=project,
            credentials=AnonymousCredentials(),
            client_options={"api_endpoint": endpoint},
        )
    if audience is None:
        raise ValueError("a GCS client needs a workload identity audience or an endpoint")
    return storage.Client(project=project, credentials=federated(audience, service_account))
