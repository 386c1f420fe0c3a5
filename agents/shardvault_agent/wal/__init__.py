"""PostgreSQL's continuous WAL archive on a node: ``walspool`` is the archive_command (it
imports nothing of ShardVault's, so it can run as a lone file), ``archiver`` sends the spool's
segments to the store in batches."""
