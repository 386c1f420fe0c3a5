"""The README documents every option of the agent's configuration and of the policy file."""

import typing
from pathlib import Path

from pydantic import BaseModel
from shardvault_agent.config import AgentConfig, HookCommands, ShardConfig

from shardvault.config.policy import ClusterPolicy, Policy, fields_table

README = (Path(__file__).parents[2] / "README.md").read_text()


def test_every_agent_option_is_documented_with_its_default():
    for prefix, model in (("", AgentConfig), ("shards[].", ShardConfig), ("hooks.", HookCommands)):
        for name, field in model.model_fields.items():
            row = next(
                (line for line in README.splitlines() if line.startswith(f"| `{prefix}{name}` |")),
                None,
            )
            assert row, f"README lacks the agent option {prefix}{name}"
            if (
                not field.is_required()
                and field.default_factory is None
                and field.default is not None
            ):
                assert f"`{getattr(field.default, 'value', field.default)}`" in row, row


def leaf_fields(model: type[BaseModel], prefix: str) -> typing.Iterator[str]:
    """Dotted paths of the model's fields that hold values (not sub-models)."""
    for name, field in model.model_fields.items():
        args = (field.annotation, *typing.get_args(field.annotation))
        sub = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if sub is None:
            yield f"{prefix}{name}"
        else:
            yield from leaf_fields(sub, f"{prefix}{name}.")


def test_every_policy_field_is_documented():
    paths = ["version", *leaf_fields(ClusterPolicy, "clusters.<name>.")]
    assert "clusters" in Policy.model_fields
    missing = [p for p in paths if f"| `{p}` |" not in README]
    assert not missing, f"README lacks the policy fields {missing}"


def test_the_policy_table_is_the_one_generated_from_the_model():
    """Types, defaults and meanings as the model has them (scripts/policy_table.py)."""
    assert fields_table() in README, (
        "README's policy table differs from the model: paste the output of "
        "'.venv/bin/python scripts/policy_table.py' over it"
    )
