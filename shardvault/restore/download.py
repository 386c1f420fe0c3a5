"""Download: the control plane's side of each download item: its presigned URLs, and what the
agent wrote recorded."""

from __future__ import annotations

from typing import Any

from shardvault.aws.services import Services
from shardvault.contracts.catalog import restore_key
from shardvault.contracts.models import DownloadItem
from shardvault.restore.sources import readable_place


def sign_download(item: DownloadItem, svc: Services) -> dict[str, Any]:
    """A presigned GET URL of one object (the agent reads ranges of it), written to the work
    bucket for the dispatcher: a URL never enters the execution's history."""
    bucket, key, version = readable_place(
        svc, item.source, item.key, item.version_id, item.restore_id
    )
    url = bucket.presign_get(key, svc.settings.url_ttl_seconds, version)
    return {"url_key": svc.put_urls(item.restore_id, item.key, {"url": url})}


def record_download(item: DownloadItem, written: int | None, svc: Services) -> None:
    """Counts a downloaded object in the restore's progress (what the CLI shows): the bytes
    the node says it wrote (a chain member's object writes only its placements)."""
    svc.catalog.add_progress(
        item.target_cluster,
        restore_key(item.restore_id),
        bytes_done=item.length if written is None else written,
        objects_done=1,
    )
