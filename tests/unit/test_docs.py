"""The documentation: the reference documents every option of the agent's configuration and
of the policy file, the README stays short, and no relative link in it or in docs/ is broken."""

import re
import typing
from pathlib import Path

from pydantic import BaseModel
from shardvault_agent.config import AgentConfig, HookCommands, ShardConfig

from shardvault.config.policy import ClusterPolicy, Policy, fields_table

ROOT = Path(__file__).parents[2]
AGENT_REFERENCE = ROOT / "docs" / "reference" / "agent-config.md"
POLICY_REFERENCE = ROOT / "docs" / "reference" / "policy.md"
README_MAX_LINES = 250


def test_every_agent_option_is_documented_with_its_default():
    text = AGENT_REFERENCE.read_text()
    for prefix, model in (("", AgentConfig), ("shards[].", ShardConfig), ("hooks.", HookCommands)):
        for name, field in model.model_fields.items():
            row = next(
                (line for line in text.splitlines() if line.startswith(f"| `{prefix}{name}` |")),
                None,
            )
            assert row, f"docs/reference/agent-config.md lacks the agent option {prefix}{name}"
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
        listed = typing.get_origin(field.annotation) is list and sub is not None
        if sub is None:
            yield f"{prefix}{name}"
        else:
            yield from leaf_fields(sub, f"{prefix}{name}{'[]' if listed else ''}.")


def test_every_policy_field_is_documented():
    text = POLICY_REFERENCE.read_text()
    paths = ["version", *leaf_fields(ClusterPolicy, "clusters.<name>.")]
    assert "clusters" in Policy.model_fields
    missing = [p for p in paths if f"| `{p}` |" not in text]
    assert not missing, f"docs/reference/policy.md lacks the policy fields {missing}"


def test_the_policy_table_is_the_one_generated_from_the_model():
    """Types, defaults and meanings as the model has them (scripts/policy_table.py)."""
    assert fields_table() in POLICY_REFERENCE.read_text(), (
        "docs/reference/policy.md's policy table differs from the model: paste the output of "
        "'.venv/bin/python scripts/policy_table.py' over it"
    )


def test_the_readme_stays_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines < README_MAX_LINES, (
        f"README.md has {lines} lines (fewer than {README_MAX_LINES} wanted): move the detail "
        "into the user guide (docs/guide/) or the reference (docs/reference/) and link to it"
    )


FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
# [text](target) and [text](target "title"); images too. Reference-style definitions: [id]: target
INLINE_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
LINK_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # https:, mailto:, ...


def relative_links(markdown: str) -> list[str]:
    """The relative link targets of a Markdown text (code blocks and spans left out), without
    their #anchor."""
    text = CODE_SPAN.sub("", FENCE.sub("", markdown))
    targets = INLINE_LINK.findall(text) + LINK_DEFINITION.findall(text)
    found = []
    for target in targets:
        path = target.split("#", 1)[0]
        if path and not EXTERNAL.match(target) and not target.startswith("/"):
            found.append(path)
    return found


def test_relative_links_are_found():
    text = (
        "[a](docs/x.md#y) [b](https://example.com) `[c](no.md)` [d](#here) [f](/abs)\n"
        "```\n[g](fenced.md)\n```\n"
        "[e]: ../z.md\n"
    )
    assert relative_links(text) == ["docs/x.md", "../z.md"]


def test_every_relative_link_points_at_an_existing_file():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = [
        f"{page.relative_to(ROOT)}: {target}"
        for page in pages
        for target in relative_links(page.read_text())
        if not (page.parent / target).exists()
    ]
    assert not broken, f"relative links to files that do not exist: {broken}"


def test_the_guides_gcs_role_is_the_one_the_local_stack_enforces():
    """docs/guide/vault-copies.md's gcloud command creates the role the local stack holds
    the functions to (shardvault/local/gcs_iam.py): the two cannot drift apart."""
    from shardvault.gcp.storage import COPY_WRITER_PERMISSIONS

    guide = (ROOT / "docs" / "guide" / "vault-copies.md").read_text()
    (listed,) = re.findall(r"--permissions=(\S+)", guide)
    assert frozenset(listed.split(",")) == COPY_WRITER_PERMISSIONS
