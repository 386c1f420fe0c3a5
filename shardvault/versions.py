"""What the programs' ``--version`` prints: the installed distribution's version, one source
(each ``pyproject.toml``), read from the installed metadata."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def installed(distribution: str) -> str:
    """The installed version of ``distribution``, e.g. ``shardvault-agent``."""
    try:
        return version(distribution)
    except PackageNotFoundError:  # run from a checkout without installing it
        return "(not installed)"
