"""The restore workflow's steps, each called by one Lambda handler, as backup's are: validate
(``admission``), plan (``planner``, with ``placement``: which target node restores which
shard), thaw, sign and record each download (``download``), finalize and clean up
(``failure``). What a restore reads of its source is in ``sources``; its catalog record's key
in ``record``."""
