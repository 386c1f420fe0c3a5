"""The Lambda code asset: its hash follows its inputs, and its requirements are enough for
every handler to import (checked on this host's platform, with nothing else on sys.path)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from infra.bundling import Platform, asset_hash, build_asset
from infra.constants import FUNCTIONS, LAMBDA_REQUIREMENTS, LAMBDA_SOURCE_DIRS, REPO_ROOT


def _copy_sources(target: Path) -> None:
    for name in LAMBDA_SOURCE_DIRS:
        shutil.copytree(REPO_ROOT / name, target / name)


def test_asset_hash_follows_sources_requirements_and_platform(tmp_path: Path) -> None:
    _copy_sources(tmp_path)
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(LAMBDA_REQUIREMENTS.read_text())
    arm = Platform("aarch64")
    first = asset_hash(tmp_path, requirements, arm)
    assert asset_hash(tmp_path, requirements, arm) == first
    assert asset_hash(tmp_path, requirements, Platform("x86_64")) != first
    (tmp_path / "functions" / "dispatch.py").write_text("# changed\n", encoding="utf-8")
    changed = asset_hash(tmp_path, requirements, arm)
    assert changed != first
    requirements.write_text(requirements.read_text() + "# changed\n")
    assert asset_hash(tmp_path, requirements, arm) != changed


def test_every_handler_imports_with_only_the_lambda_requirements(tmp_path: Path) -> None:
    host = Platform(platform.machine(), f"{sys.version_info.major}.{sys.version_info.minor}")
    asset = tmp_path / "asset"
    build_asset(asset, REPO_ROOT, LAMBDA_REQUIREMENTS, host)
    modules = [f"functions.{spec.module}" for spec in FUNCTIONS]
    script = (
        f"import importlib, sys; sys.path.insert(0, {str(asset)!r}); "
        f"[importlib.import_module(m) for m in {modules!r}]"
    )
    # -S: no site-packages, so the asset alone must supply every third-party module.
    result = subprocess.run(
        [sys.executable, "-S", "-c", script],
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"], "AWS_DEFAULT_REGION": "us-east-1"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # The client side is not shipped: the CLI, the local stack (moto, MinIO) and the like.
    shipped = {p.relative_to(asset).as_posix() for p in (asset / "shardvault").rglob("*.py")}
    assert "shardvault/restore/planner.py" in shipped
    assert not [p for p in shipped if p.startswith(("shardvault/client/", "shardvault/local/"))]
