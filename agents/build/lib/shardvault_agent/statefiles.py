"""The agent's state files under ``state_dir`` (captures, restore layouts, what a restore
started, adopted shards): JSON written whole or not at all."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: Path, data: Any) -> None:
    """Writes through a temporary file and a rename: a crash leaves the old file or the new
    one, never half of one (an agent restarted mid-write reads its state back)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)
