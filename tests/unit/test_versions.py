"""Both programs say which version is installed (what an operator reports with a problem)."""

from __future__ import annotations

from importlib.metadata import version

import pytest
from shardvault_agent import cli as agent_cli

from shardvault.client import cli


@pytest.mark.parametrize(
    ("main", "distribution"), [(cli.main, "shardvault"), (agent_cli.main, "shardvault-agent")]
)
def test_version_prints_the_installed_version(main, distribution, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"{distribution} {version(distribution)}"
