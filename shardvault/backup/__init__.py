"""The steps of the backup workflow, each called by one Lambda handler.

validate -> (agents flush, checkpoint) -> plan(data) -> per object: (agent packs) -> sign ->
(agent uploads) -> complete+verify -> check_uploads -> (agents stop) -> plan(tail) -> ... ->
(agents release) -> finalize. On failure: cleanup. After an execution that was aborted or timed
out (it skipped its failure path): reap. Steps in parentheses run on the agents, dispatched
through their inboxes; everything here runs in the control plane and never touches backup
data, except to read an object back when the store cannot report its checksum.

Where each step lives (modules are named for what they hold, so no module is shadowed by the
step function re-exported here):
- ``admission``: the request checked against the registry and the policy file, the cluster's
  lock taken, the backup recorded as RUNNING (``validate``, ``take_lock``, ``vault_target``).
- ``answers``: the agents' answers of listing commands, read back from the work bucket by
  their receipts (``read_answers``).
- ``planner``: the agents' answers to shard listings and an object plan (``plan``), whose
  single-PUT objects packed as they were listed are signed at once (``upload.sign_at_plan``).
- ``upload``: per object, ``sign`` and ``complete`` (with ``verify_object``); after the Upload
  map, ``check_uploads`` (which verifies the objects signed at plan).
- ``manifest``: the manifest, the summary and cost estimate, the lock released (``finalize``).
- ``failure``: the failure path (``cleanup``), a refused scheduled run's notice
  (``report_refusal``), cleanup after an abandoned execution
  (``clean_up_abandoned``, also used by ``admission`` to take over a lock) and reaping
  (``reap``).
- ``cuts``: the scheduled cut, the backup's cut with no backup (``plan``, ``record``), and what
  a restore to one needs (``resolve``, ``base_for``, ``check_reached``); it uses
  ``admission``'s checks of the cluster's nodes.

Dependencies inside the package go one way: ``admission`` uses ``failure``; ``manifest`` uses
``planner``; ``planner`` uses ``answers`` and ``upload``. Callers use the names re-exported
here (``from shardvault import backup``).
"""

from shardvault.backup.admission import (
    check_agents_current,
    check_nodes_available,
    take_lock,
    upload_limits,
    validate,
    vault_target,
)
from shardvault.backup.failure import (
    REAPED_STATUSES,
    TAKEN_OVER,
    clean_up_abandoned,
    cleanup,
    reap,
    reaped_error,
    report_refusal,
)
from shardvault.backup.manifest import finalize
from shardvault.backup.planner import check_listings_match_sources, plan
from shardvault.backup.upload import check_uploads, complete, sign, verify_object

__all__ = [
    "REAPED_STATUSES",
    "TAKEN_OVER",
    "check_agents_current",
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
    "report_refusal",
    "sign",
    "take_lock",
    "upload_limits",
    "validate",
    "vault_target",
    "verify_object",
]
