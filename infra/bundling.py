"""Local bundling of the Lambda code asset: the repository's packages plus wheels, no Docker.

The *asset* is one directory shared by every function: ``shardvault/`` (but its client side,
``CLIENT_ONLY``) and ``functions/`` copied from the repository, plus the wheels of
``requirements-lambda.txt`` installed for the functions' *platform* (CPU architecture and
Python version). The *dependency cache* keeps each such install under
``.cache/lambda-deps/<key>``, the key being a hash of the requirements file and the platform,
so that a second synth links files instead of calling pip. The asset's hash is computed from
the same inputs, so an unchanged asset already in ``cdk.out`` is not rebuilt.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import jsii
from aws_cdk import AssetHashType, BundlingOptions, DockerImage, ILocalBundling
from aws_cdk import aws_lambda as lambda_

from infra.constants import LAMBDA_REQUIREMENTS, LAMBDA_SOURCE_DIRS, REPO_ROOT

# Bump when the layout of the asset changes, so that stale cached assets are not reused.
BUNDLE_FORMAT = "2"
DEPENDENCY_CACHE = REPO_ROOT / ".cache" / "lambda-deps"
# Never pulled: local bundling always succeeds or raises, so CDK never falls back to Docker.
UNUSED_IMAGE = DockerImage.from_registry("local-bundling-only")
# The client side of the shared package: the CLI, what it calls, the local stack and its
# scheduler. No handler imports them, and they would import what the asset does not ship
# (rich, moto): left out, they cannot be reached in a function's code either.
CLIENT_ONLY = (
    "shardvault/client",  # the shardvault command
    "shardvault/local",  # the local stack
)


def shipped(relative: str) -> bool:
    """Whether a repository path (posix, relative) goes into the asset."""
    return not any(relative == c or relative.startswith(f"{c}/") for c in CLIENT_ONLY)


class BundlingError(RuntimeError):
    """The asset could not be built locally (pip failed, or a source is unreadable)."""


@dataclass(frozen=True)
class Platform:
    """Where the code runs: a CPU architecture as pip names it, and a Python version."""

    architecture: str  # "aarch64" or "x86_64"
    python_version: str = "3.12"

    @classmethod
    def for_lambda(cls, architecture: lambda_.Architecture, python_version: str) -> Platform:
        # By name: jsii hands out a new proxy object for each read of Architecture.ARM_64.
        arch = {"arm64": "aarch64", "x86_64": "x86_64"}[architecture.name]
        return cls(arch, python_version)

    @property
    def pip_platform(self) -> str:
        return f"manylinux2014_{self.architecture}"


def _source_files(root: Path, dirs: Iterable[str]) -> Iterator[Path]:
    for name in dirs:
        base = root / name
        if not base.is_dir():
            continue  # a package not written yet: the asset holds whatever exists
        for path in sorted(base.rglob("*")):
            ignored = "__pycache__" in path.parts or path.suffix == ".pyc"
            if path.is_file() and not ignored and shipped(path.relative_to(root).as_posix()):
                yield path


def dependency_key(requirements: Path, platform: Platform) -> str:
    digest = hashlib.sha256(requirements.read_bytes())
    digest.update(f"{platform.pip_platform}/{platform.python_version}".encode())
    return digest.hexdigest()[:20]


def asset_hash(root: Path, requirements: Path, platform: Platform) -> str:
    """Changes whenever a source file, the requirements or the platform changes."""
    digest = hashlib.sha256(f"{BUNDLE_FORMAT}/{dependency_key(requirements, platform)}".encode())
    for path in _source_files(root, LAMBDA_SOURCE_DIRS):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def install_dependencies(requirements: Path, platform: Platform, target: Path) -> None:
    """Installs wheels only (nothing compiled here), for the target platform, not this host."""
    command = [
        *(sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"),
        *("--target", str(target), "--platform", platform.pip_platform),
        *("--implementation", "cp", "--python-version", platform.python_version),
        # No bytecode: this host's interpreter would write .pyc files the runtime cannot use.
        *("--only-binary=:all:", "--no-compile", "-r", str(requirements)),
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise BundlingError(f"pip could not install {requirements.name}:\n{result.stderr}")


def cached_dependencies(
    requirements: Path, platform: Platform, cache: Path = DEPENDENCY_CACHE
) -> Path:
    """The installed requirements for ``platform``, installed once and then reused."""
    final = cache / dependency_key(requirements, platform)
    if final.is_dir():
        return final
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{final.name}.", dir=cache))
    try:
        install_dependencies(requirements, platform, staging)
        staging.rename(final)  # atomic: a cache entry is complete or absent
    except OSError:
        if not final.is_dir():  # another synth won the race: its entry is as good
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _link_or_copy(src: str, dst: str) -> None:
    # Cached wheels are never modified, so a hard link is safe and much faster than a copy.
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def build_asset(output: Path, root: Path, requirements: Path, platform: Platform) -> None:
    """Fills ``output`` with the dependencies and the repository's packages (these last)."""
    deps = cached_dependencies(requirements, platform)
    shutil.copytree(deps, output, copy_function=_link_or_copy, dirs_exist_ok=True)
    for path in _source_files(root, LAMBDA_SOURCE_DIRS):
        target = output / path.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)


@jsii.implements(ILocalBundling)
class LocalBundler:
    """CDK's hook for bundling without Docker; it raises rather than fall back to Docker."""

    def __init__(self, root: Path, requirements: Path, platform: Platform) -> None:
        self.root, self.requirements, self.platform = root, requirements, platform

    def try_bundle(self, output_dir: str, options: BundlingOptions) -> bool:
        build_asset(Path(output_dir), self.root, self.requirements, self.platform)
        return True


def lambda_code(
    platform: Platform, root: Path = REPO_ROOT, requirements: Path = LAMBDA_REQUIREMENTS
) -> lambda_.Code:
    """One code asset; pass the same object to every function so that it is built once."""
    return lambda_.Code.from_asset(
        str(root),
        # A custom hash: CDK would otherwise fingerprint the whole repository (.venv included).
        asset_hash_type=AssetHashType.CUSTOM,
        asset_hash=asset_hash(root, requirements, platform),
        bundling=BundlingOptions(
            image=UNUSED_IMAGE, local=LocalBundler(root, requirements, platform)
        ),
    )
