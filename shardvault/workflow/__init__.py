"""What every workflow shares: a command handed to one agent (``dispatch``), a per-node step
over any number of nodes (``fanout``), which nodes take part (``membership``) and why an
operation failed (``causes``)."""
