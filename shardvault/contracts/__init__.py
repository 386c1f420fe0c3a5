"""What crosses a process boundary, so both sides read it from one place: requests, node
records, plans and manifests (``models``), the agent commands' arguments and results
(``commands``), the store's key layout (``layout``), the WAL
archive's batches (``wal_archive``), PostgreSQL's WAL names (``pgwal``), extents
(``extents``), the cut's point (``cut``), the validation queries' gate (``sqlcheck``), what
the control plane knows of each engine (``engines``) and facts of the deployed stack
(``deployment``). The agent imports these; they import no workflow."""
