"""What crosses a process boundary: requests, node records, plans and manifests (``models``),
the cut's point (``cut``), the validation queries' gate (``sqlcheck``) and what the control
plane knows of each engine (``engines``). The agent imports these; they import no workflow."""
