"""DynamoDB access: the node registry, the agents' command inboxes and the backup catalog.

- *Nodes*: one item per node (``node_id``), written only by that node's agent; queried by
  cluster through the ``by_cluster`` index.
- *Inbox*: commands for a node (``node_id``, ``command_id``), each with the Step Functions
  task token the agent answers. An agent may read and write only its own partition. The
  partition's *doorbell* item (``command_id`` = ``#doorbell``) counts the posts: an agent
  reads that one small item on each poll and reads the whole partition only when it rang. A
  command stays in the inbox while it runs (it is how a restarted agent finds its work), so
  reading the partition on every poll would read every running command's arguments (part
  URLs, checksums: tens of KB each) 20 times a second: paid read units on AWS, and most of
  the local control plane's CPU.
- *Failure notes*: when a command fails, its agent also writes the error and its cause into
  its own partition (``command_id`` = ``#failed:<command id>``). Step Functions keeps the
  cause of ``SendTaskFailure``, but moto keeps only the error's name, and a cause that does
  not arrive must not be made up: the failure path reads these notes
  (``shardvault.workflow.causes``). Items whose ``command_id`` starts with ``#`` are never commands.
- *Catalog*: one item per backup (``cluster``, ``backup_id``) plus one lock item per cluster
  while a backup runs. The catalog indexes the manifests in the store and can be rebuilt from
  them; it is never the only copy of anything.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterable, Iterator
from decimal import Decimal
from typing import Any, TypeVar

import boto3
from boto3.dynamodb.conditions import Attr, ConditionBase, Key
from botocore.exceptions import ClientError
from pydantic import ValidationError

from shardvault.contracts.catalog import (
    ARCHIVE_KEY,
    CUT_PREFIX,
    DRILL_PREFIX,
    RESTORE_PREFIX,
    ArchiveTotals,
    BackupItem,
    CatalogItem,
    Changes,
    CutItem,
    DrillItem,
    LockItem,
    RestoreItem,
    cut_key,
    kind_of,
    restore_key,
)
from shardvault.contracts.models import CUT_ID_PREFIX, NodeRecord, ThrottleReport, id_second

log = logging.getLogger("shardvault.aws.tables")
Item = TypeVar("Item", bound=CatalogItem)
THROTTLED = {
    "ProvisionedThroughputExceededException",
    "ThrottlingException",
    "RequestLimitExceeded",
}

LOCK_KEY = "#lock"
DRILL_LOCK_KEY = "#drill"  # under a drill's target cluster: one drill restores there at a time
DOORBELL_KEY = "#doorbell"  # the inbox item whose counter each post increments
FAILURE_PREFIX = "#failed:"  # inbox items noting why a command failed (see Inbox.note_failure)
NEWEST_PAGE_ITEMS = 16  # items a page of Catalog.newest_backup's query reads (before its filter)
NEWEST_TRIES = 3  # Catalog.newest_backup's searches, when the chosen backup changed meanwhile


def is_backup(sort_key: str) -> bool:
    """Backup ids start with their date; '#' items (the lock, the archive's counters),
    restores and drills are no backups."""
    return kind_of(sort_key) is BackupItem


def below_cuts(cluster: str) -> ConditionBase:
    """The cluster's items whose keys sort before ``cut#``: its backups (ids begin with a digit)
    and its ``#`` items, not its cuts, drills and restores. A cluster cut every few minutes
    holds thousands of cut items, which no reader of backups should page through."""
    return Key("cluster").eq(cluster) & Key("backup_id").lt(CUT_PREFIX)


def start_second(backup_id: str) -> str:
    """The start second a backup id begins with (``20261129T061235Z``)."""
    return backup_id.split("-", 1)[0]


def completion_order(record: BackupItem) -> tuple[float, str]:
    """A backup's place in the order its cluster's backups completed. Not its id alone: two
    backups started in one second (a small cluster's full, then an incremental) have ids that
    sort by their random suffix."""
    return record.completed_at or 0.0, record.backup_id


INBOX_TTL_SECONDS = 7 * 24 * 3600


def plain(value: Any) -> Any:
    """DynamoDB's Decimals back to ints and floats, recursively."""
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def dynamo(value: Any) -> Any:
    """Floats to Decimals, recursively (the resource API refuses floats)."""
    if isinstance(value, float):
        return Decimal(str(value))
    if isinstance(value, dict):
        return {k: dynamo(v) for k, v in value.items()}
    if isinstance(value, list):
        return [dynamo(v) for v in value]
    return value


def scan_all(dynamo_table: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """Every item a scan reads, across pages."""
    return every_page(dynamo_table.scan, kwargs)


def query_all(dynamo_table: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """Every item a query matches, across pages."""
    return every_page(dynamo_table.query, kwargs)


def every_page(read: Any, kwargs: dict[str, Any]) -> list[dict[str, Any]]:
    """Every item of a paged read (a table's ``scan`` or ``query``) with these arguments."""
    return list(paged_items(read, kwargs))


def paged_items(read: Any, kwargs: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The items of a paged read, a page read only when the caller gets to it."""
    while True:
        page = read(**kwargs)
        yield from page.get("Items", [])
        if "LastEvaluatedKey" not in page:
            return
        kwargs["ExclusiveStartKey"] = page["LastEvaluatedKey"]


def readable(kind: type[Item], items: Iterable[dict[str, Any]]) -> list[Item]:
    """The items of a listing as ``kind``; one that does not read as its kind (a partial item,
    written by hand or by an update that found no item) is left out of the list, logged by
    its key, and left in the table: one bad item must not hide a cluster's backups."""
    out = []
    for item in items:
        try:
            out.append(kind.from_item(plain(item)))
        except ValidationError as error:
            log.warning(
                "catalog item %s/%s is not a readable %s, left out: %s",
                item.get("cluster"),
                item.get("backup_id"),
                kind.__name__,
                error.errors()[0]["msg"],
            )
    return out


def table(name: str) -> Any:
    return boto3.resource("dynamodb").Table(name)


class NodeRegistry:
    def __init__(self, nodes_table: Any) -> None:
        self.table = nodes_table

    def put(self, record: NodeRecord) -> None:
        self.table.put_item(Item=dynamo(record.model_dump(mode="json")))

    def get(self, node_id: str) -> NodeRecord | None:
        item = self.table.get_item(Key={"node_id": node_id}, ConsistentRead=True).get("Item")
        return NodeRecord.model_validate(plain(item)) if item else None

    def remove(self, node_id: str) -> None:
        self.table.delete_item(Key={"node_id": node_id})

    def in_cluster(self, cluster: str) -> list[NodeRecord]:
        items = query_all(
            self.table, IndexName="by_cluster", KeyConditionExpression=Key("cluster").eq(cluster)
        )
        return sorted((NodeRecord.model_validate(plain(i)) for i in items), key=lambda n: n.node_id)

    def everyone(self) -> list[NodeRecord]:
        """Every registered node, of every cluster (one scan)."""
        items = scan_all(self.table)
        return sorted((NodeRecord.model_validate(plain(i)) for i in items), key=lambda n: n.node_id)

    def clusters(self) -> list[str]:
        """Every cluster with a registered node (for error messages that suggest names)."""
        items = scan_all(
            self.table, ProjectionExpression="#c", ExpressionAttributeNames={"#c": "cluster"}
        )
        return sorted({i["cluster"] for i in items})


class Inbox:
    def __init__(self, inbox_table: Any) -> None:
        self.table = inbox_table

    def post(self, node_id: str, command_id: str, command: str, args: dict, token: str) -> None:
        """Writes (or replaces, on a retry) a command with the task token to answer. Each
        post has its own ``dispatch_id``: a retry may carry the same token (moto reuses it)."""
        now = time.time()
        self.table.put_item(
            Item=dynamo(
                {
                    "node_id": node_id,
                    "command_id": command_id,
                    "dispatch_id": uuid.uuid4().hex,
                    "command": command,
                    "args": args,
                    "task_token": token,
                    "posted_at": now,
                    "expires_at": int(now + INBOX_TTL_SECONDS),
                }
            )
        )
        self.ring(node_id)  # after the command is in: an agent that hears it will find it

    def ring(self, node_id: str) -> None:
        self.table.update_item(
            Key={"node_id": node_id, "command_id": DOORBELL_KEY},
            UpdateExpression="ADD rings :one",
            ExpressionAttributeValues={":one": 1},
        )

    def rings(self, node_id: str) -> int:
        """How many posts the node's inbox has had (0 before the first): one small read."""
        item = self.table.get_item(
            Key={"node_id": node_id, "command_id": DOORBELL_KEY},
            ConsistentRead=True,
            ProjectionExpression="rings",
        ).get("Item")
        return int(item["rings"]) if item else 0

    def pending(self, node_id: str) -> list[dict[str, Any]]:
        # Command ids start with a letter; "#..." items (doorbell, failure notes) sort before
        # "$", so the key condition leaves them out without reading them.
        condition = Key("node_id").eq(node_id) & Key("command_id").gt("$")
        return [
            plain(i)
            for i in query_all(self.table, KeyConditionExpression=condition, ConsistentRead=True)
            if not i["command_id"].startswith("#")  # the doorbell, failure notes
        ]

    def note_failure(self, node_id: str, item: dict[str, Any], error: str, cause: str) -> None:
        """Written by the agent before it answers ``SendTaskFailure``: the operation's failure
        path then finds the cause even where the answer's cause is lost."""
        now = time.time()
        self.table.put_item(
            Item=dynamo(
                {
                    "node_id": node_id,
                    "command_id": f"{FAILURE_PREFIX}{item['command_id']}",
                    "operation_id": item.get("args", {}).get("backup_id", ""),
                    "command": item["command"],
                    "error": error,
                    "cause": cause,
                    "failed_at": now,
                    "expires_at": int(now + INBOX_TTL_SECONDS),
                }
            )
        )

    def failures(self, node_id: str, operation_id: str) -> list[dict[str, Any]]:
        """The failure notes of one operation (a backup or restore id) on one node."""
        condition = Key("node_id").eq(node_id) & Key("command_id").begins_with(FAILURE_PREFIX)
        return [
            plain(i)
            for i in query_all(self.table, KeyConditionExpression=condition, ConsistentRead=True)
            if i.get("operation_id") == operation_id
        ]

    def remove(self, node_id: str, command_id: str, dispatch_id: str) -> None:
        """Deletes a command unless a retry has posted it anew meanwhile."""
        try:
            self.table.delete_item(
                Key={"node_id": node_id, "command_id": command_id},
                ConditionExpression=Attr("dispatch_id").eq(dispatch_id),
            )
        except ClientError as error:
            if error.response["Error"]["Code"] != "ConditionalCheckFailedException":
                raise


class Catalog:
    def __init__(self, catalog_table: Any) -> None:
        self.table = catalog_table

    def try_lock(
        self, cluster: str, backup_id: str, execution_id: str, key: str = LOCK_KEY
    ) -> LockItem | None:
        """Takes the cluster's lock ``key`` (the backup lock, or a drill target's); returns
        the current holder if it is taken (one with no holder: it let go just then)."""
        if self._put_lock(cluster, key, backup_id, execution_id, Attr("cluster").not_exists()):
            return None
        return self.lock_holder(cluster, key) or LockItem(
            cluster=cluster, backup_id=key, holder="", execution_id="", locked_at=0.0
        )

    def take_over_lock(
        self, cluster: str, key: str, previous_execution: str, backup_id: str, execution_id: str
    ) -> bool:
        """Takes the lock from a holder whose execution ended, unless someone else did first."""
        condition = Attr("execution_id").eq(previous_execution)
        return self._put_lock(cluster, key, backup_id, execution_id, condition)

    def _put_lock(
        self, cluster: str, key: str, backup_id: str, execution_id: str, condition: Any
    ) -> bool:
        try:
            self.table.put_item(
                Item={
                    "cluster": cluster,
                    "backup_id": key,
                    "holder": backup_id,
                    "execution_id": execution_id,
                    "locked_at": Decimal(str(time.time())),
                },
                ConditionExpression=condition,
            )
            return True
        except ClientError as error:
            if error.response["Error"]["Code"] != "ConditionalCheckFailedException":
                raise
        return False

    def lock_holder(self, cluster: str, key: str = LOCK_KEY) -> LockItem | None:
        return self._read(LockItem, cluster, key)

    def unlock(self, cluster: str, backup_id: str, key: str = LOCK_KEY) -> None:
        try:
            self.table.delete_item(
                Key={"cluster": cluster, "backup_id": key},
                ConditionExpression=Attr("holder").eq(backup_id),
            )
        except ClientError as error:
            if error.response["Error"]["Code"] != "ConditionalCheckFailedException":
                raise

    def put(self, item: CatalogItem) -> None:
        self.table.put_item(Item=dynamo(item.stored()))

    def delete_cut(self, cluster: str, cut_id: str) -> None:
        """Deletes a scheduled cut's item (``lifecycle.sweep``), and never another kind (the
        sweep's grant cannot be narrowed to these keys)."""
        key = cut_key(cut_id)
        assert kind_of(key) is CutItem, key
        self.table.delete_item(Key={"cluster": cluster, "backup_id": key})

    def update(self, cluster: str, key: str, changes: Changes) -> None:
        """Sets fields of one item (a backup's id, ``restore_key`` or ``drill_key``), checked
        against its kind's model when ``changes`` was made."""
        if kind_of(key) is not changes.kind:
            raise ValueError(f"{changes.kind.__name__} changes cannot go to item {key!r}")
        fields = changes.values
        names = {f"#{k}": k for k in fields}
        values = {f":{k}": dynamo(v) for k, v in fields.items()}
        self.table.update_item(
            Key={"cluster": cluster, "backup_id": key},
            UpdateExpression="SET " + ", ".join(f"#{k} = :{k}" for k in fields),
            ExpressionAttributeNames=names,
            ExpressionAttributeValues=values,
        )

    def count_archived(
        self, cluster: str, *, stored_bytes: int, wal_bytes: int, now: float
    ) -> None:
        """Adds one recorded WAL batch to the cluster's archive counters: what the cost model
        measures the archive's daily growth from (``archive_totals``)."""
        self.table.update_item(
            Key={"cluster": cluster, "backup_id": ARCHIVE_KEY},
            UpdateExpression="ADD stored_bytes :s, wal_bytes :w, batches :one "
            "SET first_at = if_not_exists(first_at, :now), last_at = :now",
            ExpressionAttributeValues={
                ":s": stored_bytes,
                ":w": wal_bytes,
                ":one": 1,
                ":now": Decimal(str(now)),
            },
        )

    def archive_totals(self, cluster: str) -> ArchiveTotals | None:
        """The cluster's archive counters (``count_archived``); None if it never archived."""
        return self._read(ArchiveTotals, cluster, ARCHIVE_KEY, consistent=False)

    def add_progress(
        self,
        cluster: str,
        backup_id: str,
        *,
        bytes_done: int,
        objects_done: int,
        throttle: ThrottleReport | None = None,
        held_log_bytes: int | None = None,
    ) -> bool:
        """Counts an object done on the operation's item, with the agent's adaptive throttle
        as it packed the object (the latest report stays: one node's) and the most log the
        backup held on a source (the largest any node reported). Progress is for display:
        with a thousand objects in flight, all on one item, DynamoDB may throttle the item's
        partition, and a count it refuses (after boto3's retries) is dropped, not turned into
        a failed object. A count for an item that does not exist is dropped too: it would
        write an item with no status, which no reader could read. Returns whether it was
        counted."""
        update = "ADD bytes_done :b, objects_done :o"
        values: dict[str, Any] = {":b": bytes_done, ":o": objects_done}
        if throttle is not None:
            update += " SET throttle = :t"
            values[":t"] = dynamo(throttle.model_dump(mode="json"))
        key = {"cluster": cluster, "backup_id": backup_id}
        try:
            self.table.update_item(
                Key=key,
                UpdateExpression=update,
                ConditionExpression="attribute_exists(#s)",
                ExpressionAttributeNames={"#s": "status"},
                ExpressionAttributeValues=values,
            )
            if held_log_bytes is not None:
                self._raise_held_log(key, held_log_bytes)
        except ClientError as error:
            code = error.response.get("Error", {}).get("Code")
            if code not in THROTTLED and code != "ConditionalCheckFailedException":
                raise
            log.warning("progress of %s/%s not counted: %s", cluster, backup_id, error)
            return False
        return True

    def _raise_held_log(self, key: dict[str, str], held: int) -> None:
        """Sets ``held_log_bytes`` to ``held`` unless a node already reported more."""
        with contextlib.suppress(self.table.meta.client.exceptions.ConditionalCheckFailedException):
            self.table.update_item(
                Key=key,
                UpdateExpression="SET held_log_bytes = :h",
                ConditionExpression="attribute_exists(#s) AND "
                "(attribute_not_exists(held_log_bytes) OR held_log_bytes < :h)",
                ExpressionAttributeNames={"#s": "status"},
                ExpressionAttributeValues={":h": held},
            )

    def get(self, cluster: str, backup_id: str) -> BackupItem | None:
        return self._read(BackupItem, cluster, backup_id)

    def restore(self, cluster: str, restore_id: str) -> RestoreItem | None:
        """A restore into ``cluster``."""
        return self._read(RestoreItem, cluster, restore_key(restore_id))

    def _read(
        self, kind: type[Item], cluster: str, key: str, *, consistent: bool = True
    ) -> Item | None:
        found = self.table.get_item(
            Key={"cluster": cluster, "backup_id": key}, ConsistentRead=consistent
        ).get("Item")
        return kind.from_item(plain(found)) if found else None

    def status(self, cluster: str, backup_id: str) -> str | None:
        """Only the ``status`` of one item (None: no such item): all an agent may read of
        the catalog (its IAM grant is limited to these attributes)."""
        item = self.table.get_item(
            Key={"cluster": cluster, "backup_id": backup_id},
            ConsistentRead=True,
            ProjectionExpression="#s",
            ExpressionAttributeNames={"#s": "status"},
        ).get("Item")
        return item.get("status") if item else None

    def backups(self, cluster: str) -> list[BackupItem]:
        items = query_all(self.table, KeyConditionExpression=below_cuts(cluster))
        return readable(BackupItem, (i for i in items if is_backup(i["backup_id"])))

    def newest_backup(self, cluster: str, status: str) -> BackupItem | None:
        """The record of the cluster's backup in ``status`` that reached it last
        (``completion_order``; ``newest_backup_id``), read whole once it is chosen. One whose
        status changed between the two reads (expired just then) is looked for again."""
        for _ in range(NEWEST_TRIES):
            backup_id = self.newest_backup_id(cluster, status)
            if backup_id is None:
                return None
            record = self.get(cluster, backup_id)
            if record is not None and record.status == status:
                return record
        return None

    def newest_backup_id(self, cluster: str, status: str) -> str | None:
        """The id of the cluster's backup in ``status`` that reached it last, read back from
        the newest backup id: a page or two, not the cluster's whole history. Backup ids begin
        with their start second, and the cluster's lock runs one backup at a time (it is
        taken over only from an execution that ended), so none started in an earlier second
        completed later; the ids of one second are all read. A page holds
        ``NEWEST_PAGE_ITEMS`` items (without a limit DynamoDB fills a page to 1 MB before the
        filter, the history of most clusters), and of each only what orders it: whole items
        cost moto about 4 ms each to answer, and an incremental's Validate grew from 26 to
        77 ms over three bench rounds; the query of ids took 4 to 9 ms at every depth of a
        chain of six (dev probe)."""
        query: dict[str, object] = {  # cuts, drills and restores sort after: not read
            "KeyConditionExpression": below_cuts(cluster),
            "FilterExpression": Attr("status").eq(status),
            "ProjectionExpression": "backup_id, completed_at",
            "ScanIndexForward": False,
            "Limit": NEWEST_PAGE_ITEMS,
        }
        found: list[tuple[float, str]] = []
        for item in paged_items(self.table.query, query):
            backup_id = item["backup_id"]
            if not is_backup(backup_id):
                continue
            if found and start_second(backup_id) != start_second(found[0][1]):
                break
            found.append((float(item.get("completed_at", 0)), backup_id))
        return max(found, default=(0.0, None))[1]

    def restores(self, cluster: str) -> list[RestoreItem]:
        """Restores into ``cluster`` (items keyed ``restore#<restore_id>``)."""
        return self._prefixed(RestoreItem, cluster, RESTORE_PREFIX)

    def drills(self, cluster: str) -> list[DrillItem]:
        """Drills of ``cluster`` (items keyed ``drill#<drill_id>``), oldest first."""
        return self._prefixed(DrillItem, cluster, DRILL_PREFIX)

    def _prefixed(self, kind: type[Item], cluster: str, prefix: str) -> list[Item]:
        """The cluster's items of one kind, whose keys begin with ``prefix``, in key order."""
        items = query_all(
            self.table,
            KeyConditionExpression=Key("cluster").eq(cluster)
            & Key("backup_id").begins_with(prefix),
        )
        return readable(kind, items)

    def cut(self, cluster: str, cut_id: str) -> CutItem | None:
        return self._read(CutItem, cluster, cut_key(cut_id))

    def cuts_before(self, cluster: str, epoch: float) -> Iterator[CutItem]:
        """The cluster's cuts whose ids' time is at or before ``epoch``, newest first, a page
        at a time: a cut's id begins with its plan's second (before its instant), so the keys
        sort by time and a restore's "newest cut before T" reads from T back, not the whole
        history."""
        newest = cut_key(f"{CUT_ID_PREFIX}{id_second(epoch)}~")  # after every id of that second
        query = {
            "KeyConditionExpression": Key("cluster").eq(cluster)
            & Key("backup_id").between(CUT_PREFIX, newest),
            "ScanIndexForward": False,
            "Limit": NEWEST_PAGE_ITEMS,
        }
        for item in paged_items(self.table.query, query):
            yield from readable(CutItem, [item])

    def cuts(self, cluster: str) -> list[CutItem]:
        """Scheduled cuts of ``cluster`` (items keyed ``cut#<cut_id>``), oldest first."""
        return self._prefixed(CutItem, cluster, CUT_PREFIX)

    def all_backups(self) -> list[BackupItem]:
        return readable(BackupItem, (i for i in scan_all(self.table) if is_backup(i["backup_id"])))
