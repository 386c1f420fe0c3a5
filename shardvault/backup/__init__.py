"""The steps of the backup workflow, each called by one Lambda handler.

validate -> (agents flush, checkpoint) -> plan(data) -> per object: (agent checksums) -> sign ->
(agent uploads) -> complete+verify -> check_uploads -> (agents stop) -> plan(tail) -> ... ->
(agents release) -> finalize. On failure: cleanup. After an execution that was aborted or timed
out (it skipped its failure path): reap. Steps in parentheses run on the agents, dispatched
through their inboxes; everything here runs in the control plane and never touches backup
data, except to read an object back when the store cannot report its checksum.

Where each step lives:
- ``validate``: the request checked against the registry and the policy file, the cluster's
  lock taken, the backup recorded as RUNNING (``validate``, ``take_lock``, ``vault_target``).
- ``plan``: the agents' answers to shard listings and an object plan (``plan``).
- ``upload``: per object, ``sign`` and ``complete`` (with ``verify_object``); after the Upload
  map, ``check_uploads``.
- ``finalize``: the manifest, the summary and cost estimate, the lock released (``finalize``).
- ``cleanup``: the failure path (``cleanup``), cleanup after an abandoned execution
  (``clean_up_abandoned``, also used by ``validate`` to take over a lock) and reaping
  (``reap``).

Dependencies inside the package go one way: ``validate`` uses ``cleanup``; ``finalize`` uses
``plan``. Callers use the names re-exported here (``from shardvault import backup``).

The step functions re-exported here shadow the modules of the same name: ``backup.validate``
is the function, not the module. Import a name from its module (``from
shardvault.backup.validate import take_lock``), and patch a module that a function looks its
helpers up in through ``importlib.import_module("shardvault.backup.validate")``.
"""

from shardvault.backup.cleanup import (
    REAPED_STATUSES,
    TAKEN_OVER,
    clean_up_abandoned,
    cleanup,
    reap,
    reaped_error,
)
from shardvault.backup.finalize import finalize
from shardvault.backup.plan import check_listings_match_sources, plan
from shardvault.backup.upload import check_uploads, complete, sign, verify_object
from shardvault.backup.validate import (
    check_nodes_available,
    take_lock,
    upload_limits,
    validate,
    vault_target,
)

__all__ = [
    "REAPED_STATUSES",
    "TAKEN_OVER",
    "check_listings_match_sources",
    "check_nodes_available",
    "check_uploads",
    "clean_up_abandoned",
    "cleanup",
    "complete",
    "finalize",
    "plan",
    "reap",
    "reaped_error",
    "sign",
    "take_lock",
    "upload_limits",
    "validate",
    "vault_target",
    "verify_object",
]
