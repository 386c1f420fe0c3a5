"""PostgreSQL's WAL: segment names and runs (``pgwal``), the continuous archive the agents
fill (``archive``) and point-in-time restores from it (``pitr``)."""
