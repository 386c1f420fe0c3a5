"""The control plane reaches GCS with no long-lived key (``shardvault.gcp.credentials``): the
subject token it hands Google's STS is its own role session's signed GetCallerIdentity, for
the pool's audience, and carries no secret; the exchange is google-auth's."""

from __future__ import annotations

import json
from urllib.parse import unquote

import boto3
import pytest

from shardvault.gcp import credentials

AUDIENCE = (
    "//iam.googleapis.com/projects/123456789/locations/global/"
    "workloadIdentityPools/shardvault/providers/aws"
)
SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


def role_session() -> boto3.Session:
    return boto3.Session(
        aws_access_key_id="ASIAEXAMPLEROLE",
        aws_secret_access_key=SECRET,
        aws_session_token="the-role-session-token",
        region_name="eu-west-1",
    )


def test_the_subject_token_is_the_role_sessions_signed_caller_identity():
    creds = credentials.federated(AUDIENCE, session=role_session())

    token = json.loads(unquote(creds.retrieve_subject_token(None)))

    assert token["url"].startswith("https://sts.eu-west-1.amazonaws.com?Action=GetCallerIdentity")
    assert token["method"] == "POST"
    headers = {h["key"].lower(): h["value"] for h in token["headers"]}
    assert headers["x-goog-cloud-target-resource"] == AUDIENCE
    assert headers["x-amz-security-token"] == "the-role-session-token"
    assert headers["authorization"].startswith("AWS4-HMAC-SHA256 Credential=ASIAEXAMPLEROLE/")
    assert SECRET not in json.dumps(token)  # signed with the key, never carrying it


def test_a_service_account_is_impersonated_only_when_named():
    plain = credentials.federated(AUDIENCE, session=role_session())
    named = credentials.federated(
        AUDIENCE, "vault-writer@acme.iam.gserviceaccount.com", session=role_session()
    )

    assert plain.service_account_email is None
    assert named.service_account_email == "vault-writer@acme.iam.gserviceaccount.com"


def test_the_role_session_is_read_once_per_cache_period(monkeypatch):
    session = role_session()
    reads = []
    real = session.get_credentials
    monkeypatch.setattr(session, "get_credentials", lambda: reads.append(1) or real())
    supplier = credentials.RoleSessionSupplier(session)

    first = supplier.get_aws_security_credentials(None, None)
    second = supplier.get_aws_security_credentials(None, None)

    assert first == second
    assert len(reads) == 1
    assert supplier.get_aws_region(None, None) == "eu-west-1"


def test_a_client_needs_an_audience_or_the_emulators_endpoint():
    local = credentials.client("p", endpoint="http://127.0.0.1:9")
    assert local._connection.API_BASE_URL == "http://127.0.0.1:9"
    with pytest.raises(ValueError, match="audience or an endpoint"):
        credentials.client("p")
