"""PostgreSQL's continuous WAL archive, the control plane's side: signing and recording the
agents' batches (``archive``) and point-in-time restores from it (``pitr``)."""
