"""The restore workflow's steps, each called by one Lambda handler (``steps``), and which
target node restores which shard (``placement``)."""
