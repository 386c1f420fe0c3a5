"""The README documents every option of the agent's configuration."""

from pathlib import Path

from shardvault_agent.config import AgentConfig, ShardConfig

README = (Path(__file__).parents[2] / "README.md").read_text()


def test_every_agent_option_is_documented_with_its_default():
    for prefix, model in (("", AgentConfig), ("shards[].", ShardConfig)):
        for name, field in model.model_fields.items():
            row = next(
                (line for line in README.splitlines() if line.startswith(f"| `{prefix}{name}` |")),
                None,
            )
            assert row, f"README lacks the agent option {prefix}{name}"
            if not field.is_required() and field.default is not None:
                assert f"`{getattr(field.default, 'value', field.default)}`" in row, row
