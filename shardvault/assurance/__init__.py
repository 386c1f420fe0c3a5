"""What says a backup can be trusted: verify without a restore (``verify``), restore drills
(``drills``), readiness before the next backup (``readiness``), each agent's round trip to
the store (``probe``) and the watch on a timer (``watch``)."""
