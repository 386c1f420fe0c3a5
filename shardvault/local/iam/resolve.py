"""Resolution: the template's references turned into the local stack's ARNs.

A resource of the template is *placed* on the local stack by its type and the start of its
logical id (CDK writes ``<construct path><hash>``): ``TablesCatalog…`` is the local catalog
table, ``StorageStaging…`` the store's bucket on MinIO *and* the work bucket in moto (on AWS
one bucket holds both, ``backups/`` and ``_work/``), ``StorageVault…`` the vault. A reference
to one of several places becomes one string per place, so a statement names all of them. A
resource with no local counterpart (a log group) resolves to ``unresolved:<id>``, which no
request names.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from shardvault.local.iam.template import as_list

PARTITION = "aws"


@dataclass(frozen=True)
class LocalNames:
    """The names the local stack gave the resources of the template."""

    region: str
    account: str
    store_bucket: str
    work_bucket: str
    vault_bucket: str
    tables: dict[str, str]  # catalog, nodes, inbox
    topic_arn: str
    topic_key_arn: str
    data_key_arn: str
    function_prefix: str  # a function's local name: <prefix><module>

    def function_arn(self, module: str) -> str:
        return (
            f"arn:aws:lambda:{self.region}:{self.account}:function:{self.function_prefix}{module}"
        )

    def role_arn(self, principal: str) -> str:
        """The local ARN of a principal's role (``function:dispatch``, ``agent:node-1``)."""
        return f"arn:aws:iam::{self.account}:role/{principal.replace(':', '-')}"

    def table_arn(self, name: str) -> str:
        return f"arn:aws:dynamodb:{self.region}:{self.account}:table/{name}"


def bucket_arn(name: str) -> str:
    return f"arn:aws:s3:::{name}"


class Resolver:
    def __init__(self, names: LocalNames, resources: dict[str, dict[str, Any]]) -> None:
        self.names = names
        self.resources = resources

    def strings(self, value: Any) -> list[str]:
        """Every string ``value`` may stand for (a ``Fn::Join`` over a reference to a resource
        placed twice stands for two)."""
        if isinstance(value, str):
            return [value]
        if isinstance(value, list):
            return [s for item in value for s in self.strings(item)]
        if "Ref" in value:
            return self.ref(value["Ref"])
        if "Fn::GetAtt" in value:
            logical_id, attribute = as_list(value["Fn::GetAtt"])
            return self.attribute(logical_id, attribute)
        if "Fn::Join" in value:
            separator, parts = value["Fn::Join"]
            choices = [self.strings(part) for part in parts]
            return [separator.join(combination) for combination in itertools.product(*choices)]
        raise ValueError(f"the local stack cannot resolve {value!r}")

    def statement(self, statement: dict[str, Any]) -> dict[str, Any]:
        """The statement with its references resolved, everywhere they appear."""
        return {key: self.element(value) for key, value in statement.items()}

    def element(self, value: Any) -> Any:
        if isinstance(value, dict) and not ({"Ref", "Fn::GetAtt", "Fn::Join"} & set(value)):
            return {key: self.element(item) for key, item in value.items()}
        if isinstance(value, (dict, list)):
            return self.strings(value)
        return value

    def ref(self, name: str) -> list[str]:
        pseudo = {
            "AWS::Partition": PARTITION,
            "AWS::Region": self.names.region,
            "AWS::AccountId": self.names.account,
        }
        if name in pseudo:
            return [pseudo[name]]
        kind = self.resources.get(name, {}).get("type")
        if kind == "AWS::SNS::Topic":
            return [self.names.topic_arn]
        if kind == "AWS::S3::Bucket":
            return [arn.removeprefix("arn:aws:s3:::") for arn in self.arns(name)]
        return self.arns(name)

    def attribute(self, logical_id: str, attribute: str) -> list[str]:
        if attribute != "Arn":
            raise ValueError(f"the local stack cannot resolve {logical_id}.{attribute}")
        return self.arns(logical_id)

    def arns(self, logical_id: str) -> list[str]:
        """The local ARNs of a template resource (``unresolved:<id>`` when it has none)."""
        names, entry = self.names, self.resources.get(logical_id, {})
        kind = entry.get("type")
        if kind == "AWS::S3::Bucket":
            if logical_id.startswith("StorageVault"):
                return [bucket_arn(names.vault_bucket)]
            if logical_id.startswith("StorageStaging"):
                return [bucket_arn(names.store_bucket), bucket_arn(names.work_bucket)]
        if kind == "AWS::DynamoDB::Table":
            for role, name in names.tables.items():
                if logical_id.lower().startswith(f"tables{role}"):
                    return [names.table_arn(name)]
        if kind == "AWS::KMS::Key":
            if logical_id.startswith("DataKey"):
                return [names.data_key_arn]
            if logical_id.startswith("NotificationsTopicKey"):
                return [names.topic_key_arn]
        if kind == "AWS::SNS::Topic":
            return [names.topic_arn]
        if kind == "AWS::Lambda::Function":
            return [names.function_arn(entry["module"])]
        if kind == "AWS::IAM::Role" and "module" in entry:
            return [names.role_arn(f"function:{entry['module']}")]
        return [f"unresolved:{logical_id}"]
